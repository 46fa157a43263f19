"""With gates that admit everything, WG-KV serving must reproduce SGLang's own dense attention.

Two real servers, both float32 on CPU with the same 128-token prefill chunks: ``wgkv`` with an
all-admit gate checkpoint and W_local = 32 (so prompts leave the ring, are promoted, and chunked
prefill reads the cached context back from the dual pool), and upstream SGLang (``--disable-wgkv``:
torch_native attention, SGLang's own KV pool). Greedy outputs must be identical and the chosen
tokens' logprobs within 1e-3 (float32 summation-order noise; measured ~1e-5).
"""

import pytest

from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.serving

LOGPROB_TOL = 1e-3
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    long_prompt(18),  # ~230 tokens: two chunks
    long_prompt(45, seed=3),  # ~560 tokens: five chunks
]


# sigmoid(30) = 1: every token admitted; both on the short model (the embedded one's first layers)
wgkv_server = shared_server(
    "--model-path", ShortModel(), "--chunked-prefill-size", "128", "--wgkv-local-window", "32",
    "--wgkv-gates", HeadGates((30.0, 30.0, 30.0), 32, SHORT_LAYERS),
)  # fmt: skip
dense_server = shared_server("--model-path", ShortModel(), "--chunked-prefill-size", "128", "--disable-wgkv")


@pytest.fixture(scope="module")
def servers(wgkv_server, dense_server):
    flush_cache(wgkv_server)  # shared with tests/test_serving_api.py: no prefix of its requests
    return wgkv_server, dense_server


def _run(server, prompts, max_new_tokens):
    outs = server.generate(prompts, max_new_tokens=max_new_tokens, return_logprob=True)
    return [(o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@pytest.mark.parametrize("batched", [False, True], ids=["one_by_one", "batched"])
def test_all_admit_greedy_equals_upstream_dense(servers, batched):
    wgkv, dense = servers
    if batched:
        got, want = _run(wgkv, PROMPTS, 40), _run(dense, PROMPTS, 40)
    else:
        got = [_run(wgkv, [p], 40)[0] for p in PROMPTS]
        want = [_run(dense, [p], 40)[0] for p in PROMPTS]
    for prompt, (ids, lps), (ref_ids, ref_lps) in zip(PROMPTS, got, want):
        assert ids == ref_ids, prompt[:60]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < LOGPROB_TOL, prompt[:60]
    stats = wgkv.wait_idle_checked()
    assert stats["tokens_left_ring"] > 0 and stats["admitted_fraction"] == 1.0
