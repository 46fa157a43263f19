"""A served forward's host work does not grow with its requests: the launches of an extend (new
prompts, chunks after a cached prefix), a mixed forward and a decode step, counted on CPU with the
Triton kernels interpreted (``tests/host_ops_check.py``, ``benchmarks/host_ops.py``), are the same for
a few requests and for several, hold no host sync, and stay within the counts reached; and the Triton
variants they would compile on an sm_90 GPU are the same at other sizes."""

import os

import pytest

from sglang_wgkv.testing.interp import InterpCheck, assert_seed_ok, cpu_only

CPU_ONLY = cpu_only("counts the CPU run of the kernels path (the interpreter's)")
pytestmark = [pytest.mark.core, CPU_ONLY]

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ops_check.py")
CASES = (
    "extend",
    "chunk_after_prefix",
    "mixed",
    "mixed_after_prefix",
    "decode",
    "mixed_after_prefix_fp8",
    "decode_fp8",
)
RUN = InterpCheck(CHECK, (*CASES, "variants"))


@pytest.fixture(scope="module")
def run(interp_runner):
    return interp_runner.result(RUN)


@pytest.mark.parametrize("case", CASES)
def test_launches_do_not_grow_with_the_batch(run, case):
    assert_seed_ok(run, case)


def test_batches_of_other_sizes_compile_nothing_new(run):
    """The Triton variants a served forward needs on sm_90 depend on its kind, not on its sizes."""
    assert_seed_ok(run, "variants")
