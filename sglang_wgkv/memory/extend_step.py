"""The extend step of :class:`~sglang_wgkv.memory.dual_pool.DualCachePool` (prefill, chunked prefill,
prefix continuation): one host-built plan per forward, then one write per layer.

A part of the pool (a base class of ``DualCachePool``): it reads and writes only the pool's own state,
declared in :mod:`~sglang_wgkv.memory.dual_pool`, whose docstring draws the page-table layout.
"""

import functools

import numpy as np
import torch

from sglang_wgkv.config import FAR_POSITION, PAGE_SIZE
from sglang_wgkv.memory.context_index import build_context_index, context_counts, ragged_arange
from sglang_wgkv.memory.extend_plan import ExtendPlan
from sglang_wgkv.memory.host_copy import to_device, to_device_many
from sglang_wgkv.memory.kv_quant import byte_view, gather, quantize


def context_rows(prefix_len: int, gcols: int, window: int) -> tuple[int, int]:
    """(global rows, ring rows) of a request's cached context as :meth:`ExtendStep.gather_context` returns
    it: ``gcols`` pages of global entries (padded to the longest head) and the ring's ``min(prefix, W)``
    tokens; none without a prefix."""
    return (gcols * PAGE_SIZE, min(prefix_len, window)) if prefix_len else (0, 0)


class ExtendStep:
    """``begin_extend`` once per forward, then ``write_extend`` per layer (after that layer's attention
    read ``gather_context``); ``extend_bound`` is the scheduler's worst case for admitting a prompt."""

    # -- extend (prefill) -----------------------------------------------------------------------
    def begin_extend(self, req_slots, prefix_lens, extend_lens) -> ExtendPlan:
        """Prepare an extend of ``extend_lens[b]`` tokens after ``prefix_lens[b]`` cached ones.

        Allocates the ring pages every layer needs and reserves the worst-case global growth;
        raises PoolExhausted (nothing modified) when the pool cannot cover it.
        """
        req_slots, prefix_lens, extend_lens = (
            list(map(int, req_slots)),
            list(map(int, prefix_lens)),
            list(map(int, extend_lens)),
        )
        W, LH = self.window, self.num_layers * self.num_kv_heads
        ring_new, worst, max_new_pages = [], 0, 1
        for r, S, n in zip(req_slots, prefix_lens, extend_lens):
            if not self.active[r]:
                raise ValueError(f"request slot {r} is not allocated")
            if self.cached_len[r] != S:
                raise ValueError(f"request slot {r}: prefix {S} != cached length {self.cached_len[r]}")
            if S + n > self.max_context_len:
                raise ValueError(
                    f"request slot {r}: {S + n} tokens exceed max_context_len {self.max_context_len}"
                )
            c0, c1 = -(-min(S, W) // PAGE_SIZE), -(-min(S + n, W) // PAGE_SIZE)
            ring_new.append((c0, c1))
            leaving = max(0, S + n - W) - max(0, S - W)
            if leaving:
                max_new_pages = max(max_new_pages, -(-leaving // PAGE_SIZE) + 1)
                worst += LH * (-(-leaving // PAGE_SIZE) + 1)
        ring_total = LH * sum(c1 - c0 for c0, c1 in ring_new)
        self.allocator.ensure(ring_total + worst)
        ring_idx = []
        if ring_total:
            # request b's pages, laid out [L, H, its new columns], go to (slot, column) pairs: one write
            ncols = np.array([c1 - c0 for c0, c1 in ring_new], dtype=np.int64)
            pair_b = np.repeat(np.arange(len(ring_new)), ncols)
            j = ragged_arange(ncols)  # column within b
            start = np.repeat(LH * (np.cumsum(ncols) - ncols), ncols)  # b's first page
            lh = np.arange(LH)
            src = start[:, None] + lh[None, :] * ncols[pair_b][:, None] + j[:, None]  # [P, LH]
            slot_col = np.stack(
                [np.asarray(req_slots)[pair_b], np.asarray([c0 for c0, _ in ring_new])[pair_b] + j]
            )
            ring_idx = [slot_col.reshape(-1), src.reshape(-1)]
        cand_b, cand_ring, cand_slot, cand_src, cand_bounds = [], [], [], [], [0]
        rw_b, rw_slot, rw_src = [], [], []
        offset = 0
        for b, (S, n) in enumerate(zip(prefix_lens, extend_lens)):
            lo = max(S - W, 0)
            old = np.arange(lo, max(lo, min(S, S + n - W)))
            new = np.arange(S, max(S, S + n - W))
            cnt = len(old) + len(new)
            cand_b.append(np.full(cnt, b))
            cand_ring.append(np.arange(cnt) < len(old))
            cand_slot.append(np.concatenate([old % W, np.zeros(len(new), np.int64)]))
            cand_src.append(np.concatenate([np.zeros(len(old), np.int64), offset + new - S]))
            cand_bounds.append(cand_bounds[-1] + cnt)
            t = np.arange(max(0, n - W), n)
            rw_b.append(np.full(len(t), b))
            rw_slot.append((S + t) % W)
            rw_src.append(offset + t)
            offset += n
            self.cached_len[req_slots[b]] = S + n
        i64 = np.int64
        idx, req, c_b, c_ring, c_slot, c_src, c_bounds, r_b, r_slot, r_src = to_device_many(
            self.device,
            [
                (ring_idx, i64),
                (np.asarray(req_slots), i64),
                (cand_b, i64),
                (cand_ring, np.bool_),
                (cand_slot, i64),
                (cand_src, i64),
                (np.asarray(cand_bounds), i64),
                (rw_b, i64),
                (rw_slot, i64),
                (rw_src, i64),
            ],
        )
        if ring_total:
            pages = self.allocator.alloc(ring_total).to(torch.int32)
            P = idx.numel() // (2 + LH)
            self.page_table[idx[:P], :, :, idx[P : 2 * P]] = pages[idx[2 * P :]].view(
                P, self.num_layers, self.num_kv_heads
            )
        plan = ExtendPlan(
            req=req,
            prefix_lens=prefix_lens,
            req_slots=req_slots,
            extend_lens=extend_lens,
            cand_b=c_b,
            cand_from_ring=c_ring,
            cand_slot=c_slot,
            cand_src=c_src,
            cand_bounds=c_bounds,
            max_new_pages=max_new_pages,
            rw_b=r_b,
            rw_slot=r_slot,
            rw_src=r_src,
            read_gcols=functools.partial(self._context_gcols, req_slots, prefix_lens),
        )
        self._extend, self._decode = plan, None
        return plan

    def _context_gcols(self, req_slots, prefix_lens) -> list:
        """``[B][L]`` global page columns of each request's cached context per layer (the longest KV
        head's): what :meth:`gather_context` reads. One host sync per forward, and only when a request
        has global entries (prefix longer than the ring): this forward's layers then gather without one."""
        L = self.num_layers
        ctx = [b for b, S in enumerate(prefix_lens) if S > self.window]
        cols = [[0] * L for _ in prefix_lens]
        if ctx:
            self.context_reads_synced += 1
            glen = self.global_len[to_device(self.device, np.asarray([req_slots[b] for b in ctx]))].amax(-1)
            for b, row in zip(ctx, (-(-glen // PAGE_SIZE)).tolist()):
                cols[b] = row
        return cols

    def write_extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, admit: torch.Tensor) -> None:
        """Write one layer's new tokens: promote admitted tokens leaving the ring, fill the ring.

        k, v : ``[N, H, D]`` packed new tokens of the batch given to :meth:`begin_extend`;
        admit : ``[N, H]`` bool admission flags.
        """
        self.write_extend_layers(layer, k[None], v[None], admit[None])

    def write_extend_layers(self, first: int, k: torch.Tensor, v: torch.Tensor, admit: torch.Tensor) -> None:
        """:meth:`write_extend` of the ``G`` consecutive layers ``first .. first + G - 1`` at once (the
        same ops as one layer over a layer axis: a forward's host cost stops growing with its layers).

        k, v : ``[G, N, H, D]``; admit : ``[G, N, H]`` bool. Every layer's attention must have read its
        context (:meth:`extend_inputs`) before its write: the ring slots written here are its context.
        """
        p = self._extend
        if p is None:
            raise RuntimeError("write_extend without begin_extend")
        G = k.shape[0]
        if not p.exact_global:  # a later read of the context sizes must not see this forward's writes
            p.context_gcols  # noqa: B018
        last = first + G
        L3, H3 = self._layers[first:last][None, :, None], self._heads[None, None, :]
        scale_shape = (1, G, 1, 1)
        if p.cand_b.numel():
            C = p.cand_b.numel()
            rc = p.req[p.cand_b][:, None, None]  # [C, 1, 1]
            slot = p.cand_slot[:, None, None]
            flag = torch.where(
                p.cand_from_ring[:, None, None],
                self.ring_flag[rc, L3, H3, slot],
                admit[:, p.cand_src].transpose(0, 1),
            )  # [C, G, H]
            fi = flag.to(torch.int64)
            # scan along the contiguous axis: a dim-0 scan of [C, G * H] runs one GPU thread per column
            ft = fi.reshape(C, -1).t().contiguous()
            excl = (torch.cumsum(ft, 1) - ft).t().reshape(C, G, -1)
            # the scan at each request's candidate bounds: its admitted count (an index_add over the
            # candidates piles every atomic onto the batch's few rows: ~40 us a group at 8K rows), and
            # each candidate's rank within its request
            before = torch.cat([excl, (excl[-1] + fi[-1])[None]])  # [C + 1, G, H]
            seg_start = before[p.cand_bounds[:-1]]  # [B, G, H]
            cnt = before[p.cand_bounds[1:]] - seg_start
            rank = excl - seg_start[p.cand_b]
            glen = self.global_len[p.req, first:last].to(torch.int64)  # [B, G, H]
            self._append_pages(p.req, slice(first, last), glen, cnt, p.max_new_pages)
            dest = glen[p.cand_b] + rank
            dest_page = torch.where(
                flag, self.page_table[rc, L3, H3, self.ring_cols + dest // PAGE_SIZE].long(), self.dump_page
            )
            src_page = self.page_table[rc, L3, H3, slot // PAGE_SIZE].long()
            if self.triton_extend:  # one launch a layer (the ring is read here, before the ring write below)
                from sglang_wgkv.memory.triton_extend import extend_move

                for g in range(G):
                    extend_move(
                        self,
                        first + g,
                        k[g],
                        v[g],
                        flag[:, g],
                        dest_page[:, g],
                        dest[:, g],
                        p.cand_from_ring,
                        src_page[:, g],
                        p.cand_slot,
                        p.cand_src,
                    )
            else:
                from_ring = p.cand_from_ring[:, None, None, None]
                for pages, new, scale in ((self.k_pages, k, self.k_scale), (self.v_pages, v, self.v_scale)):
                    # a ring source keeps its bytes; a new token is quantized here, its only write
                    fresh = quantize(
                        new[:, p.cand_src].transpose(0, 1), scale[first:last].view(scale_shape), self.dtype
                    )
                    pages = byte_view(pages)
                    src = torch.where(from_ring, pages[src_page, slot % PAGE_SIZE], byte_view(fresh))
                    pages[dest_page, dest % PAGE_SIZE] = src
            self.global_len[p.req, first:last] += cnt.to(torch.int32)
            self.left_ring[first:last] += C
            self.promoted[first:last] += cnt.sum(0)
        if self.triton_extend:  # one launch a layer (none without ring rows)
            from sglang_wgkv.memory.triton_extend import extend_ring_write

            for g in range(G):
                extend_ring_write(self, first + g, k[g], v[g], admit[g], p.req, p.rw_b, p.rw_slot, p.rw_src)
        elif p.rw_b.numel():
            rr = p.req[p.rw_b][:, None, None]  # [M, 1, 1]
            slot = p.rw_slot[:, None, None]
            page = self.page_table[rr, L3, H3, slot // PAGE_SIZE].long()  # [M, G, H]
            off = slot % PAGE_SIZE
            for pages, new, scale in ((self.k_pages, k, self.k_scale), (self.v_pages, v, self.v_scale)):
                fresh = quantize(
                    new[:, p.rw_src].transpose(0, 1), scale[first:last].view(scale_shape), self.dtype
                )
                byte_view(pages)[page, off] = byte_view(fresh)
            self.ring_flag[rr, L3, H3, slot] = admit[:, p.rw_src].transpose(0, 1)

    def extend_inputs(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        admit: torch.Tensor,
        positions: torch.Tensor,
        dtype: torch.dtype,
    ):
        """One layer's attention inputs for the current extend: per request of the plan, its cached
        context (what :meth:`gather_context` reads with ``context_gcols``) then its new rows, over the
        batch. k, v ``[N, H, D]``, admit ``[N, H]``, positions ``[N]``: the chunk's packed rows. Returns
        keys, values ``[Nk, H, D]`` in ``dtype``, k_pos ``[Nk]`` in positions' dtype and admitted
        ``[Nk, H]`` bool, with no host sync. On a ``triton_extend`` pool one Triton launch a layer
        (:func:`~sglang_wgkv.memory.triton_extend.extend_context`, the plan's segment rows copied once a
        forward); otherwise the plan's
        :class:`~sglang_wgkv.memory.context_index.ContextIndex`: eight launches a layer whatever the batch
        (none without cached context: the new rows themselves). The same tensors either way, and as
        :meth:`extend_inputs_reference`."""
        p = self._extend
        if p is None:
            raise RuntimeError("extend_inputs without begin_extend")
        H, D = self.num_kv_heads, self.head_dim
        if not any(p.prefix_lens):  # no cached context in this forward: the keys are the new rows
            return k.to(dtype), v.to(dtype), positions, admit
        if self.triton_extend:
            from sglang_wgkv.memory.triton_extend import extend_context

            if p.segments is None:  # once a forward: every layer's rows, one copy to the device
                p.segments, p.segment_rows = self._context_segments(p)
            longest, total = p.segment_rows[layer]
            keys = torch.empty(total, H, D, dtype=dtype, device=self.device)
            values = torch.empty(total, H, v.shape[2], dtype=dtype, device=self.device)
            k_pos = torch.empty(total, dtype=positions.dtype, device=self.device)
            admitted = torch.empty(total, H, dtype=torch.bool, device=self.device)
            extend_context(
                self, layer, p.segments[layer], longest, k, v, admit, positions, keys, values, k_pos, admitted
            )
            return keys, values, k_pos, admitted
        if not p.context_built:  # once a forward; a layer's context is unchanged until its own write
            p.context, p.context_built = build_context_index(self, p), True
        ci = p.context
        if ci is None:  # no cached context in this forward: the keys are the new rows
            return k.to(dtype), v.to(dtype), positions, admit
        (a, b), (ka, kb) = ci.bounds[layer], ci.key_bounds[layer]
        dst, new_dst = ci.dst[a:b], ci.new_dst[layer]
        keys = torch.empty(kb - ka, H, D, dtype=dtype, device=self.device)
        keys[dst] = self.read_keys(gather(self.k_pages.view(-1, D), ci.flat[a:b]), layer, dtype)
        keys[new_dst] = k.to(dtype)
        values = torch.empty(kb - ka, H, v.shape[2], dtype=dtype, device=self.device)
        values[dst] = self.read_values(gather(self.v_pages.view(-1, D), ci.flat[a:b]), layer, dtype)
        values[new_dst] = v.to(dtype)
        admitted = torch.empty(kb - ka, H, dtype=torch.bool, device=self.device)
        admitted[dst] = ci.admitted[a:b]
        admitted[new_dst] = admit
        return keys, values, ci.k_pos[ka:kb].to(positions.dtype), admitted

    def _context_segments(self, p: ExtendPlan) -> tuple[torch.Tensor, list]:
        """``[L, B, 7]`` int64 segment rows of :func:`~sglang_wgkv.memory.triton_extend.extend_context`
        (slot, prefix, global rows, ring rows, new rows, first chunk row, first output row) on the
        device, and per layer (the most rows of a request, the rows in all)."""
        L, B = self.num_layers, len(p.req_slots)
        seg = np.zeros((L, B, 7), dtype=np.int64)
        n = np.asarray(p.extend_lens, dtype=np.int64)
        seg[:, :, 0] = p.req_slots
        seg[:, :, 1] = p.prefix_lens
        seg[:, :, 2], seg[:, :, 3] = context_counts(p, L, self.window)
        seg[:, :, 4] = n
        seg[:, :, 5] = np.cumsum(n) - n
        rows = seg[:, :, 2] + seg[:, :, 3] + n  # [L, B]
        seg[:, :, 6] = np.cumsum(rows, 1) - rows
        sizes = list(zip(rows.max(1, initial=0).tolist(), rows.sum(1).tolist()))
        return to_device(self.device, seg.reshape(-1)).view(L, B, 7), sizes

    def extend_inputs_reference(self, layer: int, k, v, admit, positions, dtype):
        """:meth:`extend_inputs` request by request, through :meth:`gather_context` (reading the page
        columns from the pool): the statement its batched gathers are checked against."""
        p = self._extend
        keys, values, k_pos, admitted = [], [], [], []
        start = 0
        for r, S, n in zip(p.req_slots, p.prefix_lens, p.extend_lens):
            if S:  # cached context first: global entries (admitted) and the ring
                ck, cv, cpos, cadm = self.gather_context(layer, r, S, dtype=dtype)
                keys.append(ck), values.append(cv), k_pos.append(cpos), admitted.append(cadm)
            keys.append(k[start : start + n]), values.append(v[start : start + n])
            k_pos.append(positions[start : start + n]), admitted.append(admit[start : start + n])
            start += n
        return (
            torch.cat(keys).to(dtype),
            torch.cat(values).to(dtype),
            torch.cat(k_pos).to(positions.dtype),
            torch.cat(admitted),
        )

    def gather_context(
        self, layer: int, r: int, prefix_len: int, gcols: int | None = None, dtype: torch.dtype | None = None
    ):
        """The cached context of slot ``r`` in ``layer`` before an extend after ``prefix_len`` tokens.

        Returns ``k, v [Nk, H, D]`` (read back in ``dtype``, default the pool's ``compute_dtype``:
        dequantized from an FP8 pool), ``k_pos [Nk]`` and ``admitted [Nk, H]``, ready for
        :func:`~sglang_wgkv.attention.reference.vertical_slash_attention`: global entries (padded to
        the longest head; padding not admitted) at ``FAR_POSITION``, then ring entries in position
        order with their flags. ``gcols``: the global page columns to read, ``ExtendPlan.context_gcols``
        (no host sync); when None it is read from the pool (syncs).
        """
        W, H = self.window, self.num_kv_heads
        glen = self.global_len[r, layer].long()
        if gcols is None:
            gcols = -(-int(glen.max()) // PAGE_SIZE) if H else 0
        pages = self.page_table[r, layer, :, self.ring_cols : self.ring_cols + gcols].long()  # [H, gc]
        gk = gather(self.k_pages, pages).reshape(H, gcols * PAGE_SIZE, self.head_dim).transpose(0, 1)
        gv = gather(self.v_pages, pages).reshape(H, gcols * PAGE_SIZE, self.head_dim).transpose(0, 1)
        g_adm = torch.arange(gcols * PAGE_SIZE, device=self.device)[:, None] < glen[None, :]
        pos = torch.arange(max(0, prefix_len - W), prefix_len, device=self.device)
        slot = pos % W
        rpage = self.page_table[r, layer, :, (slot // PAGE_SIZE)].long().t()  # [n, H]
        rk = gather(self.k_pages, rpage, (slot % PAGE_SIZE)[:, None])
        rv = gather(self.v_pages, rpage, (slot % PAGE_SIZE)[:, None])
        r_adm = self.ring_flag[r, layer][:, slot].t()
        k_pos = torch.cat([torch.full((gcols * PAGE_SIZE,), FAR_POSITION, device=self.device), pos])
        return (
            self.read_keys(torch.cat([gk, rk]), layer, dtype),
            self.read_values(torch.cat([gv, rv]), layer, dtype),
            k_pos,
            torch.cat([g_adm, r_adm]),
        )

    def ring_pages(self, length: int) -> int:
        """Pages of one stream's ring holding a request of ``length`` tokens."""
        return -(-min(length, self.window) // PAGE_SIZE)

    def restore_bound(self, prefix_len: int) -> int:
        """Pages :meth:`restore_snapshot` allocates for a snapshot of ``prefix_len`` tokens: the copied
        ring and, per stream, the copied partial last global page."""
        return self.num_layers * self.num_kv_heads * (self.ring_pages(prefix_len) + 1)

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
