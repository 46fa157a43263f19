"""The Triton prefill gate (:mod:`sglang_wgkv.gate.triton_prefill_gate`) against the torch
:class:`~sglang_wgkv.gate.mlp.LayerGate` on CPU under the Triton interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before Triton is imported); and its argument checks, which run
before any launch. On a GPU host the compiled kernel is tested by tests/test_triton_gate.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from sglang_wgkv.testing.interp import InterpCheck, cpu_only, interp_env

CPU_ONLY = cpu_only()
pytestmark = pytest.mark.core

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "triton_prefill_gate_interp_check.py")
PREFILL_GATE_RUN = InterpCheck(CHECK)


@CPU_ONLY
def test_prefill_gate_matches_torch_under_interpreter(interp_runner):
    from triton_prefill_gate_interp_check import CASES, FOLD_CASES, HUGE_CASES, SPLIT_CASES

    res = interp_runner.result(PREFILL_GATE_RUN)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    split = len(SPLIT_CASES)
    assert len(rows) == 2 * (len(CASES) + split + len(HUGE_CASES) + len(FOLD_CASES)), (
        res.stdout[-2000:] + res.stderr[-3000:]
    )
    assert sum(r["launch"] == "bf16x3_split" for r in rows) == 2 * split
    assert sum(r["launch"] == "bf16x2_fold" for r in rows) == 2 * (len(FOLD_CASES) + len(HUGE_CASES))
    assert res.returncode == 0 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    # Gate values on both sides of 1/2 wherever there are enough of them (a gate stuck near 0 or 1
    # would hide errors in the logits).
    assert all(0 < r["below_half"] < r["of"] for r in rows if r["of"] >= 63), rows


def test_validation():
    from triton_prefill_gate_interp_check import make_gates

    from sglang_wgkv.gate.triton_prefill_gate import PrefillGate

    fused = PrefillGate(make_gates(2, 64, 96, 0, "cpu"))
    k = torch.zeros(5, 2, 64)
    with pytest.raises(ValueError, match="k_pre/k_post"):
        fused(0, torch.zeros(5, 3, 64), torch.zeros(5, 3, 64))
    with pytest.raises(ValueError, match="k_pre/k_post"):
        fused(0, torch.zeros(4, 2, 64), k)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        fused(0, k.double(), k.double())
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused(0, torch.zeros(5, 2, 128)[..., ::2], k)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        fused(2, k, k)
    with pytest.raises(ValueError, match="out must be"):
        fused(0, k, k, out=torch.zeros(5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        fused(0, k, k, out=torch.zeros(2, 5).t())
    tau = torch.zeros(5)
    with pytest.raises(ValueError, match="tau must be float32"):
        fused.admit(0, k, k, torch.zeros(4))
    with pytest.raises(ValueError, match="tau must be float32"):
        fused.admit(0, k, k, tau.double())
    with pytest.raises(ValueError, match="go together"):
        fused.admit(0, k, k, tau, uniform=torch.zeros(5, 2))
    with pytest.raises(ValueError, match="uniform must be"):
        fused.admit(0, k, k, tau, uniform=torch.zeros(2, 5).t(), random_p=0.5)
    with pytest.raises(ValueError, match="g_out must be"):
        fused.admit(0, k, k, tau, g_out=torch.zeros(5, 3))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        PrefillGate(make_gates(2, 48, 96, 0, "cpu"))
    # No rows: an empty [0, H] and no launch (a launch on the CPU without the interpreter would raise).
    empty = fused(1, torch.zeros(0, 2, 64, dtype=torch.bfloat16), torch.zeros(0, 2, 64, dtype=torch.bfloat16))
    assert empty.shape == (0, 2) and empty.dtype == torch.float32
    none = fused.admit(0, torch.zeros(0, 2, 64), torch.zeros(0, 2, 64), torch.zeros(0))
    assert none.shape == (0, 2) and none.dtype == torch.bool


@CPU_ONLY
def test_start_up_check_falls_back_where_the_kernel_cannot_run(caplog):
    """Without a GPU (and without the interpreter) the launch fails: the check answers None and says
    so in the log, so a server would prefill with the torch gate instead of failing at a request."""
    from triton_prefill_gate_interp_check import make_gates

    from sglang_wgkv.gate.triton_prefill_gate import checked_prefill_gate

    with caplog.at_level("WARNING"):
        assert checked_prefill_gate(make_gates(2, 64, 96, 0, "cpu"), rows=(8,)) is None
    assert "failed its start-up check" in caplog.text


START_UP_CHECK = """
import json
import torch
from triton_prefill_gate_interp_check import make_gates
from sglang_wgkv.gate import triton_prefill_gate as m
from sglang_wgkv.gate.prefill_gate_launch import LARGE_FROM_ROWS

gates = make_gates(2, 64, 96, 1, "cpu")
kept = m.checked_prefill_gate(gates, rows=(40, LARGE_FROM_ROWS), dtype=torch.bfloat16, random_p=0.25)
call = m.PrefillGate.__call__
m.PrefillGate.__call__ = lambda self, *a, **k: call(self, *a, **k) + 3 * m.CHECK_TOLERANCE
wrong = m.checked_prefill_gate(gates, rows=(40,))
print(json.dumps({"kept": type(kept).__name__, "wrong": wrong is None}))
"""


@CPU_ONLY
def test_start_up_check_accepts_the_kernel_and_refuses_a_wrong_one():
    env = {**interp_env(), "PYTHONPATH": os.pathsep.join([HERE, interp_env()["PYTHONPATH"]])}
    res = subprocess.run(
        [sys.executable, "-c", START_UP_CHECK], env=env, capture_output=True, text=True, timeout=300, cwd=HERE
    )
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert rows == [{"kept": "PrefillGate", "wrong": True}], res.stdout[-2000:] + res.stderr[-3000:]


def test_start_up_check_covers_every_served_launch():
    """The start-up check's cases compile every launch shape a served forward can take on CUDA (a
    new row tier left out of them would compile, unchecked, at its first request)."""
    from sglang_wgkv.gate.prefill_gate_launch import served_check_cases, served_launch

    cuda = torch.device("cuda")
    served = {served_launch(n, cuda) for n in (1, 299, 1023, 1024, 4096, 8191, 8192, 131072)}
    checked = {launch or served_launch(n, cuda) for n, launch in served_check_cases(cuda)}
    assert served <= checked and len(served) == 3
    assert all(n < 8192 for n, _ in served_check_cases(cuda))  # the torch gate's check stays small
    cpu = torch.device("cpu")
    assert {served_launch(n, cpu) for n in (1, 1024, 8192)} == {
        launch or served_launch(n, cpu) for n, launch in served_check_cases(cpu)
    }
