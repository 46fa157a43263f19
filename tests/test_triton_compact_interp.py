"""The Triton prefill helpers against their torch oracles, on CPU under the Triton interpreter, in
subprocesses (``TRITON_INTERPRET=1`` must be set before Triton is imported): the compaction of
admitted keys (``compact_admitted_triton`` vs ``compact_admitted``, on the compacted rows) and the
one-launch plan (``build_vertical_slash_plan_triton`` vs ``build_vertical_slash_plan``). On a GPU host
the compiled kernels are tested by tests/test_gpu_attention.py."""

import os

import pytest

from sglang_wgkv.testing.interp import InterpCheck, assert_seed_ok, cpu_only

CPU_ONLY = cpu_only()
pytestmark = [pytest.mark.core, CPU_ONLY]

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "triton_compact_interp_check.py")
PLAN_CHECK = os.path.join(HERE, "triton_plan_interp_check.py")


COMPACT_SEEDS, PLAN_SEEDS = range(8), range(12)
# each check script once, over all its seeds (one Triton import per script)
COMPACT_RUN = InterpCheck(CHECK, tuple(map(str, COMPACT_SEEDS)))
PLAN_RUN = InterpCheck(PLAN_CHECK, tuple(map(str, PLAN_SEEDS)))


@pytest.fixture(scope="module")
def runs(interp_runner):
    return {"compact": interp_runner.result(COMPACT_RUN), "plan": interp_runner.result(PLAN_RUN)}


@pytest.mark.parametrize(
    "check,seed",
    [("compact", s) for s in COMPACT_SEEDS] + [("plan", s) for s in PLAN_SEEDS],
    ids=[f"compact-{s}" for s in COMPACT_SEEDS] + [f"plan-{s}" for s in PLAN_SEEDS],
)
def test_triton_helper_matches_torch_under_interpreter(runs, check, seed):
    assert_seed_ok(runs[check], seed)
