"""The real SGLang server with the wgkv backend on CPU: long chunked prompts, concurrency with
aborts, pool exhaustion, over-long prompts, and the idle invariants after all of it (what the embedded
model answers through the APIs: tests/test_serving_answers.py).

One server for the module (the equivalence tests' all-admit one, on the short model): W_local 32 and
128-token prefill chunks, so ordinary prompts leave the ring, get promoted, and are prefilled in
several chunks that read the cached context back.
"""

import threading
import time

import pytest
import requests

from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import long_prompt, stream_generate
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.serving


# the equivalence tests' all-admit server (shared; sigmoid(30) = 1 on every KV head)
server = shared_server(
    "--model-path", ShortModel(), "--chunked-prefill-size", "128", "--wgkv-local-window", "32",
    "--wgkv-gates", HeadGates((30.0, 30.0, 30.0), 32, SHORT_LAYERS),
)  # fmt: skip


def test_long_prompt_is_chunked_and_promoted(server):
    before = server.wgkv_stats()
    prompt = long_prompt(40)  # ~500 tokens: four 128-token chunks, most tokens leave the 32-slot ring
    out = server.generate(prompt, max_new_tokens=24, sampling_params={"ignore_eos": True})
    assert out["meta_info"]["prompt_tokens"] > 3 * 128
    after = server.wait_idle_checked()
    left = after["tokens_left_ring"] - before["tokens_left_ring"]
    promoted = after["tokens_promoted"] - before["tokens_promoted"]
    # In each of the SHORT_LAYERS x 3 (layer, head) streams, every cached token but the last W_local = 32 left
    # the ring (the last generated token is never cached); the gates admit all of them. The
    # overlap scheduler may run one more decode step before it sees the request finished.
    cached = out["meta_info"]["prompt_tokens"] + 24 - 1
    assert left in (SHORT_LAYERS * 3 * (cached - 32), SHORT_LAYERS * 3 * (cached + 1 - 32))
    assert promoted == left


def test_concurrent_requests_with_aborts(server):
    rids = [f"conc-{i}" for i in range(10)]
    aborted = set(rids[::3])
    results = {}
    threads = [
        threading.Thread(
            target=stream_generate,
            args=(server, rid, long_prompt(4 + i, seed=i), 48, 3 if rid in aborted else None, results),
        )
        for i, rid in enumerate(rids)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    for rid in rids:
        meta = results[rid]
        if rid in aborted:
            assert meta["finish_reason"]["type"] == "abort", meta
            assert meta["completion_tokens"] < 48
        else:
            assert meta["finish_reason"]["type"] == "length", meta
            assert meta["completion_tokens"] == 48
    stats = server.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]


def test_pool_exhaustion_queues_and_retracts(server):
    # 8 requests x (~130 prompt + 120 generated) tokens exceed the 1536 logical tokens of a
    # 2048-token budget: the scheduler must queue or retract, and every request still finishes.
    prompts = [long_prompt(10, seed=i) for i in range(8)]
    outs = server.generate(prompts, max_new_tokens=120, sampling_params={"ignore_eos": True}, timeout=1500)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [120] * 8
    total = sum(o["meta_info"]["prompt_tokens"] + 120 for o in outs)
    info = requests.get(server.url + "/server_info", timeout=60).json()
    assert total > info["max_total_num_tokens"]
    stats = server.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"] and server.alive()


def test_prompt_over_context_limit_is_rejected(server):
    info = requests.get(server.url + "/server_info", timeout=60).json()
    prompt = long_prompt(400)  # ~5000 tokens, above max_req_input_len of this small server
    r = requests.post(
        server.url + "/generate", timeout=120, json={"text": prompt, "sampling_params": {"max_new_tokens": 4}}
    )
    assert r.status_code == 400, r.text
    assert "exceeds the maximum allowed length" in r.json()["error"]["message"]
    assert info["max_req_input_len"] < 5000
    assert (
        server.generate("The capital of France is", max_new_tokens=8)["meta_info"]["completion_tokens"] == 8
    )


def test_idle_invariants_after_the_workload(server):
    from sglang_wgkv.integration.backend.attn_backend import LOG_SLOT_READBACK

    stats = server.wait_idle_checked()
    # every forward's batch carried its host request slots (no device read-back per forward)
    assert LOG_SLOT_READBACK not in server.log_path.read_text(errors="replace")
    assert stats["active_requests"] == 0
    held = stats["radix"]["snapshot_pages"]  # prefix snapshots (radix_ext) keep pages while idle
    assert (
        stats["free_pages"] + held == stats["total_pages"]
        and stats["used_bytes"] == held * stats["page_bytes"]
    )
    assert stats["requests_started"] == stats["requests_released"] > 0
    time.sleep(1)
    assert server.alive(), server.log_tail()
