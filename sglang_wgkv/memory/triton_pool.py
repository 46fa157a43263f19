"""Triton writes into :class:`~sglang_wgkv.memory.dual_pool.DualCachePool` for the CUDA path.

Both functions leave the pool exactly as its torch ops do (same page ids, page tables, lengths,
flags and page contents; only the never-read dump page may differ):

* :func:`begin_prefill` + :func:`prefill_write` = ``begin_extend`` + ``write_extend`` for a request
  prefilled from scratch, with two differences in *how*: global pages are reserved per layer for the
  exact admitted count (one host sync per layer) instead of for the worst case of every layer at
  once (which needs a dense-sized pool at 400K tokens), and one kernel moves the tokens.
* :func:`decode_write` = ``write_decode`` with the batch's slots and positions passed explicitly,
  so that a captured CUDA graph can replay it (the step's tensors stay the caller's).
* :func:`decode_promote` = ``_promote`` (a decode step's lazy promotion, every layer and head) in two
  launches without a host sync; ``DualCachePool.begin_decode`` uses it on CUDA.

The kernels are in :mod:`~sglang_wgkv.memory.triton_pool_write_kernels` and
:mod:`~sglang_wgkv.memory.triton_promote_kernels`; the extend step's kernels (a prefill chunk after a cached prefix) are in :mod:`~sglang_wgkv.memory.triton_extend`.
"""

import torch
import triton

from sglang_wgkv.config import PAGE_SIZE
from sglang_wgkv.memory.kv_quant import byte_view
from sglang_wgkv.memory.triton_pool_write_kernels import _decode_write_kernel, _prefill_write_kernel
from sglang_wgkv.memory.triton_promote_kernels import (
    _promote_alloc_blocks_kernel,
    _promote_alloc_kernel,
    _promote_count_kernel,
    _promote_move_kernel,
    _promote_take_kernel,
)

PROMOTE_SCAN_BLOCK = (
    1024  # promotion items per block (a power of two): one program below it, a grid of blocks above
)
# Block counts summed per step of the scans' loops. The block sizes are fixed, not fitted to the batch,
# so that every batch runs the variants compiled at start-up (testing/jit_keys.py).
PROMOTE_COUNTS_BLOCK = 64


def begin_prefill(pool, r: int, n: int) -> None:
    """Prepare a from-scratch prefill of ``n`` tokens into allocated, empty slot ``r``: the ring
    pages of every layer, allocated as ``begin_extend`` does. Then call :func:`prefill_write` once
    per layer, in layer order."""
    if not pool.active[r] or pool.cached_len[r] != 0:
        raise ValueError(f"slot {r} must be allocated and empty")
    if n <= 0 or n > pool.max_context_len:
        raise ValueError(f"prefill of {n} tokens outside (0, {pool.max_context_len}]")
    L, H = pool.num_layers, pool.num_kv_heads
    c1 = pool.ring_pages(n)
    pages = pool.allocator.alloc(L * H * c1).to(torch.int32)
    pool.page_table[r, :, :, :c1] = pages.view(L, H, c1)
    pool.cached_len[r] = n


def prefill_write(pool, r: int, layer: int, k: torch.Tensor, v: torch.Tensor, admit: torch.Tensor) -> None:
    """Write one layer of a from-scratch prefill: k, v ``[n, H, D]``, admit ``[n, H]`` bool.

    Tokens ``[0, n - W)`` go to the global pages iff admitted (in order), the last ``W`` tokens to
    their ring slots with their flags. Syncs once to reserve the exact global pages.
    """
    n, H, D = k.shape
    W = pool.window
    if pool.quantized:
        raise ValueError("prefill_write does not write FP8 pages (the served path uses write_extend)")
    if v.shape != k.shape or admit.shape != (n, H) or H != pool.num_kv_heads or D != pool.head_dim:
        raise ValueError(
            f"k/v [n, {pool.num_kv_heads}, {pool.head_dim}] and admit [n, H] expected, got "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(admit.shape)}"
        )
    if pool.cached_len[r] != n:
        raise ValueError(f"slot {r}: begin_prefill was for {pool.cached_len[r]} tokens, not {n}")
    if k.stride(2) != 1 or v.stride() != k.stride():
        raise ValueError("k and v need equal strides and a contiguous last dim")
    dev = pool.device
    leaving = max(0, n - W)
    flags = admit[:leaving]
    cnt = flags.sum(0)  # [H] int64
    # Exclusive scan along the contiguous dim (torch scans an [n, 8] outer dim one thread per column).
    ft = flags.t().contiguous()
    rank = (torch.cumsum(ft, 1, dtype=torch.int32) - ft.to(torch.int32)).t()
    glen = pool.global_len[r, layer].long()  # [H]
    old = (glen + PAGE_SIZE - 1) // PAGE_SIZE
    new = (glen + cnt + PAGE_SIZE - 1) // PAGE_SIZE - old
    pool.allocator.ensure(int(new.sum()))
    max_new_pages = (-(-leaving // PAGE_SIZE) + 1) if leaving else 1
    j = torch.arange(max_new_pages, device=dev)
    need = (j < new[:, None])[None]  # [1, H, M], as _append_pages
    pages = pool.allocator.alloc_where(need).to(torch.int32)[0]
    col = torch.where(need[0], pool.ring_cols + old[:, None] + j, pool.dump_col)
    heads = torch.arange(H, device=dev)
    pool.page_table[r, layer, heads[:, None], col] = torch.where(need[0], pages, pool.dump_page)
    adm_u8 = admit.contiguous().view(torch.uint8)
    rank_full = torch.zeros(n, H, dtype=torch.int32, device=dev)
    rank_full[:leaving] = rank
    block_t = 64
    grid = (triton.cdiv(n, block_t), H)
    row = pool.page_table[r, layer]
    _prefill_write_kernel[grid](
        k,
        v,
        pool.k_pages,
        pool.v_pages,
        row,
        adm_u8,
        rank_full,
        pool.global_len[r, layer],
        n,
        leaving,
        W,
        pool.ring_cols,
        k.stride(0),
        k.stride(1),
        adm_u8.stride(0),
        row.stride(0),
        HEAD_DIM=D,
        BLOCK_T=block_t,
    )
    t = torch.arange(leaving, n, device=dev)
    pool.ring_flag[r, layer, heads[None, :], (t % W)[:, None]] = admit[leaving:]
    pool.global_len[r, layer] += cnt.to(torch.int32)
    pool.left_ring[layer] += leaving
    pool.promoted[layer] += cnt


def decode_write(
    pool,
    layer: int,
    req: torch.Tensor,
    pos: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    admit: torch.Tensor | None,
) -> None:
    """The new token of each request into its ring slot ``pos % W`` of ``layer`` (after the step's
    promotion). req, pos ``[B]`` int64 device tensors; k, v ``[B, H, D]``; admit ``[B, H]`` bool.
    ``admit=None`` writes only the keys and values, ``k=v=None`` only the flags (the two halves may
    run on different streams: attention reads the keys and values, the next promotion the flags)."""
    if k is None and v is None and admit is None:
        raise ValueError("nothing to write: k/v and admit are all None")
    if (k is None) != (v is None):
        raise ValueError("k and v go together")
    B, H = req.shape[0], pool.num_kv_heads
    D = pool.head_dim
    if k is not None and (k.shape != (B, H, D) or v.shape != k.shape):
        raise ValueError(f"k/v [{B}, {H}, {D}] expected, got {tuple(k.shape)}, {tuple(v.shape)}")
    if admit is not None and admit.shape != (B, H):
        raise ValueError(f"admit [{B}, {H}] expected, got {tuple(admit.shape)}")
    if pos.shape != (B,):
        raise ValueError(f"req/pos [B] expected, got {tuple(req.shape)}, {tuple(pos.shape)}")
    if k is not None and (k.stride(2) != 1 or v.stride() != k.stride()):
        raise ValueError("k and v need equal strides and a contiguous last dim")
    pt, rf = pool.page_table, pool.ring_flag
    adm = admit.contiguous().view(torch.uint8) if admit is not None else rf.view(torch.uint8)
    kk, vv = (k, v) if k is not None else (pool.k_pages, pool.v_pages)
    _decode_write_kernel[(B, H)](
        kk,
        vv,
        pool.k_pages,
        pool.v_pages,
        pt,
        rf.view(torch.uint8),
        adm,
        req,
        pos,
        pool.k_scale,
        pool.v_scale,
        layer,
        pool.window,
        kk.stride(0) if k is not None else 0,
        kk.stride(1) if k is not None else 0,
        pt.stride(0),
        pt.stride(1),
        pt.stride(2),
        rf.stride(0),
        rf.stride(1),
        rf.stride(2),
        adm.stride(0),
        HEAD_DIM=D,
        WRITE_KV=k is not None,
        WRITE_FLAG=admit is not None,
        QUANT=pool.quantized,
        FP8_MAX=torch.finfo(pool.dtype).max if pool.quantized else 0.0,
        num_warps=1,
    )


def _launch(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def _compile(kernel, grid, *args, **kwargs):
    kernel.warmup(*args, grid=grid, **kwargs)


def _promote_scan(pool, req: torch.Tensor, pos: torch.Tensor, n_items: int, launch) -> None:
    """The allocation scan of :func:`decode_promote` over ``n_items = B * L * H`` items: one program up
    to :data:`PROMOTE_SCAN_BLOCK` items, else counts, allocation and ``num_free`` over blocks.
    ``launch(kernel, grid, *args, **kwargs)`` runs (or only compiles) each launch."""
    L, H, W = pool.num_layers, pool.num_kv_heads, pool.window
    LH = L * H
    alloc = pool.allocator
    cols = pool.page_table.shape[-1]
    common = (req, pos, pool.ring_flag.view(torch.uint8), pool.global_len)
    tail = (pool.page_table, alloc.free_stack, alloc.num_free, alloc.ref, pool.left_ring, pool.promoted)
    if n_items <= PROMOTE_SCAN_BLOCK:
        launch(
            _promote_alloc_kernel,
            (1,),
            *common,
            *tail,
            n_items,
            LH,
            W,
            pool.ring_cols,
            cols,
            BLOCK=PROMOTE_SCAN_BLOCK,
            num_warps=4,
        )
        return
    n_blocks = triton.cdiv(n_items, PROMOTE_SCAN_BLOCK)
    counts = torch.empty(n_blocks, dtype=torch.int64, device=req.device)
    launch(
        _promote_count_kernel,
        (n_blocks,),
        *common,
        counts,
        n_items,
        LH,
        W,
        BLOCK=PROMOTE_SCAN_BLOCK,
        num_warps=4,
    )
    launch(
        _promote_alloc_blocks_kernel,
        (n_blocks,),
        *common,
        *tail,
        counts,
        n_items,
        LH,
        W,
        pool.ring_cols,
        cols,
        BLOCK=PROMOTE_SCAN_BLOCK,
        BLOCKS_PAD=PROMOTE_COUNTS_BLOCK,
        num_warps=4,
    )
    launch(
        _promote_take_kernel,
        (1,),
        alloc.num_free,
        counts,
        n_blocks,
        BLOCKS_PAD=PROMOTE_COUNTS_BLOCK,
        num_warps=1,
    )


def compile_decode_promote(pool) -> None:
    """Compile, without launching, both allocation scans of :func:`decode_promote` for ``pool``: a
    server's warm-up decodes one request (the one-program scan), while a batch of more than
    ``PROMOTE_SCAN_BLOCK / (L * H)`` requests runs the block scan, which would otherwise compile
    in the middle of a request."""
    one = torch.zeros(1, dtype=torch.int64, device=pool.page_table.device)
    for n_items in (1, PROMOTE_SCAN_BLOCK + 1):
        _promote_scan(pool, one, one, n_items, _compile)


def decode_promote(
    pool, req: torch.Tensor, pos: torch.Tensor, plan_out=None, lower_floor: bool = True
) -> None:
    """Lazy promotion of every (request, layer, head) of a decode batch: the pool ends exactly as
    after ``pool._promote(req, pos)`` (same pages from the free stack in the same order, page table,
    global lengths, refcounts, ``num_free``, ``free_floor``, counters, moved K/V rows; only the
    never-read dump page differs). req, pos ``[B]`` contiguous integer device tensors (distinct slots); the
    caller has called ``pool.allocator.ensure`` for ``B * L * H`` pages.

    Two kernel launches (one single-program allocation scan, one grid that moves the rows); past
    :data:`PROMOTE_SCAN_BLOCK` items (``B * L * H``) the scan runs over blocks of that many in
    parallel (three launches: counts, allocation, ``num_free``; one ``[blocks]`` int64 allocation).
    No host sync: capturable in a CUDA graph (the values of ``req`` / ``pos`` at replay are used).
    The host-side ``free_floor`` bookkeeping (``-= B * L * H``, skipped with
    ``lower_floor=False``) happens at call time only, so a caller that replays a captured promotion
    must call ``ensure`` and lower ``pool.allocator.free_floor`` itself before each replay.

    ``plan_out = (ring_page [B, L, H], ring_off [B, 1], ring_tokens [B])`` int64, if given, receive
    the decode plan of :meth:`DualCachePool.begin_decode` (ring page / offset of slot ``pos % W``,
    ``min(pos + 1, W)``) from the same launch.
    """
    B = req.shape[0]
    L, H, W = pool.num_layers, pool.num_kv_heads, pool.window
    LH = L * H
    alloc = pool.allocator
    for t in (pool.page_table, pool.global_len, pool.ring_flag, pool.k_pages, pool.v_pages, alloc.free_stack):
        if not t.is_contiguous():
            raise ValueError("decode_promote needs the pool's contiguous tensors")
    if req.shape != (B,) or pos.shape != (B,) or req.stride(0) != 1 or pos.stride(0) != 1:
        raise ValueError(f"req and pos must be contiguous [B], got {tuple(req.shape)}, {tuple(pos.shape)}")
    if B == 0:
        return
    cols = pool.page_table.shape[-1]
    flags = pool.ring_flag.view(torch.uint8)
    _promote_scan(pool, req, pos, B * LH, _launch)
    if lower_floor:
        alloc.free_floor -= B * LH
    block_r = min(64, triton.next_power_of_2(LH))
    plan = plan_out if plan_out is not None else (req, req, req)  # unused pointers when WRITE_PLAN is off
    _promote_move_kernel[(triton.cdiv(LH, block_r), B)](
        req,
        pos,
        flags,
        pool.global_len,
        pool.page_table,
        byte_view(pool.k_pages),  # promotion moves bytes: an FP8 token is never rounded twice
        byte_view(pool.v_pages),
        *plan,
        LH,
        W,
        pool.ring_cols,
        cols,
        HEAD_DIM=pool.head_dim,
        BLOCK_R=block_r,
        WRITE_PLAN=plan_out is not None,
        num_warps=4,
    )
