"""The Triton prefill helpers against their torch oracles, on CPU under the Triton interpreter, in
subprocesses (``TRITON_INTERPRET=1`` must be set before Triton is imported): the compaction of
admitted keys (``compact_admitted_triton`` vs ``compact_admitted``, on the compacted rows) and the
one-launch plan (``build_vertical_slash_plan_triton`` vs ``build_vertical_slash_plan``). On a GPU host
the compiled kernels are tested by tests/test_gpu_attention.py."""

import os

import pytest
import torch

from sglang_wgkv.testing.interp import run_interp_check

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; the GPU runs the compiled kernel (gpu marker)",
)
pytestmark = [pytest.mark.core, CPU_ONLY]

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "triton_compact_interp_check.py")
PLAN_CHECK = os.path.join(HERE, "triton_plan_interp_check.py")


@pytest.mark.parametrize(
    "check,seed",
    [(CHECK, s) for s in range(8)] + [(PLAN_CHECK, s) for s in range(12)],
    ids=[f"compact-{s}" for s in range(8)] + [f"plan-{s}" for s in range(12)],
)
def test_triton_helper_matches_torch_under_interpreter(check, seed):
    res = run_interp_check(check, seed, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.startswith(f"ok seed {seed}"), res.stdout
