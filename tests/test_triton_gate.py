"""The fused Triton decode gate (:mod:`sglang_wgkv.gate.triton_gate`) against the torch gate and
admission rule: on the CPU through Triton's interpreter (core), on CUDA with bf16 keys, the Llama-8B
gate shape and CUDA-graph replay (gpu). The prefill gate (:mod:`sglang_wgkv.gate.triton_prefill_gate`)
on CUDA at the profiled 8,192-token chunk (gpu; its interpreter check: test_triton_prefill_gate_interp.py)."""

import json
import os

import pytest
import torch
from interp_gate_check import CASES, check

from sglang_wgkv.testing.interp import InterpCheck

HERE = os.path.dirname(os.path.abspath(__file__))
GATE_RUN = InterpCheck(os.path.join(HERE, "interp_gate_check.py"))
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)")
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; "
    "on a GPU host the compiled kernel is tested (gpu marker)",
)


@pytest.mark.core
@CPU_ONLY
def test_interpreted_gate_matches_torch(interp_runner):
    proc = interp_runner.result(GATE_RUN)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * len(CASES), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and all(r["ok"] and r["counts_reset"] for r in rows), rows
    # Decisions went both ways in every case (a gate stuck at admit-all or reject-all would pass).
    for i in range(0, len(rows), 2):
        assert 0 < rows[i]["admitted"] + rows[i + 1]["admitted"] < 2 * rows[i]["of"], rows[i : i + 2]


@pytest.mark.core
def test_validation():
    from interp_gate_check import make_gates

    from sglang_wgkv.gate.triton_gate import MAX_SPLIT_COUNT, DecodeGate

    fused = DecodeGate(make_gates(64, 2, 128, 0, "cpu"), max_rows=4)
    k = torch.zeros(2, 2, 64)
    tau = torch.zeros(2)
    with pytest.raises(ValueError, match="k_pre/k_post"):
        fused(0, torch.zeros(2, 3, 64), k, tau)
    with pytest.raises(ValueError, match="tau"):
        fused(0, k, k, tau.double())
    with pytest.raises(ValueError, match="go together"):
        fused(0, k, k, tau, random_p=0.5)
    with pytest.raises(ValueError, match="arrival counts"):
        fused(0, torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), torch.zeros(3))
    with pytest.raises(ValueError, match="num_splits"):
        fused(0, k, k, tau, num_splits=MAX_SPLIT_COUNT + 1)


@pytest.mark.core
def test_num_splits():
    from interp_gate_check import make_gates

    from sglang_wgkv.gate.triton_gate import MAX_SPLIT_COUNT, DecodeGate

    fused = DecodeGate(make_gates(128, 2, 512, 0, "cpu"), max_rows=4)
    assert fused.num_splits(8, 132) == 512 // 32  # batch 1 x 8 heads: I = 512 in slices of 32
    assert fused.num_splits(1024, 132) == 1  # large batches: one program per (row, head)
    assert 1 <= fused.num_splits(1, 10_000) <= MAX_SPLIT_COUNT


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("B,splits", [(1, 8), (1, 1), (32, 1), (7, 3)])
@pytest.mark.parametrize("random_p", [None, 0.25])
def test_gpu_gate_matches_torch(B, splits, random_p):
    rows = check(128, 8, 512, B, splits, torch.bfloat16, random_p, device="cuda")
    assert all(r["ok"] and r["counts_reset"] for r in rows), rows
    if B > 1:
        assert all(0 < r["admitted"] < r["of"] for r in rows), rows


@pytest.mark.gpu
@requires_cuda
def test_gpu_gate_graph_replay():
    for case in CASES:
        rows = check(*case[:-2], torch.bfloat16, case[-1], device="cuda", graph=True)
        assert all(r["ok"] and r["counts_reset"] for r in rows), rows


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "T,H,D,inner,dtype,layout",
    [
        (8192, 8, 128, 512, torch.bfloat16, "fused"),  # the Llama-3.1-8B shape of the profiled prefill chunk
        (8192, 8, 128, 512, torch.bfloat16, "contig"),
        (1000, 8, 128, 192, torch.bfloat16, "heads"),  # Qwen3's I = 1.5 * D; T not a multiple of the block
        (777, 3, 64, 96, torch.float16, "fused"),
        (333, 8, 128, 512, torch.float32, "fused"),
    ],
)
@pytest.mark.parametrize("launch", ["served", "split", "fold"])
def test_gpu_prefill_gate_matches_torch(T, H, D, inner, dtype, layout, launch):
    from triton_prefill_gate_interp_check import FOLD, SPLIT, check

    # The oracle in float32 proper: no TF32 in the torch einsums.
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        rows = check(
            T,
            H,
            D,
            inner,
            dtype,
            layout,
            device="cuda",
            seed=T,
            launch={"served": None, "split": SPLIT, "fold": FOLD}[launch],
        )
    finally:
        torch.set_float32_matmul_precision(old)
    assert all(r["ok"] for r in rows), rows
    assert all(0 < r["below_half"] < r["of"] for r in rows), rows
