"""Triton SnapKV scores: :func:`~sglang_wgkv.memory.snapkv_score.snapkv_scores` (the reference, same
arguments and result up to float32 summation order) without its ``[S, Wq, G, Ng + Nr]`` float32
logits and probabilities.

Why. The torch scores of one stream (256 window queries x 4 GQA heads x ~1,000 keys at the
Llama-3.1-8B shape) materialize 4 MB of logits and as much of probabilities, written and read about
six times (masking, softmax, NaN guard, max over heads), where the arithmetic is ~0.3 GFLOP per
stream. Here a program reads each key twice and keeps its logits in registers: about five times
faster per evicted stream at W4's shape (``benchmarks/results/kernels/evictor_step_w4_{triton,torch}.json``).

Grid ``(S, cdiv(Wq, BQ))``: one program per (stream, block of ``BQ`` queries), so a look at a few
long streams still fills the GPU. For its ``BQ`` queries x ``G`` heads (rows, the heads padded to a
power of two and masked) a program

1. over the global keys, then the ring keys (visible to query ``i`` iff ``0 <= r_pos <= q_pos[i]``):
   the row maxima and sums of ``exp`` (online softmax);
2. over the global keys again: the probabilities, their maximum over the heads of each query, summed
   over the block's live queries (``q_pos >= 0``) into its own row ``part[s, block, j]``.

The blocks' rows are then summed in a fixed order (deterministic, no atomics). The logits are
``tl.dot`` of the keys' own dtype with float32 accumulation: a product of two bf16 or fp16 values is
exact in float32, so this is the float32 reference's arithmetic up to summation order, at the tensor
cores' 16-bit rate (float32 inputs: IEEE float32). Under the interpreter (its bf16 dot is wrong)
16-bit operands are upcast to float32 first.

Keys as stored. An FP8 pool's keys come with their layer's scale per stream and are dequantized in
registers (``float(stored) * scale`` cast to the queries' dtype: :func:`~sglang_wgkv.memory.kv_quant.dequantize`'s
values), so scoring reads one byte a key element and writes no dequantized copy.

The max-pool along the cache and the padding's ``-inf`` are the reference's
(:func:`~sglang_wgkv.memory.snapkv_score.pool_raw_scores`), on the small ``[S, Ng]`` sums.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang_wgkv.memory.kv_quant import is_fp8
from sglang_wgkv.memory.snapkv_score import pool_raw_scores


@triton.jit
def _online_softmax(m, z, x):
    """Row maxima ``m`` and sums ``z`` of ``exp(x - m)`` updated by the logits block ``x`` (``-inf``:
    not visible; a row that has seen nothing keeps ``m = -inf, z = 0``)."""
    m_new = tl.maximum(m, tl.max(x, 1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, z * tl.exp(m - safe) + tl.sum(tl.exp(x - safe[:, None]), 1)


@triton.jit
def _key_values(k, ks, q, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """Stored keys as values of the queries' (``q``) dtype: FP8 ones times their scale ``ks`` (``QUANT``).
    Under the interpreter (``UPCAST``), whose float32-to-bf16 cast truncates, the bf16 rounding (to
    nearest even) is done on the bits and the value kept in float32."""
    if QUANT:
        x = k.to(tl.float32) * ks
        if UPCAST and q.dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            k = bits.to(tl.float32, bitcast=True)
        else:
            k = x.to(q.dtype)
    return k


@triton.jit
def _logits(q, k, sm_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``q k^T * sm_scale`` in float32 (``UPCAST``: the operands as float32, for the interpreter)."""
    if UPCAST:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION) * sm_scale
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale


@triton.jit(do_not_specialize=["Wq", "Nr"])
def _snapkv_raw_kernel(
    Q,
    QPos,
    GK,
    GLen,
    RK,
    RPos,
    KScale,
    Part,
    Wq,
    Nr,
    sm_scale,
    s_qs,
    s_qw,
    s_qg,
    s_ps,
    s_gs,
    s_gn,
    s_rs,
    s_rn,
    s_rps,
    s_os,
    s_ob,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BQ: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    glen = tl.load(GLen + s).to(tl.int32)
    rows = tl.arange(0, BQ * GP)
    qidx, gi = blk * BQ + rows // GP, rows % GP
    d = tl.arange(0, D)
    cols = tl.arange(0, BN)
    row_ok = (qidx < Wq) & (gi < G)
    qpos = tl.load(QPos + s * s_ps + qidx, mask=row_ok, other=-1)
    live = row_ok & (qpos >= 0)
    q = tl.load(
        Q + s * s_qs + qidx[:, None] * s_qw + gi[:, None] * s_qg + d[None, :], mask=row_ok[:, None], other=0.0
    )
    ks = tl.load(KScale + s) if QUANT else 1.0
    m = tl.full([BQ * GP], float("-inf"), tl.float32)
    z = tl.zeros([BQ * GP], tl.float32)
    for n0 in range(0, glen, BN):
        n = n0 + cols
        k = tl.load(GK + s * s_gs + n[:, None] * s_gn + d[None, :], mask=(n < glen)[:, None], other=0.0)
        k = _key_values(k, ks, q, QUANT, UPCAST)
        x = _logits(q, k, sm_scale, PRECISION, UPCAST)
        x = tl.where(live[:, None] & (n < glen)[None, :], x, float("-inf"))
        m, z = _online_softmax(m, z, x)
    for n0 in range(0, Nr, BN):
        n = n0 + cols
        rpos = tl.load(RPos + s * s_rps + n, mask=n < Nr, other=-1)
        k = tl.load(RK + s * s_rs + n[:, None] * s_rn + d[None, :], mask=(n < Nr)[:, None], other=0.0)
        k = _key_values(k, ks, q, QUANT, UPCAST)
        x = _logits(q, k, sm_scale, PRECISION, UPCAST)
        vis = live[:, None] & (n < Nr)[None, :] & (rpos[None, :] >= 0) & (rpos[None, :] <= qpos[:, None])
        x = tl.where(vis, x, float("-inf"))
        m, z = _online_softmax(m, z, x)
    m = tl.where(m == float("-inf"), 0.0, m)
    inv = tl.where(z > 0, 1.0 / z, 0.0)
    out = Part + s * s_os + blk * s_ob
    for n0 in range(0, glen, BN):
        n = n0 + cols
        k = tl.load(GK + s * s_gs + n[:, None] * s_gn + d[None, :], mask=(n < glen)[:, None], other=0.0)
        k = _key_values(k, ks, q, QUANT, UPCAST)
        x = _logits(q, k, sm_scale, PRECISION, UPCAST)
        p = tl.where(live[:, None] & (n < glen)[None, :], tl.exp(x - m[:, None]) * inv[:, None], 0.0)
        best = tl.max(tl.reshape(p, [BQ, GP, BN]), 1)  # [BQ, BN]: max over heads
        tl.store(out + n, tl.sum(best, 0), mask=n < glen)


def snapkv_scores_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    g_keys: torch.Tensor,
    g_len: torch.Tensor,
    r_keys: torch.Tensor,
    r_pos: torch.Tensor,
    sm_scale: float,
    kernel_size: int = 5,
    block_q: int | None = None,
    block_n: int = 64,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~sglang_wgkv.memory.snapkv_score.snapkv_scores` (same arguments and result) in one
    launch. ``q [S, Wq, G, D]``; keys ``[S, N, D]`` with a unit stride along ``D``, the dtype of ``q``
    or, with ``k_scale`` (``[S]`` float32: each stream's layer scale), an FP8 pool's stored keys, read
    as ``dequantize(keys, k_scale, q.dtype)``; ``D`` a power of two >= 16."""
    S, Wq, G, D = q.shape
    Ng, Nr = g_keys.shape[1], r_keys.shape[1]
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two >= 16")
    quant = k_scale is not None
    key_dtype = g_keys.dtype if quant and is_fp8(g_keys.dtype) else q.dtype
    if g_keys.dtype != key_dtype or r_keys.dtype != key_dtype:
        need = "one FP8 dtype (k_scale given)" if quant else f"the dtype of q ({q.dtype})"
        raise ValueError(f"keys ({g_keys.dtype}, {r_keys.dtype}) must have {need}")
    if quant and (k_scale.shape != (S,) or k_scale.dtype != torch.float32):
        raise ValueError(f"k_scale must be [S] = [{S}] float32, got {tuple(k_scale.shape)} {k_scale.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    g_keys = g_keys if g_keys.stride(-1) == 1 else g_keys.contiguous()
    r_keys = r_keys if r_keys.stride(-1) == 1 else r_keys.contiguous()
    q_pos = q_pos.to(torch.int32).contiguous()
    r_pos = r_pos.to(torch.int32).contiguous()
    g_len32 = g_len.to(torch.int32).contiguous()
    gp = triton.next_power_of_2(G)
    bq = block_q or max(1, 64 // gp)
    blocks = triton.cdiv(Wq, bq)
    # each (stream, query block) writes its own row: entries past a stream's length stay zero
    part = torch.zeros(S, blocks, max(Ng, 1), dtype=torch.float32, device=q.device)
    if S and Wq:
        _snapkv_raw_kernel[(S, blocks)](
            q,
            q_pos,
            g_keys,
            g_len32,
            r_keys,
            r_pos,
            k_scale.contiguous() if quant else g_len32,  # not read without QUANT
            part,
            Wq,
            Nr,
            float(sm_scale),
            q.stride(0),
            q.stride(1),
            q.stride(2),
            q_pos.stride(0),
            g_keys.stride(0),
            g_keys.stride(1),
            r_keys.stride(0),
            r_keys.stride(1),
            r_pos.stride(0),
            part.stride(0),
            part.stride(1),
            G=G,
            GP=gp,
            D=D,
            BQ=bq,
            BN=block_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
            QUANT=quant,
        )
    return pool_raw_scores(part.sum(1)[:, :Ng], g_len, kernel_size)
