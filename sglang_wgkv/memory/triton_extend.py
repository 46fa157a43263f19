"""Triton launches of the extend step (:mod:`~sglang_wgkv.memory.extend_step`) for the CUDA path: a
prefill chunk, with or without a cached prefix, in one to three launches a layer instead of ~40 torch
gathers, casts, ``where``s, concatenations and index writes. Each leaves exactly the tensors (and the
pool) its torch ops leave, except the never-read dump page (the torch ops send rows that are not
admitted there; these kernels do not write them):

* :func:`extend_context` = ``ExtendStep.extend_inputs``' torch path (each request's cached context,
  ``gather_context``: global entries padded to the longest head, then the ring in position order;
  then its new rows), one launch a layer whatever the batch;
* :func:`extend_move` = the row movement of ``write_extend`` (admitted tokens leaving the ring into
  their global slots), one launch, before
* :func:`extend_ring_write` = its ring write (the chunk's last tokens and their flags), one launch.

A pool built with ``triton_extend`` uses them (:meth:`ExtendStep.write_extend`, ``extend_inputs``).
"""

import torch
import triton
import triton.language as tl

from sglang_wgkv.config import FAR_POSITION, PAGE_SIZE
from sglang_wgkv.memory.triton_pool_write_kernels import stored_value


# a layer's slice of a group's arrays starts anywhere: pointer alignment unspecialized, so every layer
# of a group runs the variant compiled at start-up (testing/jit_keys.py)
@triton.jit(
    do_not_specialize=["layer", "n_cand", "stride_c"],
    do_not_specialize_on_alignment=["Flag", "DestPage", "Dest", "SrcPage"],
)
def _extend_move_kernel(
    K,
    V,
    KPages,
    VPages,
    Flag,
    DestPage,
    Dest,
    FromRing,
    SrcPage,
    Slot,
    Src,
    KScale,
    VScale,
    layer,
    n_cand,
    stride_c,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Candidates ``c`` of one block, head ``h``: an admitted one's key and value go to global slot
    ``(DestPage[c, h], Dest[c, h] % PAGE)``, read from its ring slot (``FromRing[c]``: page
    ``SrcPage[c, h]``, offset ``Slot[c] % PAGE``: its bytes, never rounded again) or from the chunk's
    row ``Src[c]`` (quantized with ``layer``'s scale on FP8 pages, ``QUANT``). The four ``[C, H]``
    arrays share ``stride_c`` (one layer's slice of a group's ``[C, G, H]``), heads contiguous."""
    h = tl.program_id(1)
    c = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    live = c < n_cand
    d = tl.arange(0, HEAD_DIM)[None, :]
    ch = c * stride_c + h
    flag = tl.load(Flag + ch, mask=live, other=0) != 0
    ring = flag & (tl.load(FromRing + c, mask=flag, other=0) != 0)
    new = flag & ~ring
    dst = tl.load(DestPage + ch, mask=flag, other=0) * PAGE + tl.load(Dest + ch, mask=flag, other=0) % PAGE
    dst = dst[:, None] * HEAD_DIM + d
    ring_row = tl.load(SrcPage + ch, mask=ring, other=0) * PAGE + tl.load(Slot + c, mask=ring, other=0) % PAGE
    ring_row = ring_row[:, None] * HEAD_DIM + d
    row = tl.load(Src + c, mask=new, other=0)
    k_ptr = K + row[:, None] * stride_kn + h * stride_kh + d
    _move_rows(KPages, k_ptr, ring_row, dst, ring, new, KScale, layer, QUANT, FP8_MAX)
    v_ptr = V + row[:, None] * stride_vn + h * stride_vh + d
    _move_rows(VPages, v_ptr, ring_row, dst, ring, new, VScale, layer, QUANT, FP8_MAX)


@triton.jit
def _move_rows(
    Pages, new_ptr, ring_row, dst, ring, new, Scale, layer, QUANT: tl.constexpr, FP8_MAX: tl.constexpr
):
    # two stores under disjoint masks: a ring row's bytes move as they are, a new row is converted
    tl.store(Pages + dst, tl.load(Pages + ring_row, mask=ring[:, None]), mask=ring[:, None])
    from_new = stored_value(tl.load(new_ptr, mask=new[:, None]), Pages, Scale, layer, QUANT, FP8_MAX)
    tl.store(Pages + dst, from_new, mask=new[:, None])


@triton.jit(do_not_specialize=["layer", "n_rows"], do_not_specialize_on_alignment=["Admit"])
def _extend_ring_kernel(
    K,
    V,
    KPages,
    VPages,
    PageTable,
    RingFlag,
    Admit,
    Req,
    RwB,
    RwSlot,
    RwSrc,
    KScale,
    VScale,
    layer,
    n_rows,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_pr,
    stride_pl,
    stride_ph,
    stride_fr,
    stride_fl,
    stride_fh,
    stride_an,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Ring rows ``i`` of one block, head ``h``: the chunk's row ``RwSrc[i]`` into ring slot
    ``RwSlot[i]`` of request ``Req[RwB[i]]``, its key, value (quantized on FP8 pages: their only
    write) and admission flag."""
    h = tl.program_id(1)
    i = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    live = i < n_rows
    d = tl.arange(0, HEAD_DIM)[None, :]
    r = tl.load(Req + tl.load(RwB + i, mask=live, other=0), mask=live, other=0).to(tl.int64)
    slot = tl.load(RwSlot + i, mask=live, other=0).to(tl.int64)
    src = tl.load(RwSrc + i, mask=live, other=0).to(tl.int64)
    page = tl.load(
        PageTable + r * stride_pr + layer * stride_pl + h * stride_ph + slot // PAGE, mask=live, other=0
    )
    dst = (page.to(tl.int64) * PAGE + slot % PAGE)[:, None] * HEAD_DIM + d
    k = tl.load(K + src[:, None] * stride_kn + h * stride_kh + d, mask=live[:, None])
    tl.store(KPages + dst, stored_value(k, KPages, KScale, layer, QUANT, FP8_MAX), mask=live[:, None])
    v = tl.load(V + src[:, None] * stride_vn + h * stride_vh + d, mask=live[:, None])
    tl.store(VPages + dst, stored_value(v, VPages, VScale, layer, QUANT, FP8_MAX), mask=live[:, None])
    flag = tl.load(Admit + src * stride_an + h, mask=live, other=0)
    tl.store(RingFlag + r * stride_fr + layer * stride_fl + h * stride_fh + slot, flag, mask=live)


@triton.jit
def _cached(x, Scale, layer, Out, QUANT: tl.constexpr):
    if QUANT:
        x = x.to(tl.float32) * tl.load(Scale + layer)
    return x.to(Out.dtype.element_ty)


# Segments: one row a request of ``SEG_FIELDS`` int64s (slot, prefix, global rows, ring rows, new rows,
# first chunk row, first output row); its pointer a layer's slice of the forward's ``[L, B, 7]`` table.
SEG_FIELDS = 7


@triton.jit(do_not_specialize=["layer"], do_not_specialize_on_alignment=["Segments", "Admit"])
def _extend_context_kernel(
    KPages,
    VPages,
    PageTable,
    GlobalLen,
    RingFlag,
    K,
    V,
    Admit,
    Positions,
    KScale,
    VScale,
    OutK,
    OutV,
    OutPos,
    OutAdm,
    Segments,
    layer,
    window,
    ring_cols,
    stride_pr,
    stride_pl,
    stride_ph,
    stride_gr,
    stride_gl,
    stride_fr,
    stride_fl,
    stride_fh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_on,
    stride_oh,
    stride_dn,
    FAR: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,
    SEG: tl.constexpr,
):
    """Rows ``i`` of one block of request ``b``'s attention inputs (``b`` the grid's third axis; its
    segment row: slot ``r``, ``prefix``, ``g_rows``, ``ring_n``, ``n_new``, ``start``, ``out0``), head
    ``h``, at output row ``out0 + i``: ``i < g_rows`` its global entries (page column
    ``ring_cols + i // PAGE``; admitted iff ``i < global_len``, position ``FAR``), then ``ring_n`` ring
    entries in position order (positions ``prefix - ring_n ..``; their flags), then ``n_new`` rows
    ``start ..`` of the chunk. Cached rows of FP8 pages (``QUANT``) read as ``float(stored) * scale``
    (:func:`~sglang_wgkv.memory.kv_quant.dequantize`)."""
    h = tl.program_id(1)
    seg = Segments + tl.program_id(2) * SEG
    r = tl.load(seg)
    prefix = tl.load(seg + 1)
    g_rows = tl.load(seg + 2)
    ring_n = tl.load(seg + 3)
    n_new = tl.load(seg + 4)
    start = tl.load(seg + 5)
    out0 = tl.load(seg + 6)
    i = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    live = i < g_rows + ring_n + n_new
    is_g = live & (i < g_rows)
    is_r = live & (i >= g_rows) & (i < g_rows + ring_n)
    is_n = live & (i >= g_rows + ring_n)
    ctx = is_g | is_r
    pos = prefix - ring_n + (i - g_rows)  # ring rows
    slot = tl.where(is_r, pos, 0) % window
    col = tl.where(is_g, ring_cols + i // PAGE, slot // PAGE)
    off = tl.where(is_g, i % PAGE, slot % PAGE)
    page = tl.load(PageTable + r * stride_pr + layer * stride_pl + h * stride_ph + col, mask=ctx, other=0)
    d = tl.arange(0, HEAD_DIM)[None, :]
    crow = (page.to(tl.int64) * PAGE + off)[:, None] * HEAD_DIM + d
    t = start + i - g_rows - ring_n  # chunk rows
    orow = (out0 + i)[:, None] * stride_on + h * stride_oh + d
    ck = _cached(tl.load(KPages + crow, mask=ctx[:, None]), KScale, layer, OutK, QUANT)
    nk = tl.load(K + t[:, None] * stride_kn + h * stride_kh + d, mask=is_n[:, None]).to(OutK.dtype.element_ty)
    tl.store(OutK + orow, tl.where(ctx[:, None], ck, nk), mask=live[:, None])
    cv = _cached(tl.load(VPages + crow, mask=ctx[:, None]), VScale, layer, OutV, QUANT)
    nv = tl.load(V + t[:, None] * stride_vn + h * stride_vh + d, mask=is_n[:, None]).to(OutV.dtype.element_ty)
    tl.store(OutV + orow, tl.where(ctx[:, None], cv, nv), mask=live[:, None])
    glen = tl.load(GlobalLen + r * stride_gr + layer * stride_gl + h)
    r_adm = tl.load(RingFlag + r * stride_fr + layer * stride_fl + h * stride_fh + slot, mask=is_r, other=0)
    n_adm = tl.load(Admit + t * stride_an + h, mask=is_n, other=0)
    adm = tl.where(is_g, (i < glen).to(tl.uint8), tl.where(is_r, r_adm, n_adm))
    tl.store(OutAdm + (out0 + i) * stride_dn + h, adm, mask=live)
    if h == 0:
        npos = tl.load(Positions + t, mask=is_n, other=0)
        kpos = tl.where(is_g, FAR, tl.where(is_r, pos, npos))
        tl.store(OutPos + out0 + i, kpos.to(OutPos.dtype.element_ty), mask=live)


EXTEND_BLOCK = 64  # candidates / ring rows per program of the extend kernels


def _check_rows(pool, k, v):
    if (
        k.shape[1:] != (pool.num_kv_heads, pool.head_dim)
        or v.shape != k.shape
        or k.stride(2) != 1
        or v.stride(2) != 1
    ):
        raise ValueError(
            f"k/v [N, {pool.num_kv_heads}, {pool.head_dim}] with a contiguous last dim expected, got "
            f"{tuple(k.shape)} {k.stride()}, {tuple(v.shape)} {v.stride()}"
        )


def _quant_args(pool) -> dict:
    """The kernels' FP8 constants of ``pool`` (its pages FP8 or not)."""
    return {"QUANT": pool.quantized, "FP8_MAX": torch.finfo(pool.dtype).max if pool.quantized else 0.0}


def extend_move(pool, layer: int, k, v, flag, dest_page, dest, from_ring, src_page, slot, src) -> None:
    """Admitted candidates of ``write_extend`` in ``layer`` into their global slots (one launch). ``flag``,
    ``dest_page``, ``dest``, ``src_page`` ``[C, H]`` (views of a group's ``[C, G, H]`` taken as they
    are: heads contiguous, one row stride); ``from_ring``, ``slot``, ``src`` ``[C]``; k, v ``[N, H, D]``
    the chunk's rows. Reads ring slots before :func:`extend_ring_write` overwrites them (same stream)."""
    _check_rows(pool, k, v)
    C, H = flag.shape
    if not C:
        return
    per_cand = (flag, dest_page, dest, src_page)
    if any(t.stride() != (flag.stride(0), 1) for t in per_cand):
        flag, dest_page, dest, src_page = (t.contiguous() for t in per_cand)
    _extend_move_kernel[(triton.cdiv(C, EXTEND_BLOCK), H)](
        k,
        v,
        pool.k_pages,
        pool.v_pages,
        flag.view(torch.uint8),
        dest_page,
        dest,
        from_ring.contiguous().view(torch.uint8),
        src_page,
        slot.contiguous(),
        src.contiguous(),
        pool.k_scale,
        pool.v_scale,
        layer,
        C,
        flag.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=pool.head_dim,
        PAGE=PAGE_SIZE,
        BLOCK_C=EXTEND_BLOCK,
        **_quant_args(pool),
    )


def compile_extend_move(pool, dtype: torch.dtype) -> None:
    """:func:`extend_move`'s variant for ``pool`` and chunk rows of ``dtype``, compiled by a launch whose
    one candidate is not admitted (it stores nothing): a server's warm-up prompt fits the ring, so no
    token leaves it there, and the first long prompt would compile it in its prefill."""
    dev, H, D = pool.page_table.device, pool.num_kv_heads, pool.head_dim
    rows = torch.zeros(1, H, D, dtype=dtype, device=dev)
    none = torch.zeros(1, H, dtype=torch.bool, device=dev)
    index = torch.zeros(1, H, dtype=torch.int64, device=dev)
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    extend_move(pool, 0, rows, rows, none, index, index, none[:, 0], index, one, one)


def compile_extend_context(pool, dtype: torch.dtype) -> None:
    """:func:`extend_context`'s variant for ``pool``, chunk rows and attention inputs of ``dtype``,
    compiled by a launch over one new row of scratch buffers (no page is read): the warm-up prompt has
    no cached context, so only a chunk after a prefix reaches it."""
    dev, H, D = pool.page_table.device, pool.num_kv_heads, pool.head_dim
    rows = torch.zeros(1, H, D, dtype=dtype, device=dev)
    segment = torch.tensor([[0, 0, 0, 0, 1, 0, 0]], dtype=torch.int64, device=dev)  # one new row
    out_k, out_v = torch.empty_like(rows), torch.empty_like(rows)
    positions, out_pos = (torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(2))  # as served
    admit, out_adm = (torch.zeros(1, H, dtype=torch.bool, device=dev) for _ in range(2))
    extend_context(pool, 0, segment, 1, rows, rows, admit, positions, out_k, out_v, out_pos, out_adm)


def extend_context(
    pool,
    layer: int,
    segments: torch.Tensor,
    max_rows: int,
    k,
    v,
    admit,
    positions,
    out_k,
    out_v,
    out_pos,
    out_adm,
) -> None:
    """The attention inputs of one layer's extend into ``out_*`` (one launch): ``segments`` ``[B, 7]``
    int64 on the device, a row a request (slot, prefix, global rows, ring rows, new rows, first chunk
    row, first output row; the context's rows as :func:`~sglang_wgkv.memory.extend_step.context_rows`
    counts them), ``max_rows`` the most rows a request has (host int); k, v ``[N, H, D]``, admit
    ``[N, H]`` bool, positions ``[N]`` the chunk's rows."""

    _check_rows(pool, k, v)
    B = segments.shape[0]
    if not B or not max_rows:
        return
    if segments.dtype != torch.int64 or segments.shape[1] != SEG_FIELDS or segments.stride(1) != 1:
        raise ValueError(
            f"segments must be [B, {SEG_FIELDS}] int64 with contiguous rows, got {segments.shape}"
        )
    H, D, W = pool.num_kv_heads, pool.head_dim, pool.window
    pt, gl, rf = pool.page_table, pool.global_len, pool.ring_flag.view(torch.uint8)
    adm = admit.contiguous().view(torch.uint8)
    positions = positions.contiguous()  # read at row t
    if (
        out_k.stride(2) != 1
        or out_v.stride() != out_k.stride()
        or out_pos.stride(0) != 1
        or not out_adm.is_contiguous()
    ):
        raise ValueError("the extend inputs' buffers must be contiguous (as extend_inputs allocates them)")
    oadm = out_adm.view(torch.uint8)
    _extend_context_kernel[(triton.cdiv(max_rows, EXTEND_BLOCK), H, B)](
        pool.k_pages,
        pool.v_pages,
        pt,
        gl,
        rf,
        k,
        v,
        adm,
        positions,
        pool.k_scale,
        pool.v_scale,
        out_k,
        out_v,
        out_pos,
        oadm,
        segments,
        layer,
        W,
        pool.ring_cols,
        pt.stride(0),
        pt.stride(1),
        pt.stride(2),
        gl.stride(0),
        gl.stride(1),
        rf.stride(0),
        rf.stride(1),
        rf.stride(2),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        adm.stride(0),
        out_k.stride(0),
        out_k.stride(1),
        oadm.stride(0),
        FAR=FAR_POSITION,
        HEAD_DIM=D,
        PAGE=PAGE_SIZE,
        BLOCK_R=EXTEND_BLOCK,
        QUANT=pool.quantized,
        SEG=SEG_FIELDS,
    )


def extend_ring_write(pool, layer: int, k, v, admit, req, rw_b, rw_slot, rw_src) -> None:
    """The chunk's ring rows of ``write_extend`` (one launch): row ``rw_src[i]`` of k, v and its flag
    ``admit[rw_src[i]]`` into ring slot ``rw_slot[i]`` of request ``req[rw_b[i]]``."""
    _check_rows(pool, k, v)
    n = rw_b.numel()
    if not n:
        return
    H = pool.num_kv_heads
    pt, rf = pool.page_table, pool.ring_flag.view(torch.uint8)
    adm = admit.contiguous().view(torch.uint8)
    _extend_ring_kernel[(triton.cdiv(n, EXTEND_BLOCK), H)](
        k,
        v,
        pool.k_pages,
        pool.v_pages,
        pt,
        rf,
        adm,
        req,
        rw_b,
        rw_slot,
        rw_src,
        pool.k_scale,
        pool.v_scale,
        layer,
        n,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        pt.stride(0),
        pt.stride(1),
        pt.stride(2),
        rf.stride(0),
        rf.stride(1),
        rf.stride(2),
        adm.stride(0),
        HEAD_DIM=pool.head_dim,
        PAGE=PAGE_SIZE,
        BLOCK_C=EXTEND_BLOCK,
        **_quant_args(pool),
    )
