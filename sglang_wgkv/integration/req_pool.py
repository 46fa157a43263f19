"""SGLang's request-slot pool, extended to own the lifetime of each request's dual-cache streams.

A dual-pool slot lives exactly as long as SGLang's request slot (``req_pool_idx``)::

    ReqToTokenPool.alloc(reqs)  -> new requests get a slot  -> DualCachePool.alloc_request(slot)
    ReqToTokenPool.free(req)    -> finish, abort, retract   -> DualCachePool.free_request(slot)
    ReqToTokenPool.clear()      -> flush_cache              -> every active slot freed

so no extra scheduler hook is needed and a retracted request simply starts over (prefix 0).
"""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from sglang_wgkv.memory import DualCachePool


class WGKVReqToTokenPool(ReqToTokenPool):
    """``ReqToTokenPool`` whose slots also allocate and free dual-cache streams.

    :meth:`attach` links the dual pool once it exists (SGLang builds the request pool first); no
    request can be scheduled before that.
    """

    dual: DualCachePool | None = None
    requests_started = 0
    requests_released = 0
    idle_checks = 0
    _checked_stamp: tuple[int, int] | None = None
    # radix_ext's SnapshotRadixCache when prefix caching is on: restores matched prefixes into
    # fresh slots and holds snapshot pages while idle.
    prefix_cache = None

    def attach(self, dual: DualCachePool) -> None:
        if dual.max_requests < self.req_to_token.shape[0]:
            raise ValueError(f"dual pool has {dual.max_requests} request slots, "
                             f"SGLang uses {self.req_to_token.shape[0]}")
        self.dual = dual

    def alloc(self, reqs):
        fresh = [req for req in reqs if req.req_pool_idx is None]
        slots = super().alloc(reqs)
        if slots is not None:
            for req in fresh:
                self.dual.alloc_request(req.req_pool_idx)
            self.requests_started += len(fresh)
            if self.prefix_cache is not None:
                self.prefix_cache.restore_prefixes(fresh)
        return slots

    def free(self, req):
        slot = req.req_pool_idx
        super().free(req)
        self.dual.free_request(slot)
        self.requests_released += 1

    def clear(self):
        super().clear()
        if self.dual is not None:
            for slot in self.dual.active.nonzero()[0].tolist():
                self.dual.free_request(slot)
                self.requests_released += 1

    def idle_check(self) -> list[str] | None:
        """Check the pool while SGLang holds no request: the problems found (empty = healthy), or
        None when no request started or ended since the last check (the scheduler calls this on
        every idle loop iteration; the integrity scan is not free)."""
        stamp = (self.requests_started, self.requests_released)
        if stamp == self._checked_stamp:
            return None
        self._checked_stamp = stamp
        self.idle_checks += 1
        problems = []
        active = self.dual.active.nonzero()[0].tolist()
        if active:
            problems.append(f"dual-cache pool still holds request slots {active[:8]}")
        free, total = self.dual.num_free_pages(), self.dual.allocator.num_pages
        held = self.dual.num_ref_holder_pages()  # prefix snapshots
        if free + held != total:
            problems.append(f"dual-cache pool leaks pages: free={free}, held by snapshots={held}, total={total}")
        try:
            if self.prefix_cache is not None:
                self.prefix_cache.check_integrity()
            else:
                self.dual.check_integrity()
        except RuntimeError as e:
            problems.append(f"dual-cache pool integrity: {e}")
        return problems

    def stats(self) -> dict:
        """Dual-pool occupancy and admission (:meth:`DualCachePool.stats`) plus lifecycle counters."""
        config = self.dual.config
        return {
            **self.dual.stats(),
            "local_window": config.local_window, "tau": config.tau,
            "random_admission": config.random_admission, "kv_budget": config.kv_budget,
            "page_bytes": self.dual.page_bytes,
            "requests_started": self.requests_started, "requests_released": self.requests_released,
            "idle_checks": self.idle_checks,
            "idle_checked_released": self._checked_stamp[1] if self._checked_stamp else None,
            **({"radix": self.prefix_cache.stats()} if self.prefix_cache is not None else {}),
        }
