"""SGLang's request-slot pool, extended to own the lifetime of each request's dual-cache streams.

A dual-pool slot lives exactly as long as SGLang's request slot (``req_pool_idx``)::

    ReqToTokenPool.alloc(reqs)  -> new requests get a slot  -> DualCachePool.alloc_request(slot)
    ReqToTokenPool.free(req)    -> finish, abort, retract   -> DualCachePool.free_request(slot)
    ReqToTokenPool.clear()      -> flush_cache              -> every active slot freed

so no extra scheduler hook is needed and a retracted request simply starts over (prefix 0).

Under the overlap scheduler a decode graph may still run the freed request's last step while the
scheduler frees its slot, and may still write pages or a query-window row that ``alloc`` hands to a
new owner: so ``alloc`` waits for the forward in flight (``runtime.forward_fence``) and ``free`` does
not (:mod:`sglang_wgkv.integration.plugin.overlap` says why each is safe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from sglang_wgkv.integration.requests.control import RequestAdmission, attach_usage, request_usage
from sglang_wgkv.integration.scheduling.long_requests import apply_bound
from sglang_wgkv.memory import DualCachePool

if TYPE_CHECKING:
    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime


class WGKVReqToTokenPool(ReqToTokenPool):
    """``ReqToTokenPool`` whose slots also allocate and free dual-cache streams.

    ``runtime``: the process's :class:`~sglang_wgkv.integration.plugin.runtime.WGKVRuntime`, whose dual pool
    (built right after this pool, with one request slot per row of ``req_to_token``), evictor, TP
    usage reducer and prefix cache this pool reads; no request is scheduled before they exist.
    """

    def __init__(self, *args, runtime: WGKVRuntime, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = runtime
        rows = self.req_to_token.shape[0]
        if runtime.has_pool() and runtime.dual.max_requests < rows:
            raise ValueError(f"dual pool has {runtime.dual.max_requests} request slots, SGLang uses {rows}")
        # ``[R]`` admission threshold of each slot's request (-inf: admission off), read per row by
        # the backend; the server's tau unless the request overrides it (requests/control.py).
        self.server_tau = runtime.settings.config.tau
        self.slot_tau = torch.full((rows,), self.server_tau, dtype=torch.float32, device=self.device)
        self.slot_admission = [RequestAdmission()] * rows
        self.slot_bound = [None] * rows  # the request's RequestBound (long_requests), None: unbounded
        # the request's cache holds every token of its own and nothing else: admission off, unbounded,
        # no prefix restored (its prefill attention is dense: attention/fa3_dense.py)
        self.slot_dense = [False] * rows
        self.requests_started = self.requests_released = 0
        self.idle_checks = 0
        self.peak_active = 0  # most requests holding a slot at once since start
        self._checked_stamp: tuple[int, int] | None = None
        self.eviction_triggers_released = 0
        self.evicted_tokens_released = 0

    @property
    def dual(self) -> DualCachePool:
        return self.runtime.dual

    def alloc(self, reqs):
        fresh = [req for req in reqs if req.req_pool_idx is None]
        if fresh:
            self.runtime.forward_fence.wait()
        slots = super().alloc(reqs)
        if slots is not None:
            for req in fresh:
                slot = req.req_pool_idx
                self.dual.alloc_request(slot)
                admission = RequestAdmission.of_request(req)
                self.slot_admission[slot] = admission
                # a fill: `slot_tau[slot] = x` copies a host scalar and waits for the forward in flight
                self.slot_tau.narrow(0, slot, 1).fill_(admission.effective_tau(self.server_tau))
                if self.runtime.evictor is not None:
                    self.slot_bound[slot] = apply_bound(self.runtime, req, slot, admission.kv_budget)
            self.requests_started += len(fresh)
            self.peak_active = max(self.peak_active, int(self.dual.active.sum()))
            if self.runtime.prefix_cache is not None:
                self.runtime.prefix_cache.restore_prefixes(fresh)
            evictor = self.runtime.evictor
            for req in fresh:  # after any restore: a restored prefix may hold another request's choices
                slot = req.req_pool_idx
                self.slot_dense[slot] = (
                    not self.slot_admission[slot].admission
                    and self.slot_bound[slot] is None
                    # the server's --kv-budget holds every slot without a bound of its own
                    and (evictor is None or evictor.request_bound(slot) is None)
                    and not self.dual.cached_len[slot]
                )
        return slots

    def free(self, req):
        slot = req.req_pool_idx
        runtime = self.runtime
        counts = runtime.usage_ledger.counts_for_free(self.dual, slot, runtime.evictor)
        usage = request_usage(
            self.dual,
            slot,
            self.slot_admission[slot],
            runtime.evictor,
            runtime.reduce_usage,
            bound=self.slot_bound[slot],
            counts=counts,
        )
        self.eviction_triggers_released += usage["eviction_triggers"]
        self.evicted_tokens_released += usage["evicted_tokens"]
        if req.finished():  # not on retraction: the request starts over in a new slot
            attach_usage(req, usage)
        super().free(req)
        if runtime.prefix_cache is not None:
            runtime.prefix_cache.slot_freed(slot)
        self.dual.free_request(slot)
        if runtime.evictor is not None:
            runtime.evictor.release_request(slot)
        self.slot_bound[slot] = None
        self.slot_dense[slot] = False
        self.requests_released += 1

    def clear(self):
        super().clear()
        if self.runtime.has_pool():
            for slot in self.dual.active.nonzero()[0].tolist():
                if self.runtime.prefix_cache is not None:
                    self.runtime.prefix_cache.slot_freed(slot)
                self.dual.free_request(slot)
                if self.runtime.evictor is not None:
                    self.runtime.evictor.release_request(slot)
                self.slot_bound[slot] = None
                self.slot_dense[slot] = False
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
            problems.append(
                f"dual-cache pool leaks pages: free={free}, held by snapshots={held}, total={total}"
            )
        try:
            if self.runtime.prefix_cache is not None:
                self.runtime.prefix_cache.check_integrity()
            else:
                self.dual.check_integrity()
        except RuntimeError as e:
            problems.append(f"dual-cache pool integrity: {e}")
        return problems

    def eviction_totals(self) -> dict:
        """Cumulative evictor counters since start (released requests + the active ones)."""
        triggers, tokens = self.eviction_triggers_released, self.evicted_tokens_released
        evictor = self.runtime.evictor
        if evictor is not None:
            for slot in self.dual.active.nonzero()[0].tolist():
                usage = evictor.request_stats(slot)
                triggers += usage["eviction_triggers"]
                tokens += usage["evicted_tokens"]
        return {"eviction_triggers_total": triggers, "evicted_tokens_total": tokens}

    def stats(self) -> dict:
        """Dual-pool occupancy and admission (:meth:`DualCachePool.stats`) plus lifecycle counters."""
        config = self.dual.config
        return {
            **self.dual.stats(),
            "local_window": config.local_window,
            "tau": config.tau,
            "random_admission": config.random_admission,
            "kv_budget": config.kv_budget,
            "page_bytes": self.dual.page_bytes,
            "capacity_mode": self.runtime.plan.mode if self.runtime.plan is not None else None,
            "requests_started": self.requests_started,
            "requests_released": self.requests_released,
            "idle_checks": self.idle_checks,
            "peak_active_requests": self.peak_active,
            "idle_checked_released": self._checked_stamp[1] if self._checked_stamp else None,
            **({"radix": self.runtime.prefix_cache.stats()} if self.runtime.prefix_cache is not None else {}),
            **self.eviction_totals(),
        }
