"""One request longer than the dense pool, and per-request budgets, in a real CPU server
(``integration/scheduling/long_requests.py``): the embedded model and its shipped gates, a KV budget of 2048
dense tokens (a dense-equivalent pool of 1469) under overcommit, and a ~2.5K-token passkey prompt.

* the long prompt completes beside a short request, answers as the full cache does (its output
  logprobs equal the float32 offline harness's, which holds every admitted token), and the short
  request's output equals its output alone; the pool is idle-checked clean afterwards;
* the same prompt with every token admitted (``tau`` 0) outgrows the pool: it is compressed, within
  its own pages, and completes; the log and ``usage["wgkv"]`` say so;
* ``custom_params.wgkv.kv_budget``: 400s for bad values, and a budgeted request's streams stay within
  its budget while an unbudgeted one beside it is untouched;
* with admission off, a request longer than the dense-equivalent pool gets a 400 before any work.
"""

import random
import threading

import pytest
import requests

from sglang_wgkv.testing.server_pool import shared_server
from sglang_wgkv.testing.serving import OfflineTruth, embedded_model_dir, embedded_plan

pytestmark = pytest.mark.serving

BUDGET = 2048  # --max-total-tokens
FACTOR = 3.0  # a logical pool of 4407 tokens: SGLang's own length limit lies past the passkey prompt
CHUNK = 512
W_LOCAL = 256
PLAN = embedded_plan(BUDGET, local_window=W_LOCAL, overcommit=FACTOR)
RANDOM_TOKENS = 640  # the budgeted pair: both fit the physical pool, and 384 past the ring exceed the budget
PASSKEY_TOKENS = 2500  # past the dense-equivalent pool and, with its ring, the budget, as the long tests need
TOLERANCE = 1e-3  # float32 against float32 (tests/test_served_matches_offline.py)


# a pooled server of its own arguments (started ahead, while the modules before this one run)
server = shared_server(
    "--max-total-tokens",
    str(BUDGET),
    "--wgkv-overcommit",
    str(FACTOR),
    "--chunked-prefill-size",
    str(CHUNK),
    "--disable-radix-cache",
    "--log-level",
    "info",
)


@pytest.fixture(scope="module")
def passkey():
    """``(prompt ids, key)``: a ~2.5K-token passkey prompt of the RULER builder (evals/ruler.py)."""
    from transformers import AutoTokenizer

    from evals.ruler import _Builder

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    sample = _Builder(tok, []).passkey(random.Random(7), PASSKEY_TOKENS)
    return sample["prompt"], tok.decode(sample["answer"])


def _post(server, body, timeout=1200):
    return requests.post(server.url + "/generate", json=body, timeout=timeout)


def _usage(out):
    return [u for u in out["meta_info"]["wgkv"] if u][-1]


def _params(max_new, **wgkv):
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    if wgkv:
        params["custom_params"] = {"wgkv": wgkv}
    return params


@pytest.mark.parametrize(
    "bad, why",
    [
        ("512", "positive integer"),
        (1.5, "positive integer"),
        (True, "positive integer"),
        (W_LOCAL - 16, "below the ring"),
        (8192 + 1, "above the context length"),
    ],
)
def test_bad_kv_budget_is_a_400(server, bad, why):
    r = _post(server, {"text": "Hello", "sampling_params": _params(2, kv_budget=bad)})
    assert r.status_code == 400 and why in r.text, r.text
    assert server.alive()


def test_budgeted_request_is_held_to_its_budget_beside_an_unbudgeted_one(server):
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 30000) for _ in range(RANDOM_TOKENS)] for _ in range(2)]
    outs = _post(
        server,
        {
            "input_ids": prompts,
            "sampling_params": [_params(4, tau=0.0, kv_budget=W_LOCAL), _params(4, tau=0.0)],
        },
    ).json()
    bounded, free = (_usage(o) for o in outs)
    assert (bounded["kv_budget"], bounded["kv_budget_source"]) == (W_LOCAL, "request")
    assert bounded["max_global_tokens_per_head"] <= W_LOCAL and bounded["evicted_tokens"] > 0
    # tau 0 admits every token: the unbudgeted request keeps all that left its ring
    assert (free["kv_budget"], free["evicted_tokens"], free["eviction_triggers"]) == (None, 0, 0)
    assert free["max_global_tokens_per_head"] == free["cached_tokens"] - W_LOCAL
    server.wait_idle_checked()


def test_admission_off_longer_than_the_dense_pool_is_a_400(server, passkey):
    prompt, _ = passkey
    r = _post(server, {"input_ids": prompt, "sampling_params": _params(4, admission=False)})
    assert r.status_code == 400 and "admission off" in r.text, r.text
    assert str(PLAN.max_request_tokens) in r.text
    assert server.alive()


def test_long_prompt_completes_beside_a_short_one_as_the_full_cache_answers(server, passkey):
    prompt, key = passkey
    assert len(prompt) > PLAN.max_request_tokens and len(prompt) > BUDGET  # dense, it would not fit
    short = "Name three colors of the rainbow."
    alone = server.generate(short, max_new_tokens=12)["output_ids"]
    results = {}

    def long_request():
        body = {"input_ids": prompt, "sampling_params": _params(8), "return_logprob": True}
        results["long"] = _post(server, body).json()

    thread = threading.Thread(target=long_request)
    thread.start()
    beside = server.generate(short, max_new_tokens=12)["output_ids"]
    thread.join()
    assert beside == alone
    out = results["long"]
    usage = _usage(out)
    assert usage["kv_budget_source"] == "pool" and usage["cached_tokens"] >= len(prompt)
    print(f"passkey {key}: answered {out['text']!r}")
    stats = server.wait_idle_checked()
    assert stats["free_pages"] == stats["total_pages"]
    # no compression was needed (what the gates admit fits): the answer is the full cache's
    assert usage["evicted_tokens"] == 0, usage
    truth = OfflineTruth(embedded_model_dir(), _shipped_gates(), W_LOCAL)
    served = [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]
    offline = truth.logprobs_ids(prompt, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(served, offline)) <= TOLERANCE


def test_long_prompt_that_outgrows_the_pool_is_compressed_and_completes(server, passkey):
    prompt, _ = passkey
    out = _post(server, {"input_ids": prompt, "sampling_params": _params(8, tau=0.0)}).json()
    usage = _usage(out)
    assert out["meta_info"]["completion_tokens"] == 8
    assert usage["kv_budget_source"] == "pool" and usage["evicted_tokens"] > 0
    streams = 30 * 3  # the embedded model's layers x KV heads
    assert usage["mean_global_tokens_per_head"] * streams <= usage["kv_budget_total"] + streams
    assert usage["cached_tokens"] - W_LOCAL > BUDGET  # admitted all, held far less
    log = server.log_path.read_text(errors="replace")
    assert "longer than the dense-equivalent pool" in log and "compressed early" in log
    stats = server.wait_idle_checked()
    assert stats["free_pages"] == stats["total_pages"] and server.alive()


def _shipped_gates():
    from sglang_wgkv.embedded_model import SHIPPED_GATES

    return SHIPPED_GATES
