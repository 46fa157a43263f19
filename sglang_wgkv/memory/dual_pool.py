"""Dual-cache paged KV pool: per (request, layer, KV head) a W_local ring and a ragged global cache.

All layers and heads share one physical page pool ``k_pages / v_pages [num_pages + 1, 16, D]``
(the last page is the allocator's dump page). A stream is one (request slot r, layer l, KV head h);
its page-table row ``page_table[r, l, h]`` is laid out as::

    | cols 0 .. R-1            | cols R .. R+G-1                        | col R+G     |
    | ring pages               | global pages, in admission order       | dump column |
    | slot s -> col s // 16,   | global token i -> col R + i // 16,     | masked-off  |
    |   offset s % 16          |   offset i % 16                        |   writes    |

with ``R = W_local / 16`` and ``G = ceil((max_context_len - W_local) / 16)``. Token at position p
lives in ring slot ``p % W_local`` while it is among the last W_local tokens. When it leaves the ring
it is appended to the global pages iff its admission flag is set (lazy promotion), else dropped.

The pages a stream holds are always a prefix of its row: ring pages ``[0, ceil(min(n, W)/16))`` and,
once the ring is full, global pages ``[R, R + ceil(g/16))`` right after it (n = cached tokens,
g = global length). So "ring pages first, then global pages" is a contiguous page list whose only
partial page is the last one: the folded-head layout FlashInfer's paged decode reads directly.

Step protocol (host-known lengths come from the scheduler; nothing here syncs in decode):

* extend (prefill, chunked prefill, prefix hit): :meth:`begin_extend` once per forward, then
  :meth:`write_extend` per layer (after that layer's attention read :meth:`gather_context`).
* decode: :meth:`begin_decode` once per step (allocates, promotes the ring victims of every layer),
  then :meth:`write_decode` per layer before attention reads :meth:`decode_page_rows`.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from sglang_wgkv.config import PAGE_SIZE, WGKVConfig
from sglang_wgkv.memory.page_allocator import PageAllocator

FAR_POSITION = -(2**30)  # position given to global entries: beyond every query's local band


class PoolIntegrityError(RuntimeError):
    pass


@dataclass
class _ExtendPlan:
    """Host-built index lists for one extend forward, shared by all layers (device tensors)."""

    req: torch.Tensor          # [B] request slots
    prefix_lens: list          # host copy of S per request
    req_slots: list            # host copy of the request slots
    extend_lens: list          # host copy of n per request
    cand_b: torch.Tensor       # [C] batch index of each token leaving the ring (position order per b)
    cand_from_ring: torch.Tensor  # [C] bool: source is the old ring (else the new tokens)
    cand_slot: torch.Tensor    # [C] ring slot (ring source)
    cand_src: torch.Tensor     # [C] packed token index (new-token source)
    cand_seg_start: torch.Tensor  # [C] index of the first candidate of the same request
    max_new_pages: int         # upper bound of new global pages per stream
    rw_b: torch.Tensor         # [M] batch index of each new token that lands in the ring
    rw_slot: torch.Tensor      # [M] its ring slot
    rw_src: torch.Tensor       # [M] its packed token index


@dataclass
class _DecodePlan:
    req: torch.Tensor          # [B] request slots
    pos: torch.Tensor          # [B] position of the token being decoded
    ring_tokens: torch.Tensor  # [B] tokens in the ring after this step's write
    ring_page: torch.Tensor    # [B, L, H] page of the ring slot the new token takes
    ring_off: torch.Tensor     # [B, 1] offset of that slot in its page


class DualCachePool:
    """Parameters
    ----------
    num_layers, num_kv_heads, head_dim : model attention shape (KV heads of this rank).
    num_pages : physical pages (16 tokens each) shared by every stream.
    max_requests : request slots (SGLang's ``req_pool_idx`` range).
    max_context_len : longest sequence a request may reach.
    triton_decode : :meth:`begin_decode` promotes with the Triton kernels of
        :func:`~sglang_wgkv.memory.triton_pool.decode_promote` (same resulting state as the torch
        ops of :meth:`_promote`, two launches); default: on CUDA devices.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 max_requests: int, max_context_len: int, config: WGKVConfig = WGKVConfig(),
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 triton_decode: bool | None = None):
        self.config = config
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_requests, self.max_context_len = max_requests, max_context_len
        self.window = config.local_window
        self.device = torch.device(device)
        self.dtype = dtype
        self.triton_decode = self.device.type == "cuda" if triton_decode is None else triton_decode
        self.allocator = PageAllocator(num_pages, self.device)
        self.dump_page = self.allocator.dump_page
        self.ring_cols = self.window // PAGE_SIZE
        self.global_cols = max(0, math.ceil((max_context_len - self.window) / PAGE_SIZE))
        self.dump_col = self.ring_cols + self.global_cols
        shape = (num_pages + 1, PAGE_SIZE, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=self.device)
        streams = (max_requests, num_layers, num_kv_heads)
        self.page_table = torch.full((*streams, self.dump_col + 1), self.dump_page, dtype=torch.int32,
                                     device=self.device)
        self.global_len = torch.zeros(streams, dtype=torch.int32, device=self.device)
        self.ring_flag = torch.zeros((*streams, self.window), dtype=torch.bool, device=self.device)
        self.cached_len = np.zeros(max_requests, dtype=np.int64)
        self.active = np.zeros(max_requests, dtype=bool)
        # Bumped at every allocation of a slot: lets per-request side state (the evictor's query
        # window, counters) notice a slot's new owner without a lifecycle callback.
        self.generation = np.zeros(max_requests, dtype=np.int64)
        # Admission counters per (layer, head): tokens that left a ring, and those promoted.
        self.left_ring = torch.zeros(num_layers, num_kv_heads, dtype=torch.int64, device=self.device)
        self.promoted = torch.zeros(num_layers, num_kv_heads, dtype=torch.int64, device=self.device)
        self._heads = torch.arange(num_kv_heads, device=self.device)
        self._layers = torch.arange(num_layers, device=self.device)
        self._ref_holders = []
        self._extend: _ExtendPlan | None = None
        self._decode: _DecodePlan | None = None

    # -- request lifecycle ----------------------------------------------------------------------
    def alloc_request(self, r: int) -> None:
        if not 0 <= r < self.max_requests:
            raise ValueError(f"request slot {r} out of range [0, {self.max_requests})")
        if self.active[r]:
            raise ValueError(f"request slot {r} is already allocated")
        self.active[r] = True
        self.cached_len[r] = 0
        self.generation[r] += 1

    def free_request(self, r: int) -> int:
        """Return every page of slot ``r`` (ring and global); returns the pages released."""
        if not self.active[r]:
            raise ValueError(f"request slot {r} is not allocated")
        released = self.allocator.free(self.page_table[r, :, :, : self.dump_col])
        self.page_table[r] = self.dump_page
        self.global_len[r] = 0
        self.ring_flag[r] = False
        self.active[r] = False
        self.cached_len[r] = 0
        return released

    def register_ref_holder(self, fn) -> None:
        """``fn() -> LongTensor`` of page ids held outside request rows (e.g. a prefix cache)."""
        self._ref_holders.append(fn)

    def num_ref_holder_pages(self) -> int:
        """Distinct pages held outside request rows (what an idle pool may still hold)."""
        held = [fn().reshape(-1).to(self.device) for fn in self._ref_holders]
        if not held:
            return 0
        pages = torch.cat(held).long()
        return int(torch.unique(pages[pages != self.dump_page]).numel())

    # -- extend (prefill) -----------------------------------------------------------------------
    def begin_extend(self, req_slots, prefix_lens, extend_lens) -> _ExtendPlan:
        """Prepare an extend of ``extend_lens[b]`` tokens after ``prefix_lens[b]`` cached ones.

        Allocates the ring pages every layer needs and reserves the worst-case global growth;
        raises PoolExhausted (nothing modified) when the pool cannot cover it.
        """
        req_slots, prefix_lens, extend_lens = list(map(int, req_slots)), list(map(int, prefix_lens)), \
            list(map(int, extend_lens))
        W, LH = self.window, self.num_layers * self.num_kv_heads
        ring_new, worst, max_new_pages = [], 0, 1
        for r, S, n in zip(req_slots, prefix_lens, extend_lens):
            if not self.active[r]:
                raise ValueError(f"request slot {r} is not allocated")
            if self.cached_len[r] != S:
                raise ValueError(f"request slot {r}: prefix {S} != cached length {self.cached_len[r]}")
            if S + n > self.max_context_len:
                raise ValueError(f"request slot {r}: {S + n} tokens exceed max_context_len {self.max_context_len}")
            c0, c1 = -(-min(S, W) // PAGE_SIZE), -(-min(S + n, W) // PAGE_SIZE)
            ring_new.append((c0, c1))
            leaving = max(0, S + n - W) - max(0, S - W)
            if leaving:
                max_new_pages = max(max_new_pages, -(-leaving // PAGE_SIZE) + 1)
                worst += LH * (-(-leaving // PAGE_SIZE) + 1)
        ring_total = LH * sum(c1 - c0 for c0, c1 in ring_new)
        self.allocator.ensure(ring_total + worst)
        if ring_total:
            pages = self.allocator.alloc(ring_total).to(torch.int32)
            off = 0
            for r, (c0, c1) in zip(req_slots, ring_new):
                k = LH * (c1 - c0)
                if k:
                    self.page_table[r, :, :, c0:c1] = pages[off:off + k].view(self.num_layers, self.num_kv_heads, -1)
                    off += k
        cand_b, cand_ring, cand_slot, cand_src, cand_start = [], [], [], [], []
        rw_b, rw_slot, rw_src = [], [], []
        offset = 0
        for b, (S, n) in enumerate(zip(prefix_lens, extend_lens)):
            start = len(cand_b)
            lo = max(S - W, 0)
            old = np.arange(lo, max(lo, min(S, S + n - W)))
            new = np.arange(S, max(S, S + n - W))
            cnt = len(old) + len(new)
            cand_b += [b] * cnt
            cand_ring += [True] * len(old) + [False] * len(new)
            cand_slot += list(old % W) + [0] * len(new)
            cand_src += [0] * len(old) + list(offset + new - S)
            cand_start += [start] * cnt
            t = np.arange(max(0, n - W), n)
            rw_b += [b] * len(t)
            rw_slot += list((S + t) % W)
            rw_src += list(offset + t)
            offset += n
            self.cached_len[req_slots[b]] = S + n
        dev, i64 = self.device, torch.int64
        plan = _ExtendPlan(
            req=torch.tensor(req_slots, dtype=i64, device=dev), prefix_lens=prefix_lens,
            req_slots=req_slots, extend_lens=extend_lens,
            cand_b=torch.tensor(cand_b, dtype=i64, device=dev),
            cand_from_ring=torch.tensor(cand_ring, dtype=torch.bool, device=dev),
            cand_slot=torch.tensor(cand_slot, dtype=i64, device=dev),
            cand_src=torch.tensor(cand_src, dtype=i64, device=dev),
            cand_seg_start=torch.tensor(cand_start, dtype=i64, device=dev),
            max_new_pages=max_new_pages,
            rw_b=torch.tensor(rw_b, dtype=i64, device=dev), rw_slot=torch.tensor(rw_slot, dtype=i64, device=dev),
            rw_src=torch.tensor(rw_src, dtype=i64, device=dev))
        self._extend, self._decode = plan, None
        return plan

    def write_extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, admit: torch.Tensor) -> None:
        """Write one layer's new tokens: promote admitted tokens leaving the ring, fill the ring.

        k, v : ``[N, H, D]`` packed new tokens of the batch given to :meth:`begin_extend`;
        admit : ``[N, H]`` bool admission flags.
        """
        p = self._extend
        if p is None:
            raise RuntimeError("write_extend without begin_extend")
        H = self.num_kv_heads
        heads = self._heads[None, :]
        if p.cand_b.numel():
            rc = p.req[p.cand_b][:, None]                                  # [C, 1]
            slot = p.cand_slot[:, None]
            ring_col = slot // PAGE_SIZE
            flag = torch.where(p.cand_from_ring[:, None], self.ring_flag[rc, layer, heads, slot],
                               admit[p.cand_src])                           # [C, H]
            fi = flag.to(torch.int64)
            # scan along the contiguous axis: a dim-0 scan of [C, H] runs one GPU thread per column
            excl = (torch.cumsum(fi.t().contiguous(), 1) - fi.t()).t()
            rank = excl - excl[p.cand_seg_start]
            B = p.req.numel()
            cnt = torch.zeros(B, H, dtype=torch.int64, device=self.device).index_add_(0, p.cand_b, fi)
            glen = self.global_len[p.req, layer].to(torch.int64)             # [B, H]
            self._append_pages(p.req, layer, glen, cnt, p.max_new_pages)
            dest = glen[p.cand_b] + rank
            dest_page = torch.where(flag, self.page_table[rc, layer, heads, self.ring_cols + dest // PAGE_SIZE].long(),
                                    self.dump_page)
            src_page = self.page_table[rc, layer, heads, ring_col].long()
            from_ring = p.cand_from_ring[:, None, None]
            for pages, new in ((self.k_pages, k), (self.v_pages, v)):
                src = torch.where(from_ring, pages[src_page, slot % PAGE_SIZE], new[p.cand_src].to(pages.dtype))
                pages[dest_page, dest % PAGE_SIZE] = src
            self.global_len[p.req, layer] += cnt.to(torch.int32)
            self.left_ring[layer] += p.cand_b.numel()
            self.promoted[layer] += cnt.sum(0)
        if p.rw_b.numel():
            rr = p.req[p.rw_b][:, None]
            slot = p.rw_slot[:, None]
            page = self.page_table[rr, layer, heads, slot // PAGE_SIZE].long()
            self.k_pages[page, slot % PAGE_SIZE] = k[p.rw_src].to(self.dtype)
            self.v_pages[page, slot % PAGE_SIZE] = v[p.rw_src].to(self.dtype)
            self.ring_flag[rr, layer, heads, slot] = admit[p.rw_src]

    def _append_pages(self, req, layer, glen, cnt, max_new_pages: int) -> None:
        """Allocate the pages that growing each stream's global length by ``cnt`` needs.

        req ``[B]``; layer an int (glen/cnt ``[B, H]``) or None for all layers (``[B, L, H]``).
        """
        old = (glen + PAGE_SIZE - 1) // PAGE_SIZE
        new = (glen + cnt + PAGE_SIZE - 1) // PAGE_SIZE - old
        j = torch.arange(max_new_pages, device=self.device)
        need = j < new[..., None]
        pages = self.allocator.alloc_where(need).to(torch.int32)
        col = torch.where(need, self.ring_cols + old[..., None] + j, self.dump_col)
        if layer is None:
            idx = (req[:, None, None, None], self._layers[None, :, None, None], self._heads[None, None, :, None], col)
        else:
            idx = (req[:, None, None], layer, self._heads[None, :, None], col)
        self.page_table[idx] = torch.where(need, pages, self.dump_page)

    def gather_context(self, layer: int, r: int, prefix_len: int):
        """The cached context of slot ``r`` in ``layer`` before an extend after ``prefix_len`` tokens.

        Returns ``k, v [Nk, H, D]``, ``k_pos [Nk]`` and ``admitted [Nk, H]``, ready for
        :func:`~sglang_wgkv.attention.reference.vertical_slash_attention`: global entries (padded to
        the longest head; padding not admitted) at ``FAR_POSITION``, then ring entries in position
        order with their flags. Syncs (CPU path).
        """
        W, H = self.window, self.num_kv_heads
        glen = self.global_len[r, layer].long()
        gcols = -(-int(glen.max()) // PAGE_SIZE) if H else 0
        pages = self.page_table[r, layer, :, self.ring_cols:self.ring_cols + gcols].long()    # [H, gc]
        gk = self.k_pages[pages].reshape(H, gcols * PAGE_SIZE, self.head_dim).transpose(0, 1)
        gv = self.v_pages[pages].reshape(H, gcols * PAGE_SIZE, self.head_dim).transpose(0, 1)
        g_adm = (torch.arange(gcols * PAGE_SIZE, device=self.device)[:, None] < glen[None, :])
        pos = torch.arange(max(0, prefix_len - W), prefix_len, device=self.device)
        slot = pos % W
        rpage = self.page_table[r, layer, :, (slot // PAGE_SIZE)].long().t()                  # [n, H]
        rk = self.k_pages[rpage, (slot % PAGE_SIZE)[:, None]]
        rv = self.v_pages[rpage, (slot % PAGE_SIZE)[:, None]]
        r_adm = self.ring_flag[r, layer][:, slot].t()
        k_pos = torch.cat([torch.full((gcols * PAGE_SIZE,), FAR_POSITION, device=self.device), pos])
        return torch.cat([gk, rk]), torch.cat([gv, rv]), k_pos, torch.cat([g_adm, r_adm])

    # -- decode ---------------------------------------------------------------------------------
    def decode_worst_case(self, seq_lens) -> int:
        """Pages :meth:`begin_decode` reserves for requests at cached lengths ``seq_lens``: one per
        stream of a request whose ring crosses a page boundary, one per stream of a promoting one."""
        seq_lens, W = np.asarray(seq_lens, dtype=np.int64), self.window
        steps = ((seq_lens < W) & (seq_lens % PAGE_SIZE == 0)) | (seq_lens >= W)
        return self.num_layers * self.num_kv_heads * int(steps.sum())

    def extend_bound(self, prefix_len: int, extend_len: int) -> int:
        """Upper bound on the pages that extending a request from ``prefix_len`` cached tokens by
        ``extend_len`` needs, in one or any number of chunks: what the chunks allocate plus the
        reserve :meth:`begin_extend` checks for the last one. Per stream: the new ring pages,
        ``ceil(leaving / 16)`` global pages for the tokens leaving the ring, and two pages for the
        partial pages (rounding of chunk reserves and of the last global page)."""
        W, S, n = self.window, prefix_len, extend_len
        ring = -(-min(S + n, W) // PAGE_SIZE) - -(-min(S, W) // PAGE_SIZE)
        leaving = max(0, S + n - W) - max(0, S - W)
        return self.num_layers * self.num_kv_heads * (ring + -(-leaving // PAGE_SIZE) + 2)

    def begin_decode(self, req_slots, seq_lens, req_slots_dev: torch.Tensor | None = None,
                     seq_lens_dev: torch.Tensor | None = None) -> _DecodePlan:
        """Prepare a decode step: token ``b`` is written at position ``seq_lens[b]`` (= cached length).

        Allocates ring pages crossing a page boundary (host-known), reserves one page per stream for
        promotion, and promotes the ring victim of every (request, layer, head) at once.
        ``*_dev`` are optional device copies of the host lists (avoid a host-to-device copy).

        No host sync unless :meth:`PageAllocator.ensure` needs one (its free-page floor ran out).
        With ``triton_decode``: promotion and the plan's ring page / offset / length come from two
        Triton launches (plus three small ``torch.empty``), the only other device work being the
        ring-page allocation of a request whose ring crosses a page boundary (``seq_len < W``).
        """
        req_slots, seq_lens = np.asarray(req_slots, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
        W, LH = self.window, self.num_layers * self.num_kv_heads
        if not self.active[req_slots].all():
            raise ValueError(f"request slots {req_slots[~self.active[req_slots]].tolist()} are not allocated")
        if not np.array_equal(self.cached_len[req_slots], seq_lens):
            raise ValueError(f"seq_lens {seq_lens.tolist()} != cached lengths {self.cached_len[req_slots].tolist()}")
        if (seq_lens >= self.max_context_len).any():
            raise ValueError(f"decode beyond max_context_len {self.max_context_len}")
        new_ring = (seq_lens < W) & (seq_lens % PAGE_SIZE == 0)
        promoting = int((seq_lens >= W).sum())
        ring_total = LH * int(new_ring.sum())
        self.allocator.ensure(self.decode_worst_case(seq_lens))
        if ring_total:
            pages = self.allocator.alloc(ring_total).to(torch.int32).view(-1, self.num_layers, self.num_kv_heads)
            rows = torch.as_tensor(req_slots[new_ring], device=self.device)
            cols = torch.as_tensor(seq_lens[new_ring] // PAGE_SIZE, device=self.device)
            self.page_table[rows[:, None, None], self._layers[None, :, None], self._heads[None, None, :],
                            cols[:, None, None]] = pages
        req = req_slots_dev.long() if req_slots_dev is not None else torch.as_tensor(req_slots, device=self.device)
        pos = seq_lens_dev.long() if seq_lens_dev is not None else torch.as_tensor(seq_lens, device=self.device)
        self.cached_len[req_slots] = seq_lens + 1
        if self.triton_decode:
            from sglang_wgkv.memory.triton_pool import decode_promote

            B, i64 = len(req_slots), torch.int64
            req, pos = req.contiguous(), pos.contiguous()
            plan = (torch.empty(B, self.num_layers, self.num_kv_heads, dtype=i64, device=self.device),
                    torch.empty(B, 1, dtype=i64, device=self.device), torch.empty(B, dtype=i64, device=self.device))
            decode_promote(self, req, pos, plan_out=plan, lower_floor=promoting > 0)
            self._decode = _DecodePlan(req=req, pos=pos, ring_tokens=plan[2], ring_page=plan[0], ring_off=plan[1])
        else:
            if promoting:
                self._promote(req, pos)
            slot = pos % W
            ring_page = self.page_table[req[:, None, None], self._layers[None, :, None], self._heads[None, None, :],
                                        (slot // PAGE_SIZE)[:, None, None]].long()
            self._decode = _DecodePlan(req=req, pos=pos, ring_tokens=torch.clamp(pos + 1, max=W),
                                       ring_page=ring_page, ring_off=(slot % PAGE_SIZE)[:, None])
        self._extend = None
        return self._decode

    def _promote(self, req: torch.Tensor, pos: torch.Tensor) -> None:
        """Lazy promotion for all layers and heads: the ring slot ``pos % W`` is about to be reused."""
        W = self.window
        r4 = req[:, None, None]
        L, H = self._layers[None, :, None], self._heads[None, None, :]
        slot = (pos % W)[:, None, None]
        flag = self.ring_flag[r4, L, H, slot] & (pos >= W)[:, None, None]            # [B, L, H]
        glen = self.global_len[req].long()
        self._append_pages(req, None, glen, flag.to(torch.int64), 1)
        dest_col = torch.where(flag, self.ring_cols + glen // PAGE_SIZE, self.dump_col)
        dest_page = self.page_table[r4, L, H, dest_col].long()
        src_page = self.page_table[r4, L, H, slot // PAGE_SIZE].long()
        for pages in (self.k_pages, self.v_pages):
            pages[dest_page, glen % PAGE_SIZE] = pages[src_page, slot % PAGE_SIZE]
        self.global_len[req] += flag.to(torch.int32)
        self.left_ring += (pos >= W).sum()
        self.promoted += flag.sum(0)

    def write_decode(self, layer: int, k: torch.Tensor, v: torch.Tensor, admit: torch.Tensor) -> None:
        """k, v ``[B, H, D]``, admit ``[B, H]``: the new token of each request into its ring slot."""
        p = self._decode
        if p is None:
            raise RuntimeError("write_decode without begin_decode")
        page = p.ring_page[:, layer]
        self.k_pages[page, p.ring_off] = k.to(self.dtype)
        self.v_pages[page, p.ring_off] = v.to(self.dtype)
        self.ring_flag[p.req[:, None], layer, self._heads[None, :], (p.pos % self.window)[:, None]] = admit

    def decode_page_rows(self, layer: int):
        """Page lists of the current decode batch in ``layer`` (after :meth:`write_decode`).

        Returns ``rows [B, H, C]`` (page-table rows; the first ``num_pages`` entries are the
        stream's pages, ring first), ``num_pages [B, H]``, ``last_page_len [B, H]`` (1..16) and
        ``kv_len [B, H]`` (tokens). No host sync.
        """
        p = self._decode
        glen = self.global_len[p.req, layer].long()                        # [B, H]
        ring = p.ring_tokens[:, None]
        ring_pages = (ring + PAGE_SIZE - 1) // PAGE_SIZE
        gpages = (glen + PAGE_SIZE - 1) // PAGE_SIZE
        num_pages = ring_pages + gpages
        last = torch.where(gpages > 0, glen - (gpages - 1) * PAGE_SIZE, ring - (ring_pages - 1) * PAGE_SIZE)
        rows = self.page_table[p.req, layer, :, : self.dump_col]
        return rows, num_pages, last, ring + glen

    # -- queries --------------------------------------------------------------------------------
    def global_lengths(self, r: int) -> torch.Tensor:
        """``[L, H]`` global tokens of slot ``r``."""
        return self.global_len[r].clone()

    def request_cache_sizes(self, r: int) -> dict:
        """Per-request cache sizes of slot ``r`` (syncs): global tokens per (layer, KV head), mean and
        max, and ``mean_kv_tokens_per_head`` = ring + global tokens averaged over layers and heads."""
        glen = self.global_len[r].double()
        ring = min(int(self.cached_len[r]), self.window)
        return {"mean_global_tokens_per_head": float(glen.mean()), "max_global_tokens_per_head": int(glen.max()),
                "mean_kv_tokens_per_head": float(glen.mean()) + ring}

    def num_free_pages(self) -> int:
        return self.allocator.sync_free()

    @property
    def page_bytes(self) -> int:
        return 2 * PAGE_SIZE * self.head_dim * self.k_pages.element_size()

    def stats(self) -> dict:
        """Occupancy and admission summary (syncs)."""
        act = torch.as_tensor(np.nonzero(self.active)[0], device=self.device)
        glen = self.global_len[act].long()
        ring = torch.as_tensor(np.minimum(self.cached_len[self.active], self.window), device=self.device)
        left = self.left_ring.sum().item()
        free = self.num_free_pages()
        used = self.allocator.num_pages - free
        return {
            "active_requests": int(act.numel()),
            "free_pages": free, "used_pages": used, "total_pages": self.allocator.num_pages,
            "used_bytes": used * self.page_bytes,
            "global_tokens_per_layer_head": glen.sum(0).tolist() if act.numel() else [],
            "global_tokens": int(glen.sum()),
            "ring_tokens": int(ring.sum()) * self.num_layers * self.num_kv_heads,
            "tokens_left_ring": int(left),
            "tokens_promoted": int(self.promoted.sum().item()),
            "admitted_fraction": (self.promoted.sum().item() / left) if left else None,
            "admitted_fraction_per_layer_head": (self.promoted.double() / self.left_ring.clamp(min=1)).tolist(),
        }

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError on a leaked, doubly owned or misplaced page, or a bad length."""
        W, R = self.window, self.ring_cols
        held = [self.page_table[..., : self.dump_col].reshape(-1)]
        held += [fn().reshape(-1).to(self.device) for fn in self._ref_holders]
        try:
            self.allocator.check_integrity(torch.cat(held))
        except RuntimeError as e:
            raise PoolIntegrityError(str(e)) from e
        if bool((self.page_table[..., self.dump_col] != self.dump_page).any()):
            raise PoolIntegrityError("a dump column holds a real page")
        n = torch.as_tensor(self.cached_len, device=self.device)
        ring_pages = (torch.clamp(n, max=W) + PAGE_SIZE - 1) // PAGE_SIZE                # [Rq]
        gpages = (self.global_len.long() + PAGE_SIZE - 1) // PAGE_SIZE                     # [Rq, L, H]
        col = torch.arange(self.dump_col, device=self.device)
        expect = (col < ring_pages[:, None, None, None]) | (
            (col >= R) & (col < R + gpages[..., None]))
        has = self.page_table[..., : self.dump_col] != self.dump_page
        if not torch.equal(expect, has):
            bad = torch.nonzero(expect != has)[0].tolist()
            raise PoolIntegrityError(f"page table row (slot, layer, head, col) {bad} disagrees with lengths")
        if bool((self.global_len.long() > torch.clamp(n - W, min=0)[:, None, None]).any()):
            raise PoolIntegrityError("a global cache is longer than the tokens that left its ring")
        inactive = torch.as_tensor(~self.active, device=self.device)
        if bool((self.global_len[inactive] != 0).any()):
            raise PoolIntegrityError("a free request slot has a global length")
