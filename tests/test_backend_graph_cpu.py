"""The wgkv backend's CUDA-graph decode path (capture/replay preparation, padded rows on the scratch
slot, kernels path per layer) against its eager reference decode, under the Triton interpreter.

One subprocess (``TRITON_INTERPRET=1`` must be set before the kernels are imported); see
:mod:`backend_graph_check` for what is checked.
"""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU "
    "host tests/test_gpu_serving.py runs the compiled path under real CUDA graphs",
)
def test_graph_decode_path_matches_eager_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU even on a GPU host
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "backend_graph_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(HERE),
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-3:] == [
        "decode gate: DecodeGate OK",
        "decode gate: PrefillGate.admit OK",
        "decode gate: DecodeGate (float8_e4m3fn pages) OK",
    ], proc.stdout[-3000:] + proc.stderr[-3000:]
