"""Triton kernels of a decode step's lazy promotion (ring victims into global pages, every layer and
head): the one-program scan and, past ``PROMOTE_SCAN_BLOCK`` items, the block-parallel scan.

Launched by :func:`~sglang_wgkv.memory.triton_pool.decode_promote`; torch reference:
``DualCachePool._promote``.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["start", "n_items"])
def _promote_items(Req, Pos, RingFlag, GlobalLen, start, n_items, LH, window, BLOCK: tl.constexpr):
    """Items ``i = b * LH + (l * H + h)`` of one block: (valid, lh, row, leaving, flag, g, need)."""
    i = start + tl.arange(0, BLOCK)
    valid = i < n_items
    b = i // LH
    lh = i % LH
    r = tl.load(Req + b, mask=valid, other=0).to(tl.int64)
    p = tl.load(Pos + b, mask=valid, other=0).to(tl.int64)
    row = r * LH + lh
    leaving = valid & (p >= window)
    flag = leaving & (tl.load(RingFlag + row * window + p % window, mask=leaving, other=0) != 0)
    g = tl.load(GlobalLen + row, mask=valid, other=0)
    need = flag & (g % 16 == 0)  # promoted into a fresh global page
    return valid, lh, row, leaving, flag, g, need


@triton.jit(do_not_specialize=["start", "n_items", "num_free", "taken"])
def _promote_block(
    Req,
    Pos,
    RingFlag,
    GlobalLen,
    PageTable,
    FreeStack,
    Ref,
    LeftRing,
    Promoted,
    start,
    n_items,
    num_free,
    taken,
    LH,
    window,
    ring_cols,
    cols,
    BLOCK: tl.constexpr,
):
    """Promote one block's items; its new pages are free-stack entries ``taken ..`` from the top (the
    items before the block took ``taken``). Returns the pages it took."""
    valid, lh, row, leaving, flag, g, need = _promote_items(
        Req, Pos, RingFlag, GlobalLen, start, n_items, LH, window, BLOCK
    )
    rank = taken + tl.cumsum(need.to(tl.int64), 0) - 1
    page = tl.load(FreeStack + (num_free - 1 - rank), mask=need, other=0)
    tl.store(PageTable + row * cols + ring_cols + g // 16, page.to(tl.int32), mask=need)
    tl.store(Ref + page, tl.full([BLOCK], 1, tl.int32), mask=need)
    tl.store(GlobalLen + row, g + 1, mask=flag)
    tl.atomic_add(Promoted + lh, flag.to(tl.int64), mask=valid)
    tl.atomic_add(LeftRing + lh, leaving.to(tl.int64), mask=valid)
    return tl.sum(need.to(tl.int64), 0)


@triton.jit(do_not_specialize=["n_items"], do_not_specialize_on_alignment=["Req", "Pos"])
def _promote_alloc_kernel(
    Req,
    Pos,
    RingFlag,
    GlobalLen,
    PageTable,
    FreeStack,
    NumFree,
    Ref,
    LeftRing,
    Promoted,
    n_items,
    LH,
    window,
    ring_cols,
    cols,
    BLOCK: tl.constexpr,
):
    # One program, every item in one block (n_items <= BLOCK): the allocation order of alloc_where.
    num_free = tl.load(NumFree)
    taken = _promote_block(
        Req,
        Pos,
        RingFlag,
        GlobalLen,
        PageTable,
        FreeStack,
        Ref,
        LeftRing,
        Promoted,
        0,
        n_items,
        num_free,
        num_free * 0,
        LH,
        window,
        ring_cols,
        cols,
        BLOCK,
    )
    tl.store(NumFree, num_free - taken)


# Past one block of items (a batch of more than PROMOTE_SCAN_BLOCK / (L * H) requests) the scan runs
# over the blocks in parallel: count the new pages of every block, then each block takes its pages
# after the earlier blocks' (a prefix sum of the counts), then one program lowers num_free. At W3's
# batch (128 x 256 streams, 32 blocks) a single-program scan was a visible share of the decode step.
@triton.jit(do_not_specialize=["n_items"], do_not_specialize_on_alignment=["Req", "Pos"])
def _promote_count_kernel(Req, Pos, RingFlag, GlobalLen, Counts, n_items, LH, window, BLOCK: tl.constexpr):
    blk = tl.program_id(0)
    need = _promote_items(Req, Pos, RingFlag, GlobalLen, blk * BLOCK, n_items, LH, window, BLOCK)[6]
    tl.store(Counts + blk, tl.sum(need.to(tl.int64), 0))


@triton.jit(do_not_specialize=["n_items"], do_not_specialize_on_alignment=["Req", "Pos"])
def _promote_alloc_blocks_kernel(
    Req,
    Pos,
    RingFlag,
    GlobalLen,
    PageTable,
    FreeStack,
    NumFree,
    Ref,
    LeftRing,
    Promoted,
    Counts,
    n_items,
    LH,
    window,
    ring_cols,
    cols,
    BLOCK: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
):
    blk = tl.program_id(0)
    taken = tl.full([], 0, tl.int64)  # pages of the blocks before this one
    for k0 in range(0, blk, BLOCKS_PAD):
        k = k0 + tl.arange(0, BLOCKS_PAD)
        taken += tl.sum(tl.load(Counts + k, mask=k < blk, other=0), 0)
    _promote_block(
        Req,
        Pos,
        RingFlag,
        GlobalLen,
        PageTable,
        FreeStack,
        Ref,
        LeftRing,
        Promoted,
        blk * BLOCK,
        n_items,
        tl.load(NumFree),
        taken,
        LH,
        window,
        ring_cols,
        cols,
        BLOCK,
    )


@triton.jit(do_not_specialize=["n_blocks"])
def _promote_take_kernel(NumFree, Counts, n_blocks, BLOCKS_PAD: tl.constexpr):
    taken = tl.full([], 0, tl.int64)
    for k0 in range(0, n_blocks, BLOCKS_PAD):
        k = k0 + tl.arange(0, BLOCKS_PAD)
        taken += tl.sum(tl.load(Counts + k, mask=k < n_blocks, other=0), 0)
    tl.store(NumFree, tl.load(NumFree) - taken)


@triton.jit(do_not_specialize_on_alignment=["Req", "Pos", "RingPage", "RingOff", "RingTokens"])
def _promote_move_kernel(
    Req,
    Pos,
    RingFlag,
    GlobalLen,
    PageTable,
    KPages,
    VPages,
    RingPage,
    RingOff,
    RingTokens,
    LH,
    window,
    ring_cols,
    cols,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WRITE_PLAN: tl.constexpr,
):
    # Runs after _promote_alloc_kernel: global_len is the new length, so a promoted token goes to old = new - 1.
    b = tl.program_id(1)
    lh = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, HEAD_DIM)
    valid = lh < LH
    r = tl.load(Req + b).to(tl.int64)
    p = tl.load(Pos + b).to(tl.int64)
    slot = p % window
    row = r * LH + lh
    flag = valid & (p >= window) & (tl.load(RingFlag + row * window + slot, mask=valid, other=0) != 0)
    g = tl.load(GlobalLen + row, mask=flag, other=1).to(tl.int64) - 1
    dest = tl.load(PageTable + row * cols + ring_cols + g // 16, mask=flag, other=0).to(tl.int64)
    src = tl.load(PageTable + row * cols + slot // 16, mask=valid, other=0).to(tl.int64)
    src_off = ((src * 16 + slot % 16) * HEAD_DIM)[:, None] + d[None, :]
    dst_off = ((dest * 16 + g % 16) * HEAD_DIM)[:, None] + d[None, :]
    tl.store(KPages + dst_off, tl.load(KPages + src_off, mask=flag[:, None]), mask=flag[:, None])
    tl.store(VPages + dst_off, tl.load(VPages + src_off, mask=flag[:, None]), mask=flag[:, None])
    if WRITE_PLAN:
        tl.store(RingPage + b * LH + lh, src, mask=valid)
        if tl.program_id(0) == 0:
            tl.store(RingOff + b, slot % 16)
            tl.store(RingTokens + b, tl.minimum(p + 1, window))
