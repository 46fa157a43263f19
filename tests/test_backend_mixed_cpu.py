"""The wgkv backend's mixed forward (prefill rows and decode rows in one forward, the decode rows on
the kernels path) against separate extend and decode forwards on the reference path, under the
Triton interpreter.

One subprocess (``TRITON_INTERPRET=1`` must be set before the kernels are imported); see
:mod:`backend_mixed_check` for what is checked.
"""

import os

import pytest
import torch

from sglang_wgkv.testing.interp import InterpCheck

pytestmark = pytest.mark.serving

HERE = os.path.dirname(os.path.abspath(__file__))
MIXED_RUN = InterpCheck(os.path.join(HERE, "backend_mixed_check.py"))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU host tests/test_gpu_mixed.py "
    "runs the compiled kernels in mixed forwards",
)
def test_mixed_forward_matches_separate_forwards(interp_runner):
    proc = interp_runner.result(MIXED_RUN)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1:] == ["mixed forward: kernels path OK"], (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
