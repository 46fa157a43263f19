"""Triton decode promotion (``triton_pool.decode_promote`` / ``begin_decode(triton_decode=True)``)
leaves the pool bit-identical to the torch ``_promote``: checked on CPU under the Triton
interpreter, in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported)."""

import os
import subprocess
import sys

import pytest
import torch

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU host the compiled kernels are tested (gpu marker), and Triton 3.6's interpreter fails there under the device's NumPy (only 0-dimensional arrays can be converted to Python scalars)",
)
pytestmark = [pytest.mark.core, CPU_ONLY]

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_pool_interp_check.py")


@pytest.mark.parametrize("seed,scan_block", [(0, None), (1, 8), (2, None), (4, 8)])
def test_decode_promote_matches_torch_under_interpreter(seed, scan_block):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")  # CPU even on a GPU host
    cmd = [sys.executable, CHECK, str(seed)] + ([str(scan_block)] if scan_block else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.startswith(f"ok seed {seed}"), res.stdout


FP8_CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_fp8_pool_interp_check.py")


@pytest.mark.parametrize("seed,dtype", [(0, "e4m3"), (1, "e5m2")])
def test_fp8_decode_launches_match_torch_under_interpreter(seed, dtype):
    """An FP8 pool: the Triton ring write quantizes as the torch one (within the interpreter's FP8
    rounding), promotion moves the bytes; same tables, lengths, flags and counters."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(
        [sys.executable, FP8_CHECK, str(seed), dtype], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.startswith(f"ok seed {seed}"), res.stdout
