"""The decode step of :class:`~sglang_wgkv.memory.dual_pool.DualCachePool`: ring pages and lazy
promotion of every layer's ring victim once per step (torch, or the Triton kernels of
:mod:`~sglang_wgkv.memory.triton_pool` when the pool was built with ``triton_decode``), then one ring
write per layer before attention reads the page rows.

A part of the pool (a base class of ``DualCachePool``): it reads and writes only the pool's own state,
declared in :mod:`~sglang_wgkv.memory.dual_pool`, whose docstring draws the page-table layout.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from sglang_wgkv.config import PAGE_SIZE
from sglang_wgkv.memory.host_copy import to_device_many
from sglang_wgkv.memory.kv_quant import byte_view, quantize


@dataclass
class DecodePlan:
    req: torch.Tensor  # [B] request slots
    pos: torch.Tensor  # [B] position of the token being decoded
    ring_tokens: torch.Tensor  # [B] tokens in the ring after this step's write
    ring_page: torch.Tensor  # [B, L, H] page of the ring slot the new token takes
    ring_off: torch.Tensor  # [B, 1] offset of that slot in its page
    # [B, L, H] (num_pages, last_page_len, kv_len) of every layer, made by the step's first
    # decode_page_rows: global lengths change only between steps (promotion, eviction)
    counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


class DecodeStep:
    """``begin_decode`` once per step, then ``write_decode`` per layer before ``decode_page_rows``;
    ``decode_worst_case`` is the scheduler's worst case for one step of a batch."""

    def decode_worst_case(self, seq_lens) -> int:
        """Pages :meth:`begin_decode` reserves for requests at cached lengths ``seq_lens``: one per
        stream of a request whose ring crosses a page boundary, one per stream of a promoting one."""
        seq_lens, W = np.asarray(seq_lens, dtype=np.int64), self.window
        steps = ((seq_lens < W) & (seq_lens % PAGE_SIZE == 0)) | (seq_lens >= W)
        return self.num_layers * self.num_kv_heads * int(steps.sum())

    def check_decode_rows(self, req_slots, seq_lens) -> tuple[np.ndarray, np.ndarray]:
        """``(req_slots, seq_lens)`` as int64 arrays; ValueError unless every slot is allocated at
        cached length ``seq_lens[b]`` below ``max_context_len`` (nothing is modified)."""
        req_slots, seq_lens = np.asarray(req_slots, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
        if not self.active[req_slots].all():
            raise ValueError(f"request slots {req_slots[~self.active[req_slots]].tolist()} are not allocated")
        if not np.array_equal(self.cached_len[req_slots], seq_lens):
            raise ValueError(
                f"seq_lens {seq_lens.tolist()} != cached lengths {self.cached_len[req_slots].tolist()}"
            )
        if (seq_lens >= self.max_context_len).any():
            raise ValueError(f"decode beyond max_context_len {self.max_context_len}")
        return req_slots, seq_lens

    def begin_decode(
        self,
        req_slots,
        seq_lens,
        req_slots_dev: torch.Tensor | None = None,
        seq_lens_dev: torch.Tensor | None = None,
    ) -> DecodePlan:
        """Prepare a decode step: token ``b`` is written at position ``seq_lens[b]`` (= cached length).

        Allocates ring pages crossing a page boundary (host-known), reserves one page per stream for
        promotion, and promotes the ring victim of every (request, layer, head) at once.
        ``*_dev`` are optional device copies of the host lists (avoid a host-to-device copy).

        No host sync unless :meth:`PageAllocator.ensure` needs one (its free-page floor ran out).
        With ``triton_decode``: promotion and the plan's ring page / offset / length come from two
        Triton launches (four past ``triton_pool.PROMOTE_SCAN_BLOCK`` request x layer x head items;
        plus three small ``torch.empty``), the only other device work being the
        ring-page allocation of a request whose ring crosses a page boundary (``seq_len < W``).
        """
        req_slots, seq_lens = self.check_decode_rows(req_slots, seq_lens)
        W, LH = self.window, self.num_layers * self.num_kv_heads
        new_ring = (seq_lens < W) & (seq_lens % PAGE_SIZE == 0)
        promoting = int((seq_lens >= W).sum())
        ring_total = LH * int(new_ring.sum())
        self.allocator.ensure(self.decode_worst_case(seq_lens))
        if ring_total:
            pages = (
                self.allocator.alloc(ring_total).to(torch.int32).view(-1, self.num_layers, self.num_kv_heads)
            )
            rows, cols = to_device_many(
                self.device, [(req_slots[new_ring], np.int64), (seq_lens[new_ring] // PAGE_SIZE, np.int64)]
            )
            self.page_table[
                rows[:, None, None],
                self._layers[None, :, None],
                self._heads[None, None, :],
                cols[:, None, None],
            ] = pages
        if req_slots_dev is None or seq_lens_dev is None:  # one pinned copy, not two pageable ones (a sync)
            req_host, pos_host = to_device_many(self.device, [(req_slots, np.int64), (seq_lens, np.int64)])
        req = req_slots_dev.long() if req_slots_dev is not None else req_host
        pos = seq_lens_dev.long() if seq_lens_dev is not None else pos_host
        self.cached_len[req_slots] = seq_lens + 1
        if self.triton_decode:
            from sglang_wgkv.memory.triton_pool import decode_promote

            B, i64 = len(req_slots), torch.int64
            req, pos = req.contiguous(), pos.contiguous()
            plan = (
                torch.empty(B, self.num_layers, self.num_kv_heads, dtype=i64, device=self.device),
                torch.empty(B, 1, dtype=i64, device=self.device),
                torch.empty(B, dtype=i64, device=self.device),
            )
            decode_promote(self, req, pos, plan_out=plan, lower_floor=promoting > 0)
            self._decode = DecodePlan(
                req=req, pos=pos, ring_tokens=plan[2], ring_page=plan[0], ring_off=plan[1]
            )
        else:
            if promoting:
                self._promote(req, pos)
            slot = pos % W
            ring_page = self.page_table[
                req[:, None, None],
                self._layers[None, :, None],
                self._heads[None, None, :],
                (slot // PAGE_SIZE)[:, None, None],
            ].long()
            self._decode = DecodePlan(
                req=req,
                pos=pos,
                ring_tokens=torch.clamp(pos + 1, max=W),
                ring_page=ring_page,
                ring_off=(slot % PAGE_SIZE)[:, None],
            )
        self._extend = None
        return self._decode

    def _promote(self, req: torch.Tensor, pos: torch.Tensor) -> None:
        """Lazy promotion for all layers and heads: the ring slot ``pos % W`` is about to be reused."""
        W = self.window
        r4 = req[:, None, None]
        L, H = self._layers[None, :, None], self._heads[None, None, :]
        slot = (pos % W)[:, None, None]
        flag = self.ring_flag[r4, L, H, slot] & (pos >= W)[:, None, None]  # [B, L, H]
        glen = self.global_len[req].long()
        self._append_pages(req, None, glen, flag.to(torch.int64), 1)
        dest_col = torch.where(flag, self.ring_cols + glen // PAGE_SIZE, self.dump_col)
        dest_page = self.page_table[r4, L, H, dest_col].long()
        src_page = self.page_table[r4, L, H, slot // PAGE_SIZE].long()
        for pages in (byte_view(self.k_pages), byte_view(self.v_pages)):  # bytes: no second rounding
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
        self._store_kv(layer, page, p.ring_off, k, v)
        self.ring_flag[p.req[:, None], layer, self._heads[None, :], (p.pos % self.window)[:, None]] = admit

    def write_decode_rows(
        self,
        layer: int,
        req: torch.Tensor,
        pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        admit: torch.Tensor | None,
    ) -> None:
        """:meth:`write_decode` with the step's rows given explicitly (``req``, ``pos`` ``[B]`` int64
        device tensors, e.g. static CUDA-graph buffers), so that a captured graph can replay it. k, v
        ``[B, H, D]`` with equal strides and a contiguous last dim; admit ``[B, H]`` bool, or None to
        write only the keys and values (then :meth:`write_decode_flags` writes the flags, e.g. from
        another stream, before the next step's promotion). One Triton launch on a ``triton_decode``
        pool, torch ops otherwise."""
        if self.triton_decode:
            from sglang_wgkv.memory.triton_pool import decode_write

            decode_write(self, layer, req, pos, k, v, admit)
            return
        slot = pos % self.window
        page = self.page_table[req[:, None], layer, self._heads[None, :], (slot // PAGE_SIZE)[:, None]].long()
        off = (slot % PAGE_SIZE)[:, None]
        self._store_kv(layer, page, off, k, v)
        if admit is not None:
            self.write_decode_flags(layer, req, pos, admit)

    def _store_kv(self, layer: int, page, off, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k, v`` quantized once (:func:`~sglang_wgkv.memory.kv_quant.quantize`) into ``[page, off]``."""
        byte_view(self.k_pages)[page, off] = byte_view(quantize(k, self.k_scale[layer], self.dtype))
        byte_view(self.v_pages)[page, off] = byte_view(quantize(v, self.v_scale[layer], self.dtype))

    def write_decode_flags(
        self, layer: int, req: torch.Tensor, pos: torch.Tensor, admit: torch.Tensor
    ) -> None:
        """The admission flags ``[B, H]`` of the step's new tokens (the other half of
        :meth:`write_decode_rows` with ``admit=None``)."""
        if self.triton_decode:
            from sglang_wgkv.memory.triton_pool import decode_write

            decode_write(self, layer, req, pos, None, None, admit)
            return
        self.ring_flag[req[:, None], layer, self._heads[None, :], (pos % self.window)[:, None]] = admit

    def decode_page_rows(self, layer: int):
        """Page lists of the current decode batch in ``layer`` (after :meth:`write_decode`).

        Returns ``rows [B, H, C]`` (page-table rows; the first ``num_pages`` entries are the
        stream's pages, ring first), ``num_pages [B, H]``, ``last_page_len [B, H]`` (1..16) and
        ``kv_len [B, H]`` (tokens). No host sync.
        """
        p = self._decode
        if p.counts is None:  # every layer's at once: the per-layer ops would be the same each layer
            glen = self.global_len[p.req].long()  # [B, L, H]
            ring = p.ring_tokens[:, None, None]
            ring_pages = (ring + PAGE_SIZE - 1) // PAGE_SIZE
            gpages = (glen + PAGE_SIZE - 1) // PAGE_SIZE
            last = torch.where(
                gpages > 0, glen - (gpages - 1) * PAGE_SIZE, ring - (ring_pages - 1) * PAGE_SIZE
            )
            p.counts = (ring_pages + gpages, last, ring + glen)
        num_pages, last, kv_len = (t[:, layer] for t in p.counts)
        rows = self.page_table[p.req, layer, :, : self.dump_col]
        return rows, num_pages, last, kv_len
