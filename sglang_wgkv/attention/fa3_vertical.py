"""FA3 for the vertical range of the vertical-slash prefill, the dense and unmasked bulk of its work.

The vertical range of query block ``i`` and KV head ``h`` (:mod:`.vertical_slash_plan`) is every
admitted key at least ``W`` before the block, visible to each of its queries: an attention without a
mask of the block's queries against a run of the head's compacted keys. FA3 (``sgl_kernel``'s
``flash_attn_with_kvcache``, Hopper) runs all of them in one paged varlen call:

| FA3 argument | the vertical pass |
| --- | --- |
| batch entry ``e = h * NB + i`` | query block ``i`` with KV head ``h``'s ``G`` query heads |
| ``q`` rows of ``e`` (``cu_seqlens_q``) | the block's rows of ``q`` folded to ``[Hkv * Nq, G, D]`` |
| ``k_cache``, ``v_cache`` | the compacted keys and values, ``[Hkv * R / PAGE, PAGE, 1, D]`` |
| ``cache_seqlens[e]`` | ``vertical_len[i, h]`` |
| ``page_table[e]`` | the pages of head ``h``'s region of the block's sequence (``plan.compact_start``, a page bound) |
| ``causal``, ``window_size`` | off |

It returns each row's output and log-sum-exp; the band launch of :mod:`.triton_prefill` starts its
online softmax from them and adds the band's keys under the exact mask. :func:`fa3_paged_reference`
is the torch statement of the FA3 call as used here (the CPU checks run it in FA3's place).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import triton
import triton.language as tl

from sglang_wgkv.attention.vertical_slash_plan import VerticalSlashPlan

PAGE = 64  # compacted rows per FA3 page: a table of Nk / 64 columns instead of one per key

FA3Fn = Callable[..., tuple]  # flash_attn_with_kvcache's signature


@cache
def load_sgl_kernel_fa3(device: torch.device | str, name: str):
    """``sgl_kernel.flash_attn.<name>`` where it runs (a Hopper GPU with ``sgl_kernel``'s FA3
    installed), else None."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    try:
        from sgl_kernel import flash_attn
    except ImportError:
        return None
    return getattr(flash_attn, name, None)


def load_fa3(device: torch.device | str) -> FA3Fn | None:
    """``flash_attn_with_kvcache`` (:func:`load_sgl_kernel_fa3`)."""
    return load_sgl_kernel_fa3(device, "flash_attn_with_kvcache")


# The plan's arrays may be views at offsets that follow the block count: their alignment unspecialized,
# so one compiled variant serves every forward (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["num_q", "num_blocks", "rows_per_head", "max_pages"],
    do_not_specialize_on_alignment=[
        "QStart",
        "QEnd",
        "CompactStart",
        "Vertical",
        "CuQ",
        "SeqLens",
        "PageTable",
    ],
)
def _entries_kernel(
    QStart,
    QEnd,
    CompactStart,
    Vertical,
    CuQ,
    SeqLens,
    PageTable,
    num_q,
    num_blocks,
    rows_per_head,
    max_pages,
    num_heads,
    PAGE_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Query block pid(0): its FA3 entries, one per KV head (rows, key count, page-table row)."""
    blk = tl.program_id(0)
    q_start = tl.load(QStart + blk)
    q_end = tl.load(QEnd + blk)
    region = tl.load(CompactStart + blk).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    live = hs < num_heads
    entry = hs * num_blocks + blk
    n_vert = tl.load(Vertical + blk * num_heads + hs, mask=live, other=0)
    # blocks without rows come last (the plan's order): empty entries at the end of each head's rows
    first = tl.where(q_end > q_start, q_start, num_q)
    tl.store(CuQ + entry, hs * num_q + first, mask=live)
    tl.store(SeqLens + entry, n_vert, mask=live)
    if blk == 0:
        tl.store(CuQ + num_heads * num_blocks, num_heads * num_q)
    page0 = (hs.to(tl.int64) * rows_per_head + region) // PAGE_ROWS
    pages = (n_vert + PAGE_ROWS - 1) // PAGE_ROWS
    js = tl.arange(0, BLOCK_P)
    for j0 in range(0, tl.max(pages, 0), BLOCK_P):
        j = j0 + js
        dst = PageTable + entry.to(tl.int64)[:, None] * max_pages + j[None, :]
        keep = live[:, None] & (j[None, :] < pages[:, None])
        tl.store(dst, (page0[:, None] + j[None, :]).to(tl.int32), mask=keep)


def vertical_entries(
    plan: VerticalSlashPlan, num_q: int, rows_per_head: int, max_pages: int, page: int = PAGE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA3's ``(cu_seqlens_q [E + 1], cache_seqlens [E], page_table [E, max_pages])``, int32, for the
    entries ``e = h * NB + i`` of the table above, in one launch. ``rows_per_head``: rows of each head's
    compacted buffer (:func:`~.vertical_slash_plan.compacted_rows`); page-table columns past an entry's
    pages are left unwritten (FA3 reads only ``ceil(cache_seqlens / page)``); ``page``: rows a page,
    :data:`PAGE` as served (another for measuring FA3's paged loads, ``benchmarks/prefill_chunk.py``)."""
    if plan.compact_align % page:
        raise ValueError(
            f"compacted regions aligned to {plan.compact_align} rows do not start at FA3 pages of {page}"
        )
    NB, H = plan.vertical_len.shape
    dev = plan.vertical_len.device
    cu_q = torch.empty(H * NB + 1, dtype=torch.int32, device=dev)
    seqlens = torch.empty(H * NB, dtype=torch.int32, device=dev)
    table = torch.empty(H * NB, max_pages, dtype=torch.int32, device=dev)
    if NB == 0:
        cu_q.fill_(0)
        return cu_q, seqlens, table
    _entries_kernel[(NB,)](
        plan.q_start,
        plan.q_end,
        plan.compact_start,
        plan.vertical_len,
        cu_q,
        seqlens,
        table,
        num_q,
        NB,
        rows_per_head,
        max_pages,
        H,
        PAGE_ROWS=page,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_P=64,
        num_warps=2,
    )
    return cu_q, seqlens, table


def vertical_entries_torch(
    plan: VerticalSlashPlan, num_q: int, rows_per_head: int, max_pages: int, page: int = PAGE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch statement of :func:`vertical_entries` (every page-table column filled: compare the
    first ``ceil(cache_seqlens / page)`` of each row)."""
    NB, H = plan.vertical_len.shape
    dev = plan.vertical_len.device
    heads = torch.arange(H, device=dev)
    first = torch.where(plan.q_end > plan.q_start, plan.q_start.long(), num_q)
    cu_q = torch.cat([(heads[:, None] * num_q + first[None, :]).reshape(-1), first.new_tensor([H * num_q])])
    seqlens = plan.vertical_len.t().reshape(-1)
    page0 = (heads[:, None] * rows_per_head + plan.compact_start.long()[None, :]) // page  # [H, NB]
    table = page0.reshape(-1, 1) + torch.arange(max_pages, device=dev)[None, :]
    return cu_q.int(), seqlens.int(), table.int()


def fold_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Nq, Hkv * G, D]`` to ``[Hkv * Nq, G, D]``: each KV head's query heads, row after row."""
    Nq, Hq, D = q.shape
    return q.view(Nq, num_kv_heads, Hq // num_kv_heads, D).transpose(0, 1).reshape(-1, Hq // num_kv_heads, D)


def fa3_vertical(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    plan: VerticalSlashPlan,
    sm_scale: float,
    fa3: FA3Fn,
    page: int = PAGE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vertical range of every (query block, KV head) in one FA3 call. q ``[Nq, Hq, D]``; kc, vc
    ``[Hkv, R, D]`` compacted in the plan's regions. Returns ``(out [Hkv * Nq, G, D], lse [G, Hkv * Nq])``
    in FA3's layout (natural log, float32); rows of an entry without keys are undefined. ``page``: rows
    a page of ``kc``'s (:func:`vertical_entries`)."""
    Nq, Hq, D = q.shape
    Hkv, R = kc.shape[:2]
    max_pages = max(1, R // page)  # a sequence's region is at most a head's rows
    cu_q, seqlens, table = vertical_entries(plan, Nq, R, max_pages, page)
    out, lse, *_ = fa3(
        q=fold_queries(q, Hkv),
        k_cache=kc.view(-1, page, 1, D),
        v_cache=vc.view(-1, page, 1, vc.shape[2]),
        cache_seqlens=seqlens,
        page_table=table,
        cu_seqlens_q=cu_q,
        max_seqlen_q=plan.block_m,
        softmax_scale=sm_scale,
        causal=False,
        return_softmax_lse=True,
    )
    G = Hq // Hkv
    if out.shape != (Hkv * Nq, G, vc.shape[2]) or lse.shape != (G, Hkv * Nq):
        raise RuntimeError(
            f"FA3 returned out {tuple(out.shape)} and lse {tuple(lse.shape)} for q [{Hkv * Nq}, {G}, {D}]"
        )
    if out.stride(2) != 1 or lse.stride(1) != 1:
        raise RuntimeError(f"FA3's out {out.stride()} and lse {lse.stride()} must have unit inner strides")
    return out, lse


def fa3_paged_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool = False,
    return_softmax_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """``flash_attn_with_kvcache`` as :func:`fa3_vertical` calls it, in torch: entry ``e``'s queries
    ``q[cu_seqlens_q[e] : cu_seqlens_q[e + 1]]`` attend (GQA, no mask) to its ``cache_seqlens[e]`` keys,
    key ``j`` at row ``j % P`` of page ``page_table[e, j // P]``. Returns ``out`` like q and ``lse
    [Hq, T]`` (natural log, float32). Stricter than FA3 where it can be: the last page is read whole
    and its rows past the keys masked, so a NaN value there shows in the output; rows of an entry
    without keys are NaN (FA3's values there are no part of the contract, and a reader fails on them)."""
    if causal:
        raise NotImplementedError("the vertical pass calls FA3 without a mask")
    T, Hq, D = q.shape
    P, Hk = k_cache.shape[1], k_cache.shape[2]
    keys, values = k_cache.reshape(-1, Hk, D), v_cache.reshape(-1, Hk, v_cache.shape[-1])
    out = torch.full((T, Hq, v_cache.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((Hq, T), float("nan"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for e, n in enumerate(cache_seqlens.tolist()):
        r0, r1 = cu[e], cu[e + 1]
        if r1 - r0 > max_seqlen_q:
            raise ValueError(f"entry {e} has {r1 - r0} rows, max_seqlen_q {max_seqlen_q}")
        if r1 == r0 or n == 0:
            continue
        j = torch.arange(-(-n // P) * P, device=q.device)  # whole pages, the rows past n masked
        rows = page_table[e, j // P].long() * P + j % P
        k = keys[rows].float().repeat_interleave(Hq // Hk, 1)
        v = values[rows].float().repeat_interleave(Hq // Hk, 1)
        s = torch.einsum("thd,nhd->htn", q[r0:r1].float(), k) * softmax_scale
        s[..., n:] = float("-inf")
        lse[:, r0:r1] = torch.logsumexp(s, -1)
        out[r0:r1] = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v).to(q.dtype)
    return (out, lse) if return_softmax_lse else out
