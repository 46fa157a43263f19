"""Triton kernels of the pool's writes: a prefill's tokens into ring and global pages, a decode step's
token into its ring slot.

Launched by :func:`~sglang_wgkv.memory.triton_pool.prefill_write` and
:func:`~sglang_wgkv.memory.triton_pool.decode_write` (which validate and launch); torch reference:
``DualCachePool.write_extend`` / ``write_decode``.
"""

import triton
import triton.language as tl


@triton.jit
def stored_value(x, Pages, Scale, layer, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """New values ``x`` as ``Pages`` store them: on FP8 pages (``QUANT``) quantized once, here,
    ``fp8(x / Scale[layer])`` saturated, as :func:`~sglang_wgkv.memory.kv_quant.quantize` (div_rn: IEEE
    division as torch's; compiled ``/`` is approximate and moves FP8 roundings); a cast otherwise."""
    if QUANT:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(Scale + layer)), -FP8_MAX, FP8_MAX)
    return x.to(Pages.dtype.element_ty)


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["n_tokens", "leaving", "stride_an"],
    do_not_specialize_on_alignment=["PageRow", "Admit", "Rank", "GlobalLen"],
)
def _prefill_write_kernel(
    K,
    V,
    KPages,
    VPages,
    PageRow,
    Admit,
    Rank,
    GlobalLen,
    n_tokens,
    leaving,
    window,
    ring_cols,
    stride_kn,
    stride_kh,
    stride_an,
    stride_ph,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HEAD_DIM)
    valid = t < n_tokens
    in_ring = t >= leaving
    flag = tl.load(Admit + t.to(tl.int64) * stride_an + h, mask=valid & ~in_ring, other=0) != 0
    g = tl.load(GlobalLen + h) + tl.load(
        Rank + t.to(tl.int64) * stride_an + h, mask=valid & ~in_ring, other=0
    )
    slot = t % window
    col = tl.where(in_ring, slot // 16, ring_cols + g // 16)
    off = tl.where(in_ring, slot % 16, g % 16)
    write = valid & (in_ring | flag)
    page = tl.load(PageRow + h * stride_ph + col, mask=write, other=0).to(tl.int64)
    src = t.to(tl.int64)[:, None] * stride_kn + h * stride_kh + d[None, :]
    dst = (page * 16 + off)[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(K + src, mask=write[:, None])
    tl.store(KPages + dst, k.to(KPages.dtype.element_ty), mask=write[:, None])
    v = tl.load(V + src, mask=write[:, None])
    tl.store(VPages + dst, v.to(VPages.dtype.element_ty), mask=write[:, None])


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["layer", "stride_ab"],
    do_not_specialize_on_alignment=["PageTable", "RingFlag", "Admit", "Req", "Pos", "KScale", "VScale"],
)
def _decode_write_kernel(
    K,
    V,
    KPages,
    VPages,
    PageTable,
    RingFlag,
    Admit,
    Req,
    Pos,
    KScale,
    VScale,
    layer,
    window,
    stride_kb,
    stride_kh,
    stride_pr,
    stride_pl,
    stride_ph,
    stride_fr,
    stride_fl,
    stride_fh,
    stride_ab,
    HEAD_DIM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    WRITE_FLAG: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    r = tl.load(Req + b).to(tl.int64)
    slot = tl.load(Pos + b).to(tl.int64) % window
    if WRITE_KV:
        row = r * stride_pr + layer * stride_pl + h * stride_ph
        page = tl.load(PageTable + row + slot // 16).to(tl.int64)
        dst = (page * 16 + slot % 16) * HEAD_DIM + d
        src = b * stride_kb + h * stride_kh + d
        tl.store(KPages + dst, stored_value(tl.load(K + src), KPages, KScale, layer, QUANT, FP8_MAX))
        tl.store(VPages + dst, stored_value(tl.load(V + src), VPages, VScale, layer, QUANT, FP8_MAX))
    if WRITE_FLAG:
        flag = tl.load(Admit + b * stride_ab + h)
        tl.store(RingFlag + r * stride_fr + layer * stride_fl + h * stride_fh + slot, flag)
