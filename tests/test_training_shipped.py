"""The gates shipped as package data load and fit the embedded SmolLM2-135M shape."""

from pathlib import Path

import pytest
import torch

import sglang_wgkv
from sglang_wgkv.gate import load_gates

pytestmark = pytest.mark.training

SHIPPED = Path(sglang_wgkv.__file__).parent / "data" / "gates" / "smollm2-135m"


def test_shipped_gates_fit_smollm2():
    gates = load_gates(SHIPPED)
    gates.check_model(num_layers=30, num_kv_heads=3, head_dim=64)
    c = gates.config
    assert (c.tau, c.local_window, c.lam, c.model_id) == (0.1, 256, 0.1, "SmolLM2-135M-Instruct")
    assert c.hidden == 256  # its gates.json still says "expand": 4
    k = torch.randn(5, 3, 64)
    g = gates(0, k, k)
    assert g.shape == (5, 3) and ((g >= 0) & (g <= 1)).all()
