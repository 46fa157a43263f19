"""Triton decode promotion (``triton_pool.decode_promote`` / ``begin_decode(triton_decode=True)``)
leaves the pool bit-identical to the torch ``_promote``: checked on CPU under the Triton
interpreter, in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported)."""

import os

import pytest
import torch

from sglang_wgkv.testing.interp import InterpCheck, assert_seed_ok

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU host the compiled kernels are tested (gpu marker), and Triton 3.6's interpreter fails there under the device's NumPy (only 0-dimensional arrays can be converted to Python scalars)",
)
pytestmark = [pytest.mark.core, CPU_ONLY]

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_pool_interp_check.py")


CASES = ["0", "1/8", "2", "4/8"]  # SEED or SEED/SCAN_BLOCK (the promotion scan over blocks of 8 items)


POOL_RUN = InterpCheck(CHECK, tuple(CASES))


@pytest.fixture(scope="module")
def run(interp_runner):
    return interp_runner.result(POOL_RUN)


@pytest.mark.parametrize("case", CASES)
def test_decode_promote_matches_torch_under_interpreter(run, case):
    assert_seed_ok(run, case)


FP8_CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_fp8_pool_interp_check.py")


FP8_CASES = ["0/e4m3", "1/e5m2"]  # SEED/DTYPE
FP8_RUN = InterpCheck(FP8_CHECK, tuple(FP8_CASES))


@pytest.fixture(scope="module")
def fp8_run(interp_runner):
    return interp_runner.result(FP8_RUN)


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_decode_launches_match_torch_under_interpreter(fp8_run, case):
    """An FP8 pool: the Triton ring write quantizes as the torch one (within the interpreter's FP8
    rounding), promotion moves the bytes; same tables, lengths, flags and counters."""
    assert_seed_ok(fp8_run, case)
