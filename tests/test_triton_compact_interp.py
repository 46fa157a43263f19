"""Triton compaction of admitted keys (``triton_prefill.compact_admitted_triton``) equals the torch
``compact_admitted`` on the compacted rows: checked on CPU under the Triton interpreter, in a
subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported). On a GPU host the compiled
kernel is tested by tests/test_gpu_attention.py."""

import os
import subprocess
import sys

import pytest
import torch

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is the CPU CI stand-in; the GPU runs the compiled kernel (gpu marker)")
pytestmark = [pytest.mark.core, CPU_ONLY]

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_compact_interp_check.py")


@pytest.mark.parametrize("seed", range(8))
def test_compact_admitted_matches_torch_under_interpreter(seed):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, CHECK, str(seed)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.startswith(f"ok seed {seed}"), res.stdout
