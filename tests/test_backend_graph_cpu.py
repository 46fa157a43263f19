"""The wgkv backend's CUDA-graph decode path (capture/replay preparation, padded rows on the scratch
slot, kernels path per layer) against its eager reference decode, under the Triton interpreter.

One subprocess (``TRITON_INTERPRET=1`` must be set before the kernels are imported); see
:mod:`backend_graph_check` for what is checked.
"""

import os

import pytest
import torch

from sglang_wgkv.testing.interp import InterpCheck

pytestmark = pytest.mark.serving

HERE = os.path.dirname(os.path.abspath(__file__))
GRAPH_RUN = InterpCheck(os.path.join(HERE, "backend_graph_check.py"))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU "
    "host tests/test_gpu_serving.py runs the compiled path under real CUDA graphs",
)
def test_graph_decode_path_matches_eager_reference(interp_runner):
    proc = interp_runner.result(GRAPH_RUN)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-4:] == [
        "decode gate: DecodeGate OK",
        "decode gate: PrefillGate.admit OK",
        "decode gate: DecodeGate OK, evictor window rows 2",
        "decode gate: DecodeGate (float8_e4m3fn pages) OK",
    ], proc.stdout[-3000:] + proc.stderr[-3000:]
