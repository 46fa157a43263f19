"""Prefill write-gate kernel: the served launch shapes against other tiles and input precisions, and the
torch gate, at Llama-3.1-8B's gate shape (8 KV heads, head_dim 128, inner 512), bf16 keys.

For each row count (the new keys of one forward) and :class:`GateLaunch`: the time of one layer's
``PrefillGate.admit`` (gate values and admission flags, as a served prefill launches it; CUDA events
around ``--layers`` launches, median of reps), and the largest ``|g - g_torch|`` over those rows
against the float32 torch gate, with whether it stays within ``CHECK_TOLERANCE`` (what the server's
start-up check accepts). Reference rows: the torch gate, and a bf16 batched matmul of the gate's first
projection (``[H, T, 2D] @ [H, 2D, I]``), the tensor cores' time for the same FLOPs.

    python -m benchmarks.kernel_gate --out DIR [--rows 2048 8192] [--deadline S]

Every shape in ``VARIANTS`` fits sm_90's shared memory (``tests/test_sm90_compile.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.common import Deadline, cuda_ms, environment, write_json
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.gate.prefill_gate_launch import (
    FOLD_PRECISION,
    HUGE_LAUNCH,
    LARGE_LAUNCH,
    SMALL_LAUNCH,
    SPLIT_PRECISION,
    GateLaunch,
)
from sglang_wgkv.gate.triton_prefill_gate import CHECK_TOLERANCE, PrefillGate

H, D, INNER = 8, 128, 512
VARIANTS = {
    "served_small": SMALL_LAUNCH,
    "served_large": LARGE_LAUNCH,
    "tf32x3_2stage": GateLaunch(num_stages=2),
    "bf16x3": GateLaunch(precision="bf16x3"),
    "bf16x3_t64": GateLaunch(block_t=64, precision="bf16x3"),
    "bf16x3_t64_2stage": GateLaunch(block_t=64, num_stages=2, precision="bf16x3"),
    "bf16x3_t64_w8": GateLaunch(block_t=64, num_warps=8, precision="bf16x3"),
    "bf16x3_t128_i32": GateLaunch(block_t=128, block_i=32, precision="bf16x3"),
    "tf32_t64": GateLaunch(block_t=64, precision="tf32"),
    # bf16x3 with the halves made once (the keys' per program, w1's per layer), not inside each dot
    "split_t128_w8": GateLaunch(block_t=128, num_warps=8, precision=SPLIT_PRECISION),
    "split_t64": GateLaunch(block_t=64, precision=SPLIT_PRECISION),
    "split_t128_i128_w8": GateLaunch(block_t=128, block_i=128, num_warps=8, precision=SPLIT_PRECISION),
    # two products a dot on the keys as they are, the norms folded into w1
    "fold_t128_i128_w8": GateLaunch(block_t=128, block_i=128, num_warps=8, precision=FOLD_PRECISION),
    "fold_t128_w8_2stage": GateLaunch(block_t=128, num_warps=8, num_stages=2, precision=FOLD_PRECISION),
    "fold_t128_w8": HUGE_LAUNCH,  # served from HUGE_FROM_ROWS
    "fold_t64": GateLaunch(block_t=64, precision=FOLD_PRECISION),
}


def keys(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(rows, H, D, generator=gen, device="cuda").bfloat16() for _ in range(2))


def layer_ms(fn, layers: int, reps: int) -> float:
    return statistics.median(cuda_ms(lambda: [fn() for _ in range(layers)], reps=reps)) / layers


def measure(rows: int, gates: WriteGates, layers: int, reps: int) -> list[dict]:
    k_pre, k_post = keys(rows, 0)
    tau = torch.full((rows,), 0.1, device="cuda")
    g_out = torch.empty(rows, H, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        want = gates(0, k_pre, k_post)
        out = [
            {"rows": rows, "variant": "torch", "ms": layer_ms(lambda: gates(0, k_pre, k_post), layers, reps)}
        ]
        a = torch.cat([k_pre, k_post], -1).transpose(0, 1).contiguous()  # [H, T, 2D]
        w = gates.layers[0].w1.detach().bfloat16()  # [H, 2D, I]
        out.append(
            {"rows": rows, "variant": "bf16_matmul_bound", "ms": layer_ms(lambda: a @ w, layers, reps)}
        )
    for name, launch in VARIANTS.items():
        gate = PrefillGate(gates, launch=launch)
        row = {"rows": rows, "variant": name, "launch": vars(launch)}
        try:
            row["ms"] = layer_ms(lambda: gate.admit(0, k_pre, k_post, tau, g_out=g_out), layers, reps)
            err = float((gate(0, k_pre, k_post) - want).abs().max())
            row |= {"max_abs_err": err, "within_check": err <= CHECK_TOLERANCE}
        except Exception as exc:  # a shape that fails here is reported, the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out.append(row)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/kernels")
    p.add_argument("--rows", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--layers", type=int, default=32, help="launches per timed rep (one per layer)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--deadline", type=float, default=240)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_gate times CUDA kernels: run it on a GPU host")
    deadline = Deadline(a.deadline)
    torch.manual_seed(0)
    gates = WriteGates(GateConfig(num_layers=1, num_kv_heads=H, head_dim=D, hidden=INNER)).cuda().eval()
    rows = []
    for n in a.rows:
        if deadline.left() <= 0:
            break
        rows += measure(n, gates, a.layers, a.reps)
        for r in rows[-len(VARIANTS) - 2 :]:
            print({k: r.get(k) for k in ("rows", "variant", "ms", "max_abs_err", "error")}, flush=True)
    out = {
        "environment": environment(),
        "shape": {"kv_heads": H, "head_dim": D, "inner": INNER},
        "rows": rows,
    }
    out["check_tolerance"] = CHECK_TOLERANCE
    write_json(os.path.join(a.out, "kernel_gate.json"), out, "kernel_gate")


if __name__ == "__main__":
    main()
