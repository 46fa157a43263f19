"""Triton writes into :class:`~sglang_wgkv.memory.dual_pool.DualCachePool` for the CUDA path.

Both functions leave the pool exactly as its torch ops do (same page ids, page tables, lengths,
flags and page contents; only the never-read dump page may differ):

* :func:`begin_prefill` + :func:`prefill_write` = ``begin_extend`` + ``write_extend`` for a request
  prefilled from scratch, with two differences in *how*: global pages are reserved per layer for the
  exact admitted count (one host sync per layer) instead of for the worst case of every layer at
  once (which needs a dense-sized pool at 400K tokens), and one kernel moves the tokens.
* :func:`decode_write` = ``write_decode`` with the batch's slots and positions passed explicitly,
  so that a captured CUDA graph can replay it (the step's tensors stay the caller's).
"""

import torch
import triton
import triton.language as tl

from sglang_wgkv.config import PAGE_SIZE


@triton.jit
def _prefill_write_kernel(K, V, KPages, VPages, PageRow, Admit, Rank, GlobalLen,
                          n_tokens, leaving, window, ring_cols, stride_kn, stride_kh, stride_an, stride_ph,
                          HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HEAD_DIM)
    valid = t < n_tokens
    in_ring = t >= leaving
    flag = tl.load(Admit + t.to(tl.int64) * stride_an + h, mask=valid & ~in_ring, other=0) != 0
    g = tl.load(GlobalLen + h) + tl.load(Rank + t.to(tl.int64) * stride_an + h, mask=valid & ~in_ring, other=0)
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


@triton.jit
def _decode_write_kernel(K, V, KPages, VPages, PageTable, RingFlag, Admit, Req, Pos,
                         layer, window, stride_kb, stride_kh, stride_pr, stride_pl, stride_ph,
                         stride_fr, stride_fl, stride_fh, stride_ab,
                         HEAD_DIM: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    r = tl.load(Req + b).to(tl.int64)
    slot = tl.load(Pos + b).to(tl.int64) % window
    row = r * stride_pr + layer * stride_pl + h * stride_ph
    page = tl.load(PageTable + row + slot // 16).to(tl.int64)
    dst = (page * 16 + slot % 16) * HEAD_DIM + d
    src = b * stride_kb + h * stride_kh + d
    tl.store(KPages + dst, tl.load(K + src).to(KPages.dtype.element_ty))
    tl.store(VPages + dst, tl.load(V + src).to(VPages.dtype.element_ty))
    flag = tl.load(Admit + b * stride_ab + h)
    tl.store(RingFlag + r * stride_fr + layer * stride_fl + h * stride_fh + slot, flag)


def begin_prefill(pool, r: int, n: int) -> None:
    """Prepare a from-scratch prefill of ``n`` tokens into allocated, empty slot ``r``: the ring
    pages of every layer, allocated as ``begin_extend`` does. Then call :func:`prefill_write` once
    per layer, in layer order."""
    if not pool.active[r] or pool.cached_len[r] != 0:
        raise ValueError(f"slot {r} must be allocated and empty")
    if n <= 0 or n > pool.max_context_len:
        raise ValueError(f"prefill of {n} tokens outside (0, {pool.max_context_len}]")
    L, H = pool.num_layers, pool.num_kv_heads
    c1 = -(-min(n, pool.window) // PAGE_SIZE)
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
    if v.shape != k.shape or admit.shape != (n, H) or H != pool.num_kv_heads or D != pool.head_dim:
        raise ValueError(f"k/v [n, {pool.num_kv_heads}, {pool.head_dim}] and admit [n, H] expected, got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(admit.shape)}")
    if pool.cached_len[r] != n:
        raise ValueError(f"slot {r}: begin_prefill was for {pool.cached_len[r]} tokens, not {n}")
    if k.stride(2) != 1 or v.stride() != k.stride():
        raise ValueError("k and v need equal strides and a contiguous last dim")
    dev = pool.device
    leaving = max(0, n - W)
    flags = admit[:leaving]
    cnt = flags.sum(0)                                                 # [H] int64
    # Exclusive scan along the contiguous dim (torch scans an [n, 8] outer dim one thread per column).
    ft = flags.t().contiguous()
    rank = (torch.cumsum(ft, 1, dtype=torch.int32) - ft.to(torch.int32)).t()
    glen = pool.global_len[r, layer].long()                            # [H]
    old = (glen + PAGE_SIZE - 1) // PAGE_SIZE
    new = (glen + cnt + PAGE_SIZE - 1) // PAGE_SIZE - old
    pool.allocator.ensure(int(new.sum()))
    max_new_pages = (-(-leaving // PAGE_SIZE) + 1) if leaving else 1
    j = torch.arange(max_new_pages, device=dev)
    need = (j < new[:, None])[None]                                    # [1, H, M], as _append_pages
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
    _prefill_write_kernel[grid](k, v, pool.k_pages, pool.v_pages, row, adm_u8, rank_full,
                                pool.global_len[r, layer], n, leaving, W, pool.ring_cols,
                                k.stride(0), k.stride(1), adm_u8.stride(0), row.stride(0),
                                HEAD_DIM=D, BLOCK_T=block_t)
    t = torch.arange(leaving, n, device=dev)
    pool.ring_flag[r, layer, heads[None, :], (t % W)[:, None]] = admit[leaving:]
    pool.global_len[r, layer] += cnt.to(torch.int32)
    pool.left_ring[layer] += leaving
    pool.promoted[layer] += cnt


def decode_write(pool, layer: int, req: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 admit: torch.Tensor) -> None:
    """The new token of each request into its ring slot ``pos % W`` of ``layer`` (after the step's
    promotion). req, pos ``[B]`` int64 device tensors; k, v ``[B, H, D]``; admit ``[B, H]`` bool."""
    B, H, D = k.shape
    if v.shape != k.shape or admit.shape != (B, H) or req.shape != (B,) or pos.shape != (B,):
        raise ValueError(f"req/pos [B], k/v [B, H, D], admit [B, H] expected, got {tuple(req.shape)}, "
                         f"{tuple(pos.shape)}, {tuple(k.shape)}, {tuple(admit.shape)}")
    if k.stride(2) != 1 or v.stride() != k.stride():
        raise ValueError("k and v need equal strides and a contiguous last dim")
    pt, rf = pool.page_table, pool.ring_flag
    adm = admit.contiguous()
    _decode_write_kernel[(B, H)](k, v, pool.k_pages, pool.v_pages, pt, rf.view(torch.uint8),
                                 adm.view(torch.uint8), req, pos, layer, pool.window,
                                 k.stride(0), k.stride(1), pt.stride(0), pt.stride(1), pt.stride(2),
                                 rf.stride(0), rf.stride(1), rf.stride(2), adm.stride(0),
                                 HEAD_DIM=D, num_warps=1)
