"""The GPU serving comparison's cases (tests/test_gpu_serving.py, benchmarks/logprob_floor.py): the
embedded SmolLM2 under per-KV-head fixed gates, a kernels path against the bf16 torch reference, each
judged by its distance from the float32 truth (:class:`~sglang_wgkv.testing.serving.OfflineTruth`)."""

from __future__ import annotations

from sglang_wgkv.testing.serving import long_prompt

W_LOCAL = 64
NEW_TOKENS = 48
TIE_GAP = 0.3  # a greedy divergence is accepted where the reference's top-2 are this close
# the kernels path's largest logprob error against float32 may exceed the bf16 reference's by this factor
# and slack (same tokens, same bf16 weights and GEMMs: only attention, graphs and kernels differ)
FLOOR_FACTOR, FLOOR_SLACK = 1.5, 0.05
PROMPTS = [
    "The capital of France is",
    long_prompt(4),  # ~50 tokens: crosses W_local while decoding
    long_prompt(25, seed=1),  # ~300 tokens
    long_prompt(45, seed=3),  # ~560 tokens
]


# The servers' own arguments (benchmarks/logprob_floor.py runs the same two, plus the kernels eager).
HEAD_BIAS = [-30.0, 30.0, 30.0]  # per KV head: head 0 admits nothing, heads 1 and 2 everything
SERVER_ARGS = {
    "kernels": ["--dtype", "bfloat16", "--wgkv-attention", "kernels", "--cuda-graph-max-bs-decode", "8"],
    "reference": ["--dtype", "bfloat16", "--wgkv-attention", "reference"],
}


# What every server of this comparison shares beside its model and gates.
SERVER_SETTINGS = (
    "--max-total-tokens",
    "40000",
    "--mem-fraction-static",
    "0.3",
    "--sampling-backend",
    "pytorch",
    "--log-level",
    "info",
    "--decode-log-interval",
    "4",
    "--wgkv-local-window",
    str(W_LOCAL),
)


def common_args(model_dir: str, gates_dir) -> list[str]:
    """What every server of this comparison shares (gates saved with HEAD_BIAS and W_LOCAL)."""
    return ["--model-path", model_dir, *SERVER_SETTINGS, "--wgkv-gates", str(gates_dir)]


def agree(got, want, prompt):
    """Same tokens up to the first divergence, which must be a near-tie of the reference's; returns it."""
    ids, _, _ = got
    ref_ids, _, ref_top = want
    n = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), len(ref_ids))
    if n < len(ref_ids):
        gap = ref_top[n][0] - ref_top[n][1]
        assert gap < TIE_GAP, (
            f"{prompt[:50]!r}: token {n} differs ({ids[n]} vs {ref_ids[n]}), top-2 gap {gap:.3f}"
        )
    return n


def path_errors(run, true_logprobs: list[float]) -> list[float]:
    """|served - float32| logprob per output token of one run, ``true_logprobs`` being float32's
    along that run's own tokens (OfflineTruth.logprobs)."""
    assert len(run[1]) == len(true_logprobs), (len(run[1]), len(true_logprobs))
    return [abs(a - t) for a, t in zip(run[1], true_logprobs)]


def within_floor(e_kernels: list[float], e_reference: list[float]) -> bool:
    """The kernels path's largest error against float32 is within the bf16 reference's own
    (FLOOR_FACTOR times it plus FLOOR_SLACK)."""
    return max(e_kernels, default=0.0) <= FLOOR_FACTOR * max(e_reference, default=0.0) + FLOOR_SLACK
