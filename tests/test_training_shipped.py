"""The gates shipped as package data load, fit the embedded SmolLM2-135M shape and say how they were trained."""

import json
from pathlib import Path

import pytest
import torch

import sglang_wgkv
from sglang_wgkv.gate import load_gates

pytestmark = pytest.mark.training

GATES = Path(sglang_wgkv.__file__).parent / "data" / "gates"


@pytest.mark.parametrize("name,lam", [("smollm2-135m", 0.1), ("smollm2-135m-lam0.3", 0.3)])
def test_shipped_gates_fit_smollm2(name, lam):
    gates = load_gates(GATES / name)
    gates.check_model(num_layers=30, num_kv_heads=3, head_dim=64)
    c = gates.config
    assert (c.tau, c.local_window, c.lam, c.model_id, c.hidden) == (
        0.1,
        256,
        lam,
        "SmolLM2-135M-Instruct",
        256,
    )
    training = json.loads((GATES / name / "gates.json").read_text())["training"]
    # issue 16: at least 2,000 steps, and the command that trained them
    assert training["step"] >= 2000 and training["command"].startswith("python -m sglang_wgkv.training train")
    assert lam in training["lams"]
    k = torch.randn(5, 3, 64)
    g = gates(0, k, k)
    assert g.shape == (5, 3) and ((g >= 0) & (g <= 1)).all()
