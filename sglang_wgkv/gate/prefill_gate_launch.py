"""Launch shapes of the Triton prefill gate (:mod:`~sglang_wgkv.gate.triton_prefill_gate`): the tiles,
warps and dot precisions a served forward takes for its row count, and the cases its start-up check
compiles. Host-only: no Triton here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


# Shared memory bounds the tiles: float32 tf32x3 operands at D = 128 fit sm_90's 227 KiB per block only
# at 32 x 64 in one stage (the fastest tf32x3 tile that compiled in a sweep of BLOCK_T 16-128, BLOCK_I
# 32-128, 4/8 warps, 1-3 stages). bf16x3 (three bf16 products: the same ~1e-7 error against the float32
# torch gate) halves the operands, so 128-row tiles with 8 warps fit and read each head's w1 a quarter
# as often.
@dataclass(frozen=True)
class GateLaunch:
    """A launch shape of the prefill gate: rows and hidden units a program takes per step, warps,
    pipeline stages and the dots' ``input_precision`` (``benchmarks/kernel_gate.py`` sweeps them)."""

    block_t: int = 32
    block_i: int = 64
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"


# A launch of this precision splits the keys and w1 into bf16 halves itself (keys once a program, w1
# once a layer: PrefillGate.w1_halves) and runs bf16x3's three products as bf16 dots; Triton's
# interpreter computes no bf16 dot correctly, so there the halves are float16 (the same code path).
SPLIT_PRECISION = "bf16x3_split"
# A launch of this precision takes bf16 or fp16 keys as they are (exact as a dot's operand) and folds
# the RMSNorm weights into w1, split into two halves once a layer (PrefillGate.w1_folded): two products
# per dot where the split launch makes three, no key split, and each row's norm applied to the dot's
# result (x * s_row * norm @ w1 = s_row * (x @ (norm * w1))). Float32 keys take the split launch's
# code on the same tiles.
FOLD_PRECISION = "bf16x2_fold"

# A prefill chunk takes 128-row bf16x3 tiles: 2.7x faster than 32-row tf32x3 ones at 2,048 and 8,192
# rows (results/kernels/kernel_gate_h100.json). Fewer rows (a decode step's gate, a short chunk) keep
# the 32-row tiles, whose four times as many programs spread over the SMs.
SMALL_LAUNCH = GateLaunch()
LARGE_LAUNCH = GateLaunch(block_t=128, num_warps=8, precision="bf16x3")
LARGE_FROM_ROWS = 1024
# Triton's interpreter knows no bf16x3: off CUDA the same tiles in float32
_LARGE_INTERPRETED = replace(LARGE_LAUNCH, precision="ieee")
# A full prefill chunk (8,192 rows) takes 128-row tiles of two products a dot (FOLD_PRECISION):
# 0.53x LARGE_LAUNCH's time there and 0.66x the split 128 x 128 tiles', at the same error; at 2,048
# rows they are 1.6x slower, so shorter forwards keep LARGE_LAUNCH (results/kernels/kernel_gate_h100.json,
# fold_t128_w8).
HUGE_LAUNCH = GateLaunch(block_t=128, num_warps=8, precision=FOLD_PRECISION)
HUGE_FROM_ROWS = 8192


def served_launch(rows: int, device: torch.device) -> GateLaunch:
    """The launch shape a served gate takes for ``rows`` new keys on ``device``."""
    if rows < LARGE_FROM_ROWS:
        return SMALL_LAUNCH
    if device.type != "cuda":
        return _LARGE_INTERPRETED
    return HUGE_LAUNCH if rows >= HUGE_FROM_ROWS else LARGE_LAUNCH


def served_check_cases(device: torch.device) -> list[tuple[int, GateLaunch | None]]:
    """``(rows, launch)`` cases covering every shape :func:`served_launch` gives on ``device``
    (``None``: the served choice for those rows); the full-chunk shape is checked at fewer rows (the
    kernel is compiled for any row count), so the torch gate's check stays small in memory."""
    cases = [(300, None), (LARGE_FROM_ROWS, None)]
    return cases + [(LARGE_FROM_ROWS, HUGE_LAUNCH)] if torch.device(device).type == "cuda" else cases


# In decode, the backend takes this kernel instead of DecodeGate's from this many (row, KV head) pairs
# a step (batch 16 at 8 KV heads). DecodeGate gives every pair a program that reads its head's whole w1
# (2D x I float32: 512 KiB at D 128, I 512), so its traffic grows with the batch, and at W3's batch 128
# it competes for the SMs with the attention beside it on the side stream. Here a program reads w1 once
# per 32 rows. The crossover itself is an estimate (not yet timed).
DECODE_MIN_ROWS = 128
