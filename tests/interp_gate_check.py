"""Triton :class:`~sglang_wgkv.gate.triton_gate.DecodeGate` against the torch gate + admission rule.

Imported by the GPU tests; run as a script for the CPU interpreter test (``TRITON_INTERPRET=1`` must
be set before the kernel module is imported)::

    TRITON_INTERPRET=1 python tests/interp_gate_check.py

prints one JSON line per comparison.
"""

import json
import sys

import torch
from torch import nn

from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.gate.triton_gate import DecodeGate, reference_decode_gate

NEAR_TIE = 1e-4  # |g - tau| below this may round either way between the two summation orders
G_TOL = 2e-5  # gate values: float32 sums in another order

# (D, H, inner, rows B, splits, dtype, random_p)
CASES = [
    (64, 3, 256, 4, 1, torch.float32, None),
    (64, 3, 256, 4, 3, torch.float16, None),
    (
        64,
        2,
        96,
        5,
        32,
        torch.bfloat16,
        None,
    ),  # I not a multiple of the 32-unit block; more splits than blocks
    (128, 2, 192, 3, 2, torch.float16, None),  # the Qwen3 layout's I = 1.5 * D
    (64, 3, 256, 6, 4, torch.float32, 0.4),  # random admission, some rows with admission off
]


def make_gates(
    D: int,
    H: int,
    inner: int,
    seed: int,
    device,
    b1_scale: float = 0.1,
    w2_scale: float = 1.0,
    b2_scale: float = 1.5,
    b2_shift: float = 0.0,
) -> WriteGates:
    """Two layers of gates with varied, decision-relevant parameters and hidden width ``inner``
    (``b1 ~ b1_scale N``, ``w2 ~ w2_scale N / sqrt(inner)``, ``b2 ~ b2_scale N + b2_shift``)."""
    gen = torch.Generator().manual_seed(seed)
    gates = WriteGates(GateConfig(num_layers=2, num_kv_heads=H, head_dim=D, hidden=inner))
    for layer in gates.layers:
        layer.pre_norm = nn.Parameter(1 + 0.3 * torch.randn(D, generator=gen))
        layer.post_norm = nn.Parameter(1 + 0.3 * torch.randn(D, generator=gen))
        layer.w1 = nn.Parameter(torch.randn(H, 2 * D, inner, generator=gen) / (2 * D) ** 0.5)
        layer.b1 = nn.Parameter(b1_scale * torch.randn(H, inner, generator=gen))
        layer.w2 = nn.Parameter(w2_scale * torch.randn(H, inner, generator=gen) / inner**0.5)
        layer.b2 = nn.Parameter(b2_scale * torch.randn(H, generator=gen) + b2_shift)
    return gates.to(device).eval().requires_grad_(False)


def check(D, H, inner, B, splits, dtype, random_p, device, seed=0, graph=False) -> dict:
    gates = make_gates(D, H, inner, seed, device)
    fused = DecodeGate(gates, max_rows=64 * H)
    gen = torch.Generator().manual_seed(seed + 1)
    # Strided like SGLang's k (a view of the qkv output) and the captured pre-RoPE key.
    qkv = torch.randn(B, (4 * H) * D, generator=gen).to(device, dtype)
    k_post = qkv[:, 2 * H * D : 3 * H * D].view(B, H, D)
    k_pre = torch.randn(B, H, D, generator=gen).to(device, dtype)
    tau = torch.rand(B, generator=gen).to(device) * 0.8 + 0.1
    tau[0] = float("-inf")
    uniform = torch.rand(B, 2, H, generator=gen).to(device) if random_p is not None else None
    rows = []
    for layer in range(2):
        u = uniform[:, layer] if uniform is not None else None
        g_out = torch.full((B, H), -1.0, device=device)
        if graph:
            out = fused(layer, k_pre, k_post, tau, u, random_p, splits, g_out)  # warm-up (compiles)
            g_out.fill_(-1.0)
            graph_ = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph_):
                out = fused(layer, k_pre, k_post, tau, u, random_p, splits, g_out)
            for _ in range(3):
                graph_.replay()
            torch.cuda.synchronize()
        else:
            out = fused(layer, k_pre, k_post, tau, u, random_p, splits, g_out)
        ref = reference_decode_gate(gates.layers[layer], k_pre, k_post, tau, u, random_p)
        g = gates.layers[layer](k_pre, k_post)
        tie = (g - tau[:, None]).abs() < NEAR_TIE if random_p is None else torch.zeros_like(ref)
        bad = (out != ref) & ~tie
        g_err = (g_out - g).abs().max().item()
        rows.append(
            dict(
                case=[D, H, inner, B, splits, str(dtype), random_p],
                layer=layer,
                ok=not bool(bad.any()) and g_err < G_TOL,
                g_err=g_err,
                admitted=int(out.sum()),
                of=out.numel(),
                ties=int(tie.sum()),
                counts_reset=not bool(fused.count.any()),
            )
        )
    return rows


def main() -> int:
    failed = 0
    for case in CASES:
        for row in check(*case, device="cpu"):
            print(json.dumps(row), flush=True)
            failed += not (row["ok"] and row["counts_reset"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
