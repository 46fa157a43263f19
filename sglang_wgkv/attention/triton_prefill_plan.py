"""Triton work lists of the vertical-slash prefill (same contracts as
:func:`sglang_wgkv.attention.vertical_slash_plan.build_vertical_slash_plan` and
:func:`~sglang_wgkv.attention.vertical_slash_plan.compact_admitted`, their torch references).

- :func:`compact_admitted_triton`: each KV head's admitted keys and values, contiguous, in order;
- :func:`build_vertical_slash_plan_triton`: per query block, the compacted-key range of its dense loop
  and its band of original keys.
"""

import math

import torch
import triton
import triton.language as tl

from sglang_wgkv.attention.vertical_slash_plan import (
    COMPACT_ALIGN,
    VerticalSlashPlan,
    _exclusive_count,
    compacted_rows,
)


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["num_keys", "num_seqs", "stride_an", "stride_ah", "stride_en", "stride_eh"],
    do_not_specialize_on_alignment=["Adm", "Excl", "KV"],
)
def _compact_fwd(
    K,
    V,
    Adm,
    Excl,
    KV,
    KC,
    VC,
    num_keys,
    num_seqs,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_ah,
    stride_en,
    stride_eh,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    ZERO: tl.constexpr,
):
    """Rows ``BLOCK * pid(0) ..`` of KV head pid(1): each admitted row copied to its compacted row,
    the start of its sequence's region + the admitted rows before it there (``admitted_rank``, from
    the exclusive counts ``Excl`` and the sequences' starts ``KV``). A sequence's region starts where
    the previous sequences' key counts, each rounded up to ``ALIGN``, end; the program holding a
    sequence's last key zeroes its rows from the admitted count to the next multiple of ``ALIGN``."""
    head = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = n < num_keys
    n64 = n.to(tl.int64)
    adm = tl.load(Adm + n64 * stride_an + head * stride_ah, mask=valid, other=0) != 0
    start = tl.zeros([BLOCK], tl.int64)
    region = tl.zeros([BLOCK], tl.int64)
    ends = tl.load(KV).to(tl.int64) * 0
    d = tl.arange(0, HEAD_DIM)[None, :]
    for b in range(0, num_seqs):  # the last sequence starting at or before the row holds it
        s = tl.load(KV + b).to(tl.int64)
        e = tl.load(KV + b + 1).to(tl.int64)
        start = tl.where(n64 >= s, s, start)
        region = tl.where(n64 >= s, ends, region)
        if ALIGN > 1:
            # Tiles and pages are read whole: the rows from the admitted count to the next multiple
            # of ALIGN get zeros (the buffers are not initialised; a NaN would leak through 0 * NaN).
            lo = tl.program_id(0) * BLOCK
            if (e > s) & (e - 1 >= lo) & (e - 1 < lo + BLOCK):
                total = tl.load(Excl + e * stride_en + head * stride_eh)
                count = total - tl.load(Excl + s * stride_en + head * stride_eh)
                zero = tl.zeros([ZERO, HEAD_DIM], KC.dtype.element_ty)
                for z in range(0, ALIGN, ZERO):  # ZERO rows at a time: ALIGN need not be a power of two
                    pad = count + z + tl.arange(0, ZERO)
                    pad_rows = (pad < (count + ALIGN - 1) // ALIGN * ALIGN)[:, None]
                    dst = head * stride_ch + (ends + pad)[:, None] * HEAD_DIM + d
                    tl.store(KC + dst, zero, mask=pad_rows)
                    tl.store(VC + dst, zero, mask=pad_rows)
        ends += (e - s + ALIGN - 1) // ALIGN * ALIGN
    before = tl.load(Excl + n64 * stride_en + head * stride_eh, mask=adm, other=0).to(tl.int64)
    first = tl.load(Excl + start * stride_en + head * stride_eh, mask=adm, other=0).to(tl.int64)
    dest = region + before - first
    rows = adm[:, None]
    out = head * stride_ch + dest[:, None] * HEAD_DIM + d
    k = tl.load(K + n64[:, None] * stride_kn + head * stride_kh + d, mask=rows)
    tl.store(KC + out, k, mask=rows)
    v = tl.load(V + n64[:, None] * stride_vn + head * stride_vh + d, mask=rows)
    tl.store(VC + out, v, mask=rows)


def compact_admitted_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    admitted: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    block: int = 64,
    excl: torch.Tensor | None = None,
    align: int = COMPACT_ALIGN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~sglang_wgkv.attention.vertical_slash_plan.compact_admitted` with one Triton copy: only
    admitted rows are read and written (the torch version scatters every row, the rejected ones to a
    scratch row, through a two-index ``index_put``). Same contract and result; k/v rows may be strided
    but each head's ``D`` values contiguous. ``excl``: ``_exclusive_count(admitted)`` when the caller
    has it (the plan needs it too). ``out`` (allocated when None) need not be initialised: the rows
    the kernels read are written here, admitted rows and the zeros after them (the layout of
    :mod:`~sglang_wgkv.attention.vertical_slash_plan`); the rest of a region keeps what it held."""
    Nk, H, D = k.shape
    rows = compacted_rows(Nk, kv_indptr.numel() - 1, align)
    if out is None:
        out = (k.new_empty(H, rows, D), v.new_empty(H, rows, D))
    if Nk == 0:
        return out
    if (
        k.stride(2) != 1
        or v.stride(2) != 1
        or any(o.shape != (H, rows, D) or not o.is_contiguous() for o in out)
    ):
        raise ValueError(f"k/v need contiguous head rows and out two contiguous [Hkv, {rows}, D] buffers")
    excl = _exclusive_count(admitted) if excl is None else excl
    adm = admitted.view(torch.uint8)
    _compact_fwd[(triton.cdiv(Nk, block), H)](
        k,
        v,
        adm,
        excl,
        kv_indptr,
        out[0],
        out[1],
        Nk,
        kv_indptr.numel() - 1,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        adm.stride(0),
        adm.stride(1),
        excl.stride(0),
        excl.stride(1),
        out[0].stride(0),
        HEAD_DIM=D,
        BLOCK=block,
        ALIGN=align,
        ZERO=math.gcd(align, 64),
    )
    return out


@triton.jit
def _count_le(KPos, lo, hi, x, n_iter):
    """Index of the first key in ``[lo, hi)`` with position > x (positions non-decreasing there)."""
    left, right = lo, hi
    for _ in range(0, n_iter):
        live = left < right
        mid = (left + right) // 2
        pos = tl.load(KPos + mid, mask=live, other=0).to(tl.int64)
        go_right = live & (pos <= x)
        right = tl.where(live & (pos > x), mid, right)
        left = tl.where(go_right, mid + 1, left)
    return left


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["num_seqs", "num_q", "n_iter", "stride_en", "stride_eh"],
    do_not_specialize_on_alignment=[
        "QO",
        "KV",
        "QPos",
        "KPos",
        "Excl",
        "QStart",
        "QEnd",
        "KVStart",
        "BandStart",
        "BandEnd",
        "Vertical",
        "CompactStart",
    ],
)
def _plan_kernel(
    QO,
    KV,
    QPos,
    KPos,
    Excl,
    QStart,
    QEnd,
    KVStart,
    BandStart,
    BandEnd,
    Vertical,
    CompactStart,
    num_seqs,
    num_q,
    stride_en,
    stride_eh,
    window,
    block_m,
    num_heads,
    n_iter,
    BLOCK_H: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One query block: its sequence (a walk over the sequences' block counts), rows, band, the
    admitted count per KV head and its sequence's compacted region; the same values as the torch
    ``build_vertical_slash_plan``."""
    blk = tl.program_id(0).to(tl.int64)
    seen = blk * 0
    first = blk * 0
    found = blk * 0 + num_seqs
    region = blk * 0
    ends = blk * 0
    for b in range(0, num_seqs):
        nb = (tl.load(QO + b + 1).to(tl.int64) - tl.load(QO + b).to(tl.int64) + block_m - 1) // block_m
        hit = (found == num_seqs) & (blk >= seen) & (blk < seen + nb)
        found = tl.where(hit, b, found)
        first = tl.where(hit, seen, first)
        region = tl.where(hit, ends, region)
        seen += nb
        ends += (tl.load(KV + b + 1).to(tl.int64) - tl.load(KV + b).to(tl.int64) + ALIGN - 1) // ALIGN * ALIGN
    valid = found < num_seqs
    b = tl.minimum(found, num_seqs - 1)
    q_lo = tl.load(QO + b).to(tl.int64)
    q_hi = tl.load(QO + b + 1).to(tl.int64)
    q_start = tl.where(valid, q_lo + (blk - first) * block_m, 0)
    q_end = tl.where(valid, tl.minimum(q_start + block_m, q_hi), 0)
    has_q = num_q > 0
    p_lo = tl.load(QPos + tl.minimum(q_start, tl.maximum(num_q - 1, 0)), mask=has_q, other=0).to(tl.int64)
    p_lo = tl.where(has_q, p_lo, q_start)
    p_hi = tl.load(QPos + tl.maximum(q_end - 1, 0), mask=has_q, other=0).to(tl.int64)
    p_hi = tl.where(has_q, p_hi, q_start)
    lo = tl.load(KV + b).to(tl.int64)
    hi = tl.load(KV + b + 1).to(tl.int64)
    band_start = _count_le(KPos, lo, hi, p_lo - window, n_iter)
    band_end = tl.maximum(_count_le(KPos, lo, hi, p_hi, n_iter), band_start)
    tl.store(QStart + blk, q_start.to(tl.int32))
    tl.store(QEnd + blk, q_end.to(tl.int32))
    tl.store(KVStart + blk, lo.to(tl.int32))
    tl.store(BandStart + blk, band_start.to(tl.int32))
    tl.store(BandEnd + blk, band_end.to(tl.int32))
    tl.store(CompactStart + blk, region.to(tl.int32))
    hs = tl.arange(0, BLOCK_H)
    live = hs < num_heads
    vert = tl.load(Excl + band_start * stride_en + hs * stride_eh, mask=live, other=0) - tl.load(
        Excl + lo * stride_en + hs * stride_eh, mask=live, other=0
    )
    tl.store(Vertical + blk * num_heads + hs, tl.where(valid, vert, 0).to(tl.int32), mask=live)


def build_vertical_slash_plan_triton(
    admitted: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    local_window: int,
    block_m: int,
    excl: torch.Tensor | None = None,
    compact_align: int = COMPACT_ALIGN,
) -> VerticalSlashPlan:
    """:func:`~sglang_wgkv.attention.vertical_slash_plan.build_vertical_slash_plan` as the admitted-count
    scan plus one Triton launch (one program per query block; binary searches over its sequence's key
    positions) instead of some twenty small torch launches, whose launch costs dominated the torch plan
    (``benchmarks/results/kernels/kernel_prefill_compaction.json``). Same contract and values."""
    dev = admitted.device
    B = qo_indptr.numel() - 1
    Nq, Nk = q_pos.numel(), k_pos.numel()
    H = admitted.shape[1]
    NB = -(-Nq // block_m) + B
    i32 = torch.int32
    q_start, q_end, kv_start, band_start, band_end, compact_start = (
        torch.empty(NB, dtype=i32, device=dev) for _ in range(6)
    )
    vertical = torch.empty(NB, H, dtype=i32, device=dev)
    excl = _exclusive_count(admitted) if excl is None else excl
    if NB:
        _plan_kernel[(NB,)](
            qo_indptr,
            kv_indptr,
            q_pos,
            k_pos,
            excl,
            q_start,
            q_end,
            kv_start,
            band_start,
            band_end,
            vertical,
            compact_start,
            B,
            Nq,
            excl.stride(0),
            excl.stride(1),
            local_window,
            block_m,
            H,
            max(1, (Nk + 1).bit_length()),
            BLOCK_H=triton.next_power_of_2(max(H, 1)),
            ALIGN=compact_align,
            num_warps=1,
        )
    return VerticalSlashPlan(
        block_m, q_start, q_end, kv_start, band_start, band_end, vertical, compact_start, compact_align
    )
