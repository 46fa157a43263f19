"""Triton :class:`~sglang_wgkv.gate.triton_prefill_gate.PrefillGate` against the torch
:class:`~sglang_wgkv.gate.mlp.LayerGate`.

Imported by the GPU test (tests/test_triton_gate.py); run as a script for the CPU interpreter test
(``TRITON_INTERPRET=1`` must be set before Triton is imported)::

    TRITON_INTERPRET=1 python tests/triton_prefill_gate_interp_check.py

prints one JSON line per case and exits non-zero if any differs.
"""

import json
import os
import sys

import interp_gate_check
import torch

from sglang_wgkv.gate import WriteGates
from sglang_wgkv.gate.prefill_gate_launch import FOLD_PRECISION, HUGE_LAUNCH, SPLIT_PRECISION, GateLaunch
from sglang_wgkv.gate.triton_prefill_gate import PrefillGate

G_TOL = 1e-5  # gate values: float32 (tf32x3 or bf16x3 on the GPU) sums in another order

# (T, H, D, I, dtype, layout). Row counts on and off the row blocks (1, 63, 64, 65, 129, 200; 1100 in
# the 128-row tiles a prefill chunk takes), I = 4D and the Qwen3 layout's 1.5D (not a multiple of the
# 64-unit block at D = 64), and three key layouts:
# "fused" (k_pre, k_post as column slices of a [T, 3*H*D] qkv-like buffer: row stride 3HD),
# "heads" (from a [T, H, 2, D] buffer: head stride 2D), "contig".
CASES = [
    (1, 1, 64, 256, torch.float32, "contig"),
    (63, 3, 64, 96, torch.bfloat16, "fused"),
    (64, 8, 128, 512, torch.bfloat16, "fused"),
    (65, 3, 128, 192, torch.float32, "heads"),
    (200, 8, 64, 96, torch.bfloat16, "heads"),
    (200, 1, 128, 512, torch.float16, "fused"),
    (65, 8, 64, 256, torch.float32, "fused"),
    (63, 1, 128, 192, torch.bfloat16, "contig"),
    (1, 8, 128, 512, torch.bfloat16, "fused"),
    (129, 3, 64, 256, torch.bfloat16, "fused"),
    (0, 3, 64, 96, torch.bfloat16, "fused"),
    (1100, 2, 64, 96, torch.bfloat16, "fused"),
]

# The split launch (bf16x3 with halves made once; float16 halves under the interpreter): rows on and
# off its 64-row tiles, I off the 64-unit block, every key dtype.
SPLIT = GateLaunch(block_t=64, precision=SPLIT_PRECISION)
SPLIT_CASES = [
    (129, 3, 64, 96, torch.bfloat16, "fused"),
    (65, 8, 128, 512, torch.float32, "heads"),
    (1, 2, 64, 256, torch.float16, "contig"),
]
# The served full-chunk launch (HUGE_LAUNCH: 128-row fold tiles): rows and I off its blocks.
HUGE_CASES = [(129, 2, 64, 200, torch.bfloat16, "fused")]
# The fold launch (keys as they are, the norms folded into w1): half-precision keys on and off the
# tiles, float32 keys (which take the split code), I off the block.
FOLD = GateLaunch(block_t=64, precision=FOLD_PRECISION)
FOLD_CASES = [
    (129, 3, 64, 96, torch.float16, "fused"),
    (65, 8, 128, 512, torch.bfloat16, "heads"),
    (33, 2, 64, 256, torch.float32, "contig"),
]


def make_gates(H: int, D: int, inner: int, seed: int, device) -> WriteGates:
    """Two layers of gates with every parameter perturbed, logits spread around 0."""
    return interp_gate_check.make_gates(
        D, H, inner, seed, device, b1_scale=0.3, w2_scale=2.0, b2_scale=0.3, b2_shift=-0.5
    )


def make_keys(T: int, H: int, D: int, dtype, layout: str, gen, device):
    """k_pre, k_post ``[T, H, D]`` in ``layout`` (see CASES), with row scales that vary (RMSNorm)."""
    scale = torch.rand(T, 1, generator=gen) * 4 + 0.1
    if layout == "fused":
        qkv = (torch.randn(T, 3 * H * D, generator=gen) * scale).to(device, dtype)
        return qkv[:, 2 * H * D :].view(T, H, D), qkv[:, H * D : 2 * H * D].view(T, H, D)
    if layout == "heads":
        both = (torch.randn(T, H * 2 * D, generator=gen) * scale).to(device, dtype).view(T, H, 2, D)
        return both[:, :, 0], both[:, :, 1]
    return tuple(
        (torch.randn(T, H * D, generator=gen) * scale).to(device, dtype).view(T, H, D) for _ in range(2)
    )


def check(T, H, D, inner, dtype, layout, device, seed=0, launch=None) -> list[dict]:
    gates = make_gates(H, D, inner, seed, device)
    fused = PrefillGate(gates, launch=launch)
    gen = torch.Generator().manual_seed(seed + 1)
    k_pre, k_post = make_keys(T, H, D, dtype, layout, gen, device)
    rows = []
    for layer in range(2):
        out = torch.full((T, H), float("nan"), device=device)  # poisoned: every element must be written
        g = fused(layer, k_pre, k_post, out=out)
        ref = gates.layers[layer](k_pre, k_post)
        written = not bool(torch.isnan(g).any())
        g_err = (g - ref).abs().max().item() if T else 0.0
        flags = admission_errors(fused, gates.layers[layer], layer, k_pre, k_post, ref, gen, device)
        rows.append(
            dict(
                case=[T, H, D, inner, str(dtype), layout],
                launch=launch and launch.precision,
                layer=layer,
                seed=seed,
                ok=(
                    written
                    and g_err <= G_TOL
                    and g.shape == (T, H)
                    and g.data_ptr() == out.data_ptr()
                    and not any(flags.values())
                ),
                written=written,
                g_err=g_err,
                below_half=int((ref < 0.5).sum()),
                of=ref.numel(),
                **flags,
            )
        )
    return rows


def admission_errors(fused, gate_layer, layer, k_pre, k_post, ref, gen, device) -> dict:
    """:meth:`PrefillGate.admit` against :func:`reference_decode_gate` (the decode gate's oracle),
    thresholded (per-row tau drawn around the gate values, one row with admission off) and random:
    the flags that differ (thresholded: only where ``|g - tau|`` exceeds the gate tolerance counts)
    and whether the gate values written beside them differ from :meth:`PrefillGate.__call__`'s."""
    from sglang_wgkv.gate.triton_gate import reference_decode_gate

    T, H = ref.shape
    tau = (torch.rand(T, 1, generator=gen) * 0.8 + 0.1).to(device)
    if T:
        tau[T // 2] = float("-inf")
    uniform = torch.rand(T, H, generator=gen).to(device)
    g_side = torch.full((T, H), float("nan"), device=device)
    got = fused.admit(layer, k_pre, k_post, tau, g_out=g_side)
    want = reference_decode_gate(gate_layer, k_pre, k_post, tau)
    decided = (ref - tau).abs() > G_TOL
    got_r = fused.admit(layer, k_pre, k_post, tau[:, 0], uniform=uniform, random_p=0.3)
    want_r = reference_decode_gate(gate_layer, k_pre, k_post, tau, uniform=uniform, random_p=0.3)
    return {
        "threshold_flag_errors": int(((got != want) & decided).sum()),
        "random_flag_errors": int((got_r != want_r).sum()),
        "g_out_errors": int((g_side != fused(layer, k_pre, k_post)).sum()),
        "wrong_flag_dtype": int(got.dtype != torch.bool or got_r.shape != (T, H)),
    }


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    failed = 0
    runs = [(case, None) for case in CASES] + [(case, SPLIT) for case in SPLIT_CASES]
    runs += [(case, HUGE_LAUNCH) for case in HUGE_CASES] + [(case, FOLD) for case in FOLD_CASES]
    for seed, (case, launch) in enumerate(runs):
        for row in check(*case, device="cpu", seed=seed, launch=launch):
            print(json.dumps(row), flush=True)
            failed += not row["ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
