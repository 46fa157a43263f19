"""The wgkv backend's mixed forward (prefill rows and decode rows in one forward, the decode rows on
the kernels path) against separate extend and decode forwards on the reference path, under the
Triton interpreter.

One subprocess (``TRITON_INTERPRET=1`` must be set before the kernels are imported); see
:mod:`backend_mixed_check` for what is checked.
"""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.serving


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU host tests/test_gpu_mixed.py "
    "runs the compiled kernels in mixed forwards",
)
def test_mixed_forward_matches_separate_forwards():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU even on a GPU host
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "backend_mixed_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(HERE),
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1:] == ["mixed forward: kernels path OK"], (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
