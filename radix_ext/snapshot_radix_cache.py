"""SGLang's RadixCache whose matches resume from dual-cache prefix snapshots.

Nodes keep SGLang's logical token slots (so ``evictable_size`` stays in logical tokens and the idle
invariant ``available + evictable == total`` holds unchanged). On top, a node may own a
:class:`~sglang_wgkv.memory.prefix_snapshot.PrefixSnapshot` of the dual-cache state of a request at
exactly the node's depth (global pages shared by refcount, ring and flags copied)::

    where                              what
    ---------------------------------  ----------------------------------------------------------
    cache_unfinished_req / _finished   after SGLang's insert, split the path at the request's cached
                                       length S and snapshot its slot there (chunked prefill: every
                                       chunk boundary; a finished prefill: the prompt; finish: all);
                                       never deeper than the path SGLang inserted
    before a forward is launched       a slot at the end of an extend whose cache call has not run
    (:meth:`before_forward`)           (overlap scheduler) is snapshotted ahead: the call takes that one
    match_prefix                       SGLang's match, cut back to the deepest node with a snapshot
                                       (the snapshot is pinned until the request pool's next alloc);
                                       a match a ring or more deeper ends the request's first chunk
                                       there, so that it is snapshotted (branch_split.py)
    WGKVReqToTokenPool.alloc           a fresh slot with prefix S > 0 restores that snapshot
    _delete_leaf (LRU evict) / reset   release the node's snapshot
    allocator.ensure shortfall         drop unpinned snapshots, least recently used first
                                       (:meth:`reclaim`, through the runtime)

Physical pages. After a restore the request's global pages are shared, but its ring is a private
copy of tokens the tree already counts, up to ``W_local + 16`` tokens per stream beyond the capacity
rule of :mod:`sglang_wgkv.integration.pools.capacity`. The dual pool is sized with that much extra for
``restore_slots`` requests, and a match only hits while fewer restored requests run (and are pending).
Snapshot pages themselves are never needed by a forward: they are dropped when a step would not fit
(snapshots taken ahead included).

Streams. Takes, restores and releases issued by the scheduler wait for the last launched forward first
(the store's ``order``: the runtime's forward fence, :mod:`sglang_wgkv.integration.plugin.overlap`).
"""

from __future__ import annotations

import functools

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_wgkv.integration.scheduling.branch_split import note_branch
from sglang_wgkv.memory.page_allocator import PoolExhausted
from sglang_wgkv.memory.prefix_snapshot import SnapshotStore


class SnapshotRadixCache(RadixCache):
    """Parameters
    ----------
    params : SGLang's ``CacheInitParams`` (its request pool is the runtime's ``WGKVReqToTokenPool``).
    runtime : the process's :class:`~sglang_wgkv.integration.plugin.runtime.WGKVRuntime`: its dual pool, and
        its capacity plan's ``restore_slots`` (restored requests that may run at once: the dual
        pool's extra ring capacity). The cache attaches itself to the runtime.
    """

    def __init__(self, params, runtime):
        self.dual = runtime.dual
        self.store = SnapshotStore(self.dual, order=runtime.forward_fence.wait)
        self.restore_slots = runtime.plan.restore_slots
        self._snap_nodes = set()  # nodes that own a snapshot
        self._pinned = {}  # id(snapshot) -> snapshot matched since the last alloc
        self._restored = {}  # request slot -> pool generation at restore
        self._owed = {}  # request slot -> length a launched extend reached, its cache call not run yet
        self._ahead = {}  # request slot -> snapshot at that length, taken before a forward moved it
        self._raw_match = False
        self.hits = self.hit_tokens = self.snapshots_taken = self.snapshots_dropped = 0
        self.snapshots_ahead = self.snapshots_missed = 0
        super().__init__(params)
        runtime.attach_prefix_cache(self)

    # -- snapshots on nodes -----------------------------------------------------------------------
    def _drop(self, node) -> None:
        self.store.release(node.snapshot)
        node.snapshot = None
        self._snap_nodes.discard(node)
        self.snapshots_dropped += 1

    def _victims(self, ahead: bool = True):
        """``(snapshot, drop)`` of every snapshot a reclaim may drop, least recently used first:
        unpinned node snapshots, then (``ahead``) those taken ahead of a launch, whose prompts' cache
        calls have not run yet (listed before any is dropped)."""
        nodes = sorted(
            (n for n in self._snap_nodes if id(n.snapshot) not in self._pinned),
            key=lambda n: n.last_access_time,
        )
        victims = [(n.snapshot, functools.partial(self._drop, n)) for n in nodes]
        if not ahead:
            return victims
        return victims + [
            (snap, functools.partial(self._release_ahead, r)) for r, snap in self._ahead.items()
        ]

    def reclaim(self, worst_case: int) -> None:
        """Drop unpinned snapshots, least recently used first, until ``worst_case`` pages fit. The
        host's floor (raised by each drop's ring copies) says so without a sync; once what the drops
        are expected to return covers the rest, one exact count (a host sync) says whether to go
        on. A count after every drop kept the host from running ahead of the GPU through a full
        pool's admission checks (19 syncs for two prompts: launch/results/served_speed/M1D_h100_int32)."""
        allocator = self.dual.allocator
        for _, drop in self._victims():
            if allocator.free_floor >= worst_case:
                return
            if allocator.expected_free >= worst_case and allocator.can_allocate(worst_case):
                return
            drop()

    def keep_headroom(self, pages: int) -> None:
        """Drop least recently used snapshots until the free pages the host expects (its floor and
        what drops not yet counted should return) reach ``pages``, without a host sync: called after
        a forward's launch, so that the next scheduling round's admission checks find room on the
        host's floor instead of reclaiming with exact counts."""
        allocator = self.dual.allocator
        allocator.take_queued()
        if allocator.expected_free >= pages:  # most launches: no victims listed, nothing sorted
            return
        for _, drop in self._victims(ahead=False):  # a prompt's end snapshot is kept for its cache call
            if allocator.expected_free >= pages:
                return
            drop()

    def _release_ahead(self, r: int) -> None:
        self._owed.pop(r, None)
        snap = self._ahead.pop(r, None)
        if snap is not None:
            self.store.release(snap)

    def _snapshot_request(self, req, path_len: int, priority: int) -> None:
        """Snapshot ``req``'s slot on the node ending at its length S (split if needed): the snapshot
        taken ahead of a launch if any, else the slot as it is now, only if S is within the
        ``path_len`` tokens SGLang just inserted."""
        r = req.req_pool_idx
        self._owed.pop(r, None)
        snap = self._ahead.pop(r, None)
        S = snap.length if snap is not None else int(self.dual.cached_len[r])
        if S == 0 or S > path_len:
            if 0 < path_len < S:  # a forward moved the slot past the path before this call
                self.snapshots_missed += 1
            if snap is not None:
                self.store.release(snap)
            return
        token_ids = (req.origin_input_ids + req.output_ids)[:S]
        key = RadixKey(token_ids, req.extra_key)
        placeholder = torch.zeros(S, dtype=torch.int64)  # never stored: the whole path already exists
        prefix_len, node = self._insert_helper(self.root_node, key, placeholder, priority, chunked=True)
        if prefix_len != S:
            raise RuntimeError(
                f"radix path of request slot {r} is shorter ({prefix_len}) than its cache ({S})"
            )
        if getattr(node, "snapshot", None) is not None:
            if snap is not None:
                self.store.release(snap)
            return
        if snap is None:
            try:
                snap = self.store.take(r)
            except PoolExhausted:
                return  # no room even after dropping snapshots: this prefix is simply not cached
        node.snapshot = snap
        self._snap_nodes.add(node)
        self.snapshots_taken += 1

    def before_forward(self, slots: list[int], extend_rows: list[tuple[int, int]]) -> None:
        """Before a forward over request ``slots`` is launched: snapshot those of them still at the
        end of an extend whose cache call has not run (it runs after this launch under the overlap
        scheduler, and this forward moves the slot), then owe the forward's ``extend_rows``
        (``(slot, length it reaches)``) a cache call."""
        if self.disable:
            return
        for r in slots:
            length = self._owed.pop(r, None)
            if length is None or r in self._ahead or int(self.dual.cached_len[r]) != length:
                continue
            try:
                self._ahead[r] = self.store.take(r)
            except PoolExhausted:
                continue  # the cache call then finds the slot past its path: not cached
            self.snapshots_ahead += 1
        self._owed.update(extend_rows)

    def slot_freed(self, r: int) -> None:
        """Called by the request pool when slot ``r`` is freed: what it owed or had taken ahead goes."""
        self._release_ahead(r)

    def restore_prefixes(self, reqs) -> None:
        """Called by the request pool with the requests that just got a fresh slot."""
        for req in reqs:
            S = len(req.prefix_indices)
            if S == 0:
                continue
            snap = getattr(req.last_node, "snapshot", None)
            if snap is None or snap.length != S:
                raise RuntimeError(f"request {req.rid}: matched prefix {S} has no snapshot at its node")
            self.store.restore(req.req_pool_idx, snap)
            self._restored[req.req_pool_idx] = int(self.dual.generation[req.req_pool_idx])
            self.hits += 1
            self.hit_tokens += S
        self._pinned.clear()

    def _restored_running(self) -> int:
        dual = self.dual
        return sum(1 for r, gen in self._restored.items() if dual.active[r] and dual.generation[r] == gen)

    # -- SGLang's prefix-cache interface ----------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        if self._raw_match or self.disable:
            return result
        node = result.last_device_node
        while node is not self.root_node and getattr(node, "snapshot", None) is None:
            node = node.parent
        if node is not self.root_node and id(node.snapshot) not in self._pinned:
            if self._restored_running() + len(self._pinned) >= self.restore_slots:
                node = self.root_node
            else:
                self._pinned[id(node.snapshot)] = node.snapshot
        depth = node.snapshot.length if node is not self.root_node else 0
        note_branch(params.req, len(result.device_indices), depth, self.dual.window)
        return result._replace(
            device_indices=result.device_indices[:depth],
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def cache_unfinished_req(self, req, chunked=False):
        if self.disable:
            return
        self._raw_match = True  # SGLang re-matches its own insert and expects the full length
        try:
            super().cache_unfinished_req(req, chunked=chunked)
        finally:
            self._raw_match = False
        self._snapshot_request(req, len(req.get_fill_ids()), getattr(req, "priority", 0) or 0)

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        inserted = is_insert and not self.disable and not self.disable_finished_insert
        path_len = min(kv_len_to_handle, len(req.origin_input_ids) + len(req.output_ids)) if inserted else 0
        self._snapshot_request(req, path_len, getattr(req, "priority", 0) or 0)

    def _delete_leaf(self, node):
        if getattr(node, "snapshot", None) is not None:
            self._drop(node)
        super()._delete_leaf(node)

    def reset(self):
        if hasattr(self, "_snap_nodes"):  # RadixCache.__init__ calls reset() before ours finished
            for node in list(self._snap_nodes):
                self._drop(node)
            for r in list(self._ahead):
                self._release_ahead(r)
            self._owed.clear()
            self._pinned.clear()
            self._restored.clear()
        super().reset()

    # -- checks and stats -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise RuntimeError when a snapshot disagrees with its node or the store."""
        if len(self.store) != len(self._snap_nodes) + len(self._ahead):
            raise RuntimeError(
                f"{len(self.store)} live snapshots, {len(self._snap_nodes)} nodes own one, "
                f"{len(self._ahead)} taken ahead"
            )
        for node in self._snap_nodes:
            depth, n = 0, node
            while n is not self.root_node:
                if n.parent is None:
                    raise RuntimeError("a node with a snapshot is no longer in the tree")
                depth, n = depth + len(n.key), n.parent
            if depth != node.snapshot.length:
                raise RuntimeError(f"snapshot of length {node.snapshot.length} on a node at depth {depth}")
        self.dual.check_integrity()

    def stats(self) -> dict:
        return {
            "snapshots": len(self.store),
            "snapshot_pages": self.dual.num_ref_holder_pages(),
            "snapshots_taken": self.snapshots_taken,
            "snapshots_dropped": self.snapshots_dropped,
            "snapshots_ahead": self.snapshots_ahead,
            "snapshots_missed": self.snapshots_missed,
            "prefix_hits": self.hits,
            "prefix_hit_tokens": self.hit_tokens,
            "restore_slots": self.restore_slots,
            "evictable_tokens": self.evictable_size(),
            "protected_tokens": self.protected_size(),
        }
