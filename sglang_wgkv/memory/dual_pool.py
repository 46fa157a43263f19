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
* mixed (prefill chunks and decode rows in one forward): :meth:`begin_mixed`, then both of the above
  per layer (:mod:`~sglang_wgkv.memory.mixed_step`).

The pool is the only writer of its state. Its steps live in their own files
(:mod:`~sglang_wgkv.memory.extend_step`, :mod:`~sglang_wgkv.memory.decode_step`, and the FP8 scales
:mod:`~sglang_wgkv.memory.kv_scales`: base classes of the pool); what others change goes through methods here: the evictor's compaction
(:meth:`compact_global`, :meth:`release_pages`) and prefix snapshots (:meth:`take_snapshot`,
:meth:`restore_snapshot`, :meth:`release_snapshot`).
"""

import math

import numpy as np
import torch

from sglang_wgkv.config import PAGE_SIZE, WGKVConfig
from sglang_wgkv.memory.decode_step import DecodePlan, DecodeStep
from sglang_wgkv.memory.extend_plan import ExtendPlan
from sglang_wgkv.memory.extend_step import ExtendStep
from sglang_wgkv.memory.host_copy import QueuedCount
from sglang_wgkv.memory.kv_quant import byte_view, gather, is_fp8
from sglang_wgkv.memory.kv_scales import KVScales
from sglang_wgkv.memory.mixed_step import MixedStep
from sglang_wgkv.memory.page_allocator import PageAllocator
from sglang_wgkv.memory.pool_integrity import PoolIntegrity
from sglang_wgkv.memory.prefix_snapshot import PrefixSnapshot


def zeroed_pages(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on ``device``; on the CPU from calloc'd memory (NumPy's zeros),
    which the OS maps to zero pages until first written: a CPU server's pool of gigabytes then costs
    no start-up memset and no resident memory for pages never used (``torch.zeros`` writes every
    byte before the server starts)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return (
        torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)
    )


__all__ = ["DecodePlan", "DualCachePool", "ExtendPlan"]


class DualCachePool(ExtendStep, DecodeStep, MixedStep, KVScales, PoolIntegrity):
    """Parameters
    ----------
    num_layers, num_kv_heads, head_dim : model attention shape (KV heads of this rank).
    num_pages : physical pages (16 tokens each) shared by every stream.
    max_requests : request slots (SGLang's ``req_pool_idx`` range).
    max_context_len : longest sequence a request may reach.
    triton_decode : :meth:`begin_decode` promotes with the Triton kernels of
        :func:`~sglang_wgkv.memory.triton_pool.decode_promote` (same resulting state as the torch
        ops of :meth:`_promote`, two launches, four at large batches); default: on CUDA devices. A
        server passes its one torch/Triton choice (:class:`~sglang_wgkv.integration.plugin.runtime.WGKVRuntime`).
    triton_extend : :meth:`write_extend` moves its rows with
        :func:`~sglang_wgkv.memory.triton_extend.extend_move` and ``extend_ring_write`` (one launch
        each a layer, the index work done once for a group of layers) and :meth:`extend_inputs` gathers with ``extend_context`` (one launch a layer),
        instead of torch gathers built on the host; the same tensors either way. Default off here; a
        server on CUDA turns it on (``--[no-]wgkv-extend-kernels``).
    reclaimer : ``fn(worst_case)`` that releases pages it can spare (a prefix cache dropping
        snapshots) before a step's reserve gives up; it must not allocate.
    dtype : what the pages store; an FP8 dtype (:mod:`~sglang_wgkv.memory.kv_quant`) quantizes
        K/V once when written with the per-layer ``k_scale`` / ``v_scale`` (:meth:`set_kv_scales`,
        1.0 until set), and every read dequantizes.
    compute_dtype : the dtype reads dequantize into (the model's); default: ``dtype``, float32 for FP8.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        max_requests: int,
        max_context_len: int,
        config: WGKVConfig = WGKVConfig(),
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        triton_decode: bool | None = None,
        triton_extend: bool = False,
        reclaimer=None,
        compute_dtype: torch.dtype | None = None,
    ):
        self.config = config
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_requests, self.max_context_len = max_requests, max_context_len
        self.window = config.local_window
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantized = is_fp8(dtype)
        self.compute_dtype = compute_dtype or (torch.float32 if self.quantized else dtype)
        # [L] float32 per-tensor scales of each layer (device tensors: kernels and captured CUDA
        # graphs read them by pointer); only an FP8 pool's differ from 1.0
        self.k_scale = torch.ones(num_layers, dtype=torch.float32, device=self.device)
        self.v_scale = torch.ones(num_layers, dtype=torch.float32, device=self.device)
        self.triton_decode = self.device.type == "cuda" if triton_decode is None else triton_decode
        self.triton_extend = triton_extend
        self.allocator = PageAllocator(num_pages, self.device, reclaimer=reclaimer)
        self.dump_page = self.allocator.dump_page
        self.ring_cols = self.window // PAGE_SIZE
        self.global_cols = max(0, math.ceil((max_context_len - self.window) / PAGE_SIZE))
        self.dump_col = self.ring_cols + self.global_cols
        shape = (num_pages + 1, PAGE_SIZE, head_dim)
        self.k_pages = zeroed_pages(shape, dtype, self.device)
        self.v_pages = zeroed_pages(shape, dtype, self.device)
        streams = (max_requests, num_layers, num_kv_heads)
        self.page_table = torch.full(
            (*streams, self.dump_col + 1), self.dump_page, dtype=torch.int32, device=self.device
        )
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
        self._extend: ExtendPlan | None = None
        self._decode: DecodePlan | None = None
        # Mixed forwards run, and the most prefill tokens one of them carried (MixedStep).
        self.mixed_forwards = 0
        # Extend forwards that read their context's page columns from the device (a host sync each:
        # ExtendStep._context_gcols), served in the stats beside the allocator's synced checks.
        self.context_reads_synced = 0
        self.mixed_prefill_tokens_max = 0

    # -- request lifecycle ----------------------------------------------------------------------
    def alloc_request(self, r: int) -> None:
        if not 0 <= r < self.max_requests:
            raise ValueError(f"request slot {r} out of range [0, {self.max_requests})")
        if self.active[r]:
            raise ValueError(f"request slot {r} is already allocated")
        self.active[r] = True
        self.cached_len[r] = 0
        self.generation[r] += 1

    def free_request(self, r: int) -> None:
        """Return every page of slot ``r`` (ring and global); no host sync. Its ring pages surely
        return (a snapshot copies them, a restore gets fresh ones): the host's floor rises by them."""
        if not self.active[r]:
            raise ValueError(f"request slot {r} is not allocated")
        ring = self.ring_pages(int(self.cached_len[r]))
        self.allocator.free(
            self.page_table[r, :, :, : self.dump_col], returned=self.num_layers * self.num_kv_heads * ring
        )
        self.page_table[r] = self.dump_page
        self.global_len[r] = 0
        self.ring_flag[r] = False
        self.active[r] = False
        self.cached_len[r] = 0

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

    # -- prefix snapshots (radix_ext) ------------------------------------------------------------
    def take_snapshot(self, r: int) -> PrefixSnapshot:
        """Snapshot slot ``r`` at its cached length (:mod:`~sglang_wgkv.memory.prefix_snapshot`): the
        global pages shared, the ring copied. Raises PoolExhausted if the ring copy does not fit."""
        S = int(self.cached_len[r])
        if not self.active[r] or S == 0:
            raise ValueError(f"request slot {r} has nothing to snapshot")
        ring_used = self.ring_pages(S)
        L, H = self.num_layers, self.num_kv_heads
        copies = self.allocator.alloc(L * H * ring_used).view(L, H, ring_used)
        src = self.page_table[r, :, :, :ring_used].long()
        for pages in (byte_view(self.k_pages), byte_view(self.v_pages)):
            pages[copies] = pages[src]
        rows = self.page_table[r].clone()
        rows[:, :, :ring_used] = copies.to(rows.dtype)
        self.allocator.incref(rows[:, :, self.ring_cols : self.dump_col])  # (dump entries ignored)
        rows = rows[:, :, : self.dump_col]
        return PrefixSnapshot(
            S,
            rows,
            self.global_len[r].clone(),
            self.ring_flag[r].clone(),
            private_pages=L * H * ring_used,
            held=QueuedCount((rows != self.dump_page).sum()),
        )

    def snapshot_pages_bound(self, snap: PrefixSnapshot) -> int:
        """An upper bound on the pages ``snap`` holds, from its length alone: its ring copies and a
        global page per 16 tokens past the ring in every stream."""
        past_ring = -(-max(snap.length - self.window, 0) // PAGE_SIZE)
        return snap.private_pages + self.num_layers * self.num_kv_heads * past_ring

    def restore_snapshot(self, r: int, snap: PrefixSnapshot) -> None:
        """Make the freshly allocated, empty slot ``r`` continue from ``snap``: the ring and the
        partial last global page copied (this request writes into them), full global pages shared.
        No host sync beyond :meth:`PageAllocator.ensure`: a stream whose last global page is full
        copies it to the dump page instead."""
        if not self.active[r] or self.cached_len[r] != 0:
            raise ValueError(f"request slot {r} must be allocated and empty to restore a prefix")
        R = self.ring_cols
        ring_used = self.ring_pages(snap.length)
        self.allocator.ensure(self.restore_bound(snap.length))
        rows = snap.rows.clone()
        ring = self.allocator.alloc(self.num_layers * self.num_kv_heads * ring_used)
        ring = ring.view(self.num_layers, self.num_kv_heads, ring_used)
        glen = snap.global_len.long()
        last_col = (R + (glen - 1).clamp(min=0) // PAGE_SIZE)[..., None]  # [L, H, 1]
        last = snap.rows.gather(2, last_col).long()  # [L, H, 1]: the last global page (or dump)
        partial = ((glen % PAGE_SIZE) != 0)[..., None]
        fresh = self.allocator.alloc_where(partial)  # the dump page where the last page is full
        for pages in (byte_view(self.k_pages), byte_view(self.v_pages)):
            pages[ring] = pages[snap.rows[:, :, :ring_used].long()]
            pages[fresh] = pages[last]
        rows[:, :, :ring_used] = ring.to(rows.dtype)
        rows.scatter_(2, last_col, torch.where(partial, fresh, last).to(rows.dtype))
        shared = snap.rows[:, :, R:].clone()
        shared.scatter_(2, last_col - R, torch.where(partial, self.dump_page, last).to(shared.dtype))
        self.allocator.incref(shared)  # (dump entries ignored)
        self.page_table[r, :, :, : self.dump_col] = rows
        self.global_len[r] = snap.global_len.to(self.global_len.dtype)
        self.ring_flag[r] = snap.ring_flag
        self.cached_len[r] = snap.length

    def release_snapshot(self, snap: PrefixSnapshot) -> None:
        """Drop the snapshot's page references (pages no one else holds return to the free stack);
        no host sync (dump entries are ignored). Its ring copies surely return: the host's floor of
        free pages rises by them at once; its global pages are expected to (unless a request or
        another snapshot shares them: ``PageAllocator.expected_free``)."""
        if snap.rows.is_cuda:  # a release inside a forward reads rows the scheduler's stream allocated
            snap.rows.record_stream(torch.cuda.current_stream(snap.rows.device))
        held = snap.held_pages(self.snapshot_pages_bound(snap))
        self.allocator.free(snap.rows, returned=snap.private_pages, expected=held - snap.private_pages)

    # -- eviction (memory/evictor.py) ------------------------------------------------------------
    def compact_global(
        self,
        r: torch.Tensor,
        l: torch.Tensor,
        h: torch.Tensor,
        keep: torch.Tensor,
        gpages: torch.Tensor | None = None,
        g_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Keep only the global entries ``keep`` of the streams ``(r[s], l[s], h[s])``, in order, at the
        front of their global pages; returns the page ids the streams no longer use (release them
        with :meth:`release_pages` once every chunk is compacted).

        keep : ``[S, Ng]`` bool over the first ``Ng`` (a multiple of 16) global entries (entries past
            a stream's length are ignored); gpages ``[S, Ng / 16]`` and g_keys ``[S, Ng, D]``: the
            streams' global pages and keys as stored (the pool's dtype: an FP8 pool's bytes are
            moved, never re-quantized) when the caller already gathered them.
        Pages shared with another owner (refcount > 1, e.g. a prefix snapshot) are copied before
        being rewritten.
        """
        R, D = self.ring_cols, self.head_dim
        S, Ng = keep.shape
        if gpages is None:
            gpages = self.page_table[r, l, h, R : R + Ng // PAGE_SIZE].long()
        if g_keys is None:
            g_keys = gather(self.k_pages, gpages.reshape(-1)).reshape(S, Ng, D)  # 1-D: whole-page gather
        if g_keys.dtype != self.dtype:
            raise ValueError(f"g_keys must be the stored keys ({self.dtype}), got {g_keys.dtype}")
        glen = self.global_len[r, l, h].long()
        valid = torch.arange(Ng, device=self.device)[None, :] < glen[:, None]
        keep = keep & valid
        new_len = keep.sum(1)
        dest = torch.cumsum(keep.long(), 1) - 1  # [S, Ng]
        old_cols = (glen + PAGE_SIZE - 1) // PAGE_SIZE
        new_cols = (new_len + PAGE_SIZE - 1) // PAGE_SIZE
        col = torch.arange(gpages.shape[1], device=self.device)
        first_changed = torch.argmax((valid & ~keep).long(), 1) // PAGE_SIZE  # first dropped entry's page
        trailing = (col >= new_cols[:, None]) & (col < old_cols[:, None])
        shared = (
            (self.allocator.ref[gpages] > 1) & (col >= first_changed[:, None]) & (col < new_cols[:, None])
        )
        out_pages = gpages.clone()
        n_shared = int(shared.sum())
        if n_shared:
            self.allocator.free(gpages[shared])  # drop our reference: the other owner keeps them
            out_pages[shared] = self.allocator.alloc(n_shared)
        g_vals = byte_view(self.v_pages)[gpages.reshape(-1)].reshape(S, -1, D)
        dest_page = torch.where(
            keep, out_pages.gather(1, torch.clamp(dest, min=0) // PAGE_SIZE), self.dump_page
        )
        dest_off = torch.clamp(dest, min=0) % PAGE_SIZE
        byte_view(self.k_pages)[dest_page, dest_off] = byte_view(g_keys)
        byte_view(self.v_pages)[dest_page, dest_off] = g_vals
        self.page_table[r[:, None], l[:, None], h[:, None], R + col[None, :]] = torch.where(
            col[None, :] < new_cols[:, None], out_pages, self.dump_page
        ).to(torch.int32)
        self.global_len[r, l, h] = new_len.to(torch.int32)
        return gpages[trailing]

    def release_pages(self, pages: torch.Tensor) -> None:
        """Drop one reference from each page (see :meth:`PageAllocator.free`)."""
        self.allocator.free(pages)

    def _append_pages(self, req, layer, glen, cnt, max_new_pages: int) -> None:
        """Allocate the pages that growing each stream's global length by ``cnt`` needs.

        req ``[B]``; layer an int (glen/cnt ``[B, H]``), a slice of layers (``[B, G, H]``) or None for
        all layers (``[B, L, H]``).
        """
        old = (glen + PAGE_SIZE - 1) // PAGE_SIZE
        new = (glen + cnt + PAGE_SIZE - 1) // PAGE_SIZE - old
        j = torch.arange(max_new_pages, device=self.device)
        need = j < new[..., None]
        pages = self.allocator.alloc_where(need).to(torch.int32)
        col = torch.where(need, self.ring_cols + old[..., None] + j, self.dump_col)
        if isinstance(layer, int):
            idx = (req[:, None, None], layer, self._heads[None, :, None], col)
        else:
            layers = self._layers if layer is None else self._layers[layer]
            idx = (
                req[:, None, None, None],
                layers[None, :, None, None],
                self._heads[None, None, :, None],
                col,
            )
        self.page_table[idx] = torch.where(need, pages, self.dump_page)

    # -- queries --------------------------------------------------------------------------------
    def global_lengths(self, r: int) -> torch.Tensor:
        """``[L, H]`` global tokens of slot ``r``."""
        return self.global_len[r].clone()

    def request_cache_sizes(self, r: int) -> dict:
        """Per-request cache sizes of slot ``r`` (syncs): global tokens per (layer, KV head), mean and
        max, and ``mean_kv_tokens_per_head`` = ring + global tokens averaged over layers and heads."""
        glen = self.global_len[r].double()
        ring = min(int(self.cached_len[r]), self.window)
        return {
            "mean_global_tokens_per_head": float(glen.mean()),
            "max_global_tokens_per_head": int(glen.max()),
            "mean_kv_tokens_per_head": float(glen.mean()) + ring,
        }

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
        # the admission counters in one transfer; a difference of two readings is what the requests
        # between them admitted
        left_rows, promoted_rows = torch.stack((self.left_ring, self.promoted)).tolist()
        left, promoted = sum(map(sum, left_rows)), sum(map(sum, promoted_rows))
        free = self.num_free_pages()
        used = self.allocator.num_pages - free
        return {
            "active_requests": int(act.numel()),
            "free_pages": free,
            "used_pages": used,
            "total_pages": self.allocator.num_pages,
            "used_bytes": used * self.page_bytes,
            "kv_dtype": str(self.dtype).removeprefix("torch."),
            "global_tokens_per_layer_head": glen.sum(0).tolist() if act.numel() else [],
            "global_tokens": int(glen.sum()),
            "ring_tokens": int(ring.sum()) * self.num_layers * self.num_kv_heads,
            "tokens_left_ring": left,
            "tokens_promoted": promoted,
            "admitted_fraction": promoted / left if left else None,
            "mixed_forwards": self.mixed_forwards,
            "allocation_checks_synced": self.allocator.checks_synced,
            "context_reads_synced": self.context_reads_synced,
            "mixed_prefill_tokens_max": self.mixed_prefill_tokens_max,
            "admitted_fraction_per_layer_head": [
                [p / max(n, 1) for p, n in zip(p_row, n_row)]
                for p_row, n_row in zip(promoted_rows, left_rows)
            ],
            "tokens_left_ring_per_layer_head": left_rows,
            "tokens_promoted_per_layer_head": promoted_rows,
        }
