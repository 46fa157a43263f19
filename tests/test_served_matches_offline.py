"""The served float32 reference path against the offline harness, token by token: the short model
(``sglang_wgkv.testing.short_model``: the embedded SmolLM2's first layers) with the GPU test's
per-head gates (head 0 admits nothing, heads 1-2 everything) at W_local 32 through a real CPU server
(the soak's, shared), greedy, and the same tokens teacher-forced through
``sglang_wgkv.testing.serving.OfflineTruth`` (``evals.harness.teacher_forced_logprobs``: key j visible to query i iff i - j < W_local or admitted).

Both compute in float32, so they agree to float32 rounding (measured 1e-5): the ring, promotion and
the decode path's attention of the server are the paper's semantics, and OfflineTruth is a float32
truth the GPU test (tests/test_gpu_serving.py) can hold the bf16 paths against. A W_local off by one
in the offline policy moves the logprobs by orders of magnitude more on the prompts that cross the
window, so the tolerance below tells the semantics apart.
"""

import pytest

from sglang_wgkv.testing.gpu_serving_cases import HEAD_BIAS, PROMPTS
from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import OfflineTruth, embedded_model_dir, flush_cache, save_head_gates
from sglang_wgkv.testing.short_model import SHORT_LAYERS, short_model_dir
from sglang_wgkv.testing.soak import CPU_SERVER_ARGS

pytestmark = pytest.mark.serving
TOLERANCE = 1e-3  # float32 against float32; a bf16 path lies ~0.1 from it (benchmarks/logprob_floor.py)
W_LOCAL = 32
# the shortest prompt (~6 tokens) crosses W_local = 32 while decoding, the others while prefilling
NEW_TOKENS = 32


def _greedy(server, prompts):
    outs = server.generate(
        prompts, max_new_tokens=NEW_TOKENS, return_logprob=True, sampling_params={"ignore_eos": True}
    )
    return [(o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _max_error(truth, prompt, run) -> float:
    ids, lps = run
    return max(abs(a - b) for a, b in zip(lps, truth.logprobs(prompt, ids)))


# the soak's server (shared): the short model in float32 on the reference path (CPU), the GPU
# comparison's per-head biases at W_local 32, 128-token chunks (the longer prompts span several)
assert HeadGates(tuple(HEAD_BIAS), W_LOCAL, SHORT_LAYERS) in CPU_SERVER_ARGS
server = shared_server(*CPU_SERVER_ARGS)


@pytest.fixture(scope="module")
def model_dir():
    embedded_model_dir()  # skips before the server is leased when the GGUF is not installed
    return short_model_dir(SHORT_LAYERS)


def test_float32_server_equals_offline_harness(model_dir, server, tmp_path):
    gates = save_head_gates(tmp_path / "gates", HEAD_BIAS, W_LOCAL, num_layers=SHORT_LAYERS)
    flush_cache(server)  # shared: no prefix of another module's requests
    alone = [_greedy(server, [p])[0] for p in PROMPTS]
    batched = _greedy(server, PROMPTS)  # one concurrent batch of four lengths
    truth = OfflineTruth(model_dir, gates, W_LOCAL)
    for p, a, b in zip(PROMPTS, alone, batched):
        assert _max_error(truth, p, a) <= TOLERANCE, p[:40]
        assert _max_error(truth, p, b) <= TOLERANCE, p[:40]
    # the tolerance separates the served window from one key more or less
    for window in (W_LOCAL - 1, W_LOCAL + 1):
        off = truth.with_window(window)
        assert max(_max_error(off, p, a) for p, a in zip(PROMPTS, alone)) > 10 * TOLERANCE, window
