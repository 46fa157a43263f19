"""Mixed batches on the GPU's kernels path: decode rows (``folded_decode``, the decode gate, eagerly:
SGLang captures no mixed batch) in the same forward as a Triton prefill chunk, against separate
forwards (decode steps under CUDA graphs).

Two bfloat16 servers on the embedded SmolLM2 (skipped without its GGUF), the same per-head gates as
tests/test_gpu_serving.py (head 0 admits nothing, heads 1 and 2 everything; W_local 64):
``mixed`` (``--wgkv-forward-tokens 64``, mixed chunks on) and ``separate`` (``--wgkv-forward-tokens
0``). Short requests decode while long prompts (several 128-token chunks) arrive. The greedy outputs
agree up to a first divergence, which must be a near-tie of the float32 model along the shared
prefix (bf16 rounding differs with the batch's shape); the mixed server ran mixed forwards within the
budget and still decodes under CUDA graphs; both idle checks pass.
"""

import threading

import pytest
import torch
from test_serving_mixed import LONG, SHORT, _stream

from sglang_wgkv.testing.gpu_serving_cases import HEAD_BIAS, SERVER_ARGS, TIE_GAP, W_LOCAL, common_args
from sglang_wgkv.testing.serving import OfflineTruth, Server, embedded_model_dir, long_prompt, save_head_gates

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.serving,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)"),
]

BUDGET = 64
PROMPTS = [*SHORT, *LONG, long_prompt(45, seed=3)]


@pytest.fixture(scope="module")
def gates_dir(tmp_path_factory):
    return save_head_gates(tmp_path_factory.mktemp("gpu_mixed") / "gates", HEAD_BIAS, W_LOCAL)


@pytest.fixture(scope="module")
def servers(gates_dir):
    common = [
        *common_args(embedded_model_dir(), gates_dir),
        *SERVER_ARGS["kernels"],
        "--chunked-prefill-size",
        "128",
    ]
    started = {
        name: Server([*common, "--wgkv-forward-tokens", tokens], gates_dir.parent / f"{name}.log")
        for name, tokens in (("mixed", str(BUDGET)), ("separate", "0"))
    }
    try:
        yield started["mixed"].wait_healthy(), started["separate"].wait_healthy()
    finally:
        for srv in started.values():
            srv.stop()


def _traffic(server) -> list:
    """Three short requests decoding 64 tokens; once they decode, three long prompts (32 tokens each)."""
    out, threads = {}, []
    decoding = [threading.Event() for _ in SHORT]
    for i, prompt in enumerate(PROMPTS):
        if i == len(SHORT):
            for event in decoding:
                assert event.wait(300), "a short request produced no token"
        short = i < len(SHORT)
        args = (server, prompt, 64 if short else 32, decoding[i] if short else threading.Event(), out, i)
        threads.append(threading.Thread(target=_stream, args=args))
        threads[-1].start()
    for t in threads:
        t.join(900)
    return [out[i] for i in range(len(PROMPTS))]


def test_mixed_kernels_path_agrees_with_separate_forwards(servers, gates_dir):
    mixed, separate = servers
    got, want = _traffic(mixed), _traffic(separate)
    truth = OfflineTruth(embedded_model_dir(), gates_dir, W_LOCAL, device="cuda")
    for prompt, ids, ref in zip(PROMPTS, got, want):
        n = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
        if n is not None:  # the same context up to n: float32 must find both tokens about as likely
            gap = abs(truth.logprobs(prompt, ids[: n + 1])[n] - truth.logprobs(prompt, ref[: n + 1])[n])
            assert gap < TIE_GAP, f"{prompt[:50]!r}: token {n} differs ({ids[n]} vs {ref[n]}), gap {gap:.3f}"
    stats, plain = mixed.wait_idle_checked(), separate.wait_idle_checked()
    assert stats["mixed_forwards"] > 0 and plain["mixed_forwards"] == 0
    assert 0 < stats["mixed_prefill_tokens_max"] <= BUDGET
    assert "cuda graph: True" in mixed.log_path.read_text(), "no decode step ran on a CUDA graph"
