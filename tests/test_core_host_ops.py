"""A served forward's host work does not grow with its requests: the launches of an extend (new
prompts, chunks after a cached prefix), a mixed forward and a decode step, counted on CPU with the
Triton kernels interpreted (``tests/host_ops_check.py``, ``benchmarks/host_ops.py``), are the same for
a few requests and for several, hold no host sync, and stay within the counts reached."""

import os

import pytest

from sglang_wgkv.testing.interp import InterpCheck, assert_seed_ok, cpu_only

CPU_ONLY = cpu_only("counts the CPU run of the kernels path (the interpreter's)")
pytestmark = [pytest.mark.core, CPU_ONLY]

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ops_check.py")
CASES = ("extend", "chunk_after_prefix", "mixed", "decode")
RUN = InterpCheck(CHECK, CASES)


@pytest.fixture(scope="module")
def run(interp_runner):
    return interp_runner.result(RUN)


@pytest.mark.parametrize("case", CASES)
def test_launches_do_not_grow_with_the_batch(run, case):
    assert_seed_ok(run, case)
