"""SGLang's KV pool interface over the dual-cache pool, and the capacity split between the two.

Two address spaces coexist:

    SGLang logical token slots             DualCachePool pages (physical K/V)
    -------------------------------------  ----------------------------------------------
    one slot per cached token of a request per (request slot, layer, KV head): a W_local
    (req_to_token, out_cache_loc); what    ring + admitted global tokens, in 16-token
    the scheduler allocates, retracts and  pages shared by all layers and heads; what
    checks (available + evictable == total) the wgkv attention backend reads and writes

The logical slots carry no K/V here (the placeholder buffers below are a few KB), so SGLang's
scheduling, retraction and leak checks run unchanged while the memory SGLang budgets for the KV
cache is spent on the dual pool's pages.

Capacity rule. The scheduler admits work in logical tokens, so the physical pool must never run out
while the logical one has room. A stream (request, layer, head) holding ``n`` tokens needs at most
``n/16 + 2`` pages, and the pool's step preconditions (:meth:`DualCachePool.begin_extend` /
``begin_decode`` reserve a worst case before writing) at most two more, i.e. ``n + 64`` tokens of
page space per request across its streams. Hence::

    physical tokens = logical tokens + SLACK_TOKENS * request slots

:func:`split_capacity` applies this to the token count SGLang derived from its memory budget (or
``--max-total-tokens``): the dual pool gets the whole budget, the logical pool the remainder, and
``PoolExhausted`` cannot happen during a forward. Admission alone makes the physical use smaller
than the logical one but, the scheduler counting logical tokens, admits no more requests than a dense
pool would; the bounded mode below and the overcommit mode (:mod:`.overcommit`: a larger logical
pool, the scheduler checking the physical pool before each forward) turn the headroom into concurrency.

Bounded mode (``--kv-budget B`` with chunked prefill). The SnapKV evictor cuts every stream back to
``B`` global tokens at each step boundary, so a request's physical footprint no longer grows with its
context: between steps a stream holds its ring (``W_local/16`` pages) and at most ``ceil(B/16)``
global pages. One step adds at most, per stream, one page per decoding request, or ``ceil(n/16) + 1``
pages per extending request of ``n`` new tokens, and SGLang puts at most ``chunked_prefill_size`` (C)
new tokens into one extend batch. In dense-token units (one token = ``layers x KV heads / 16``
pages)::

    physical tokens >= R * (W_local + 16 ceil(B/16) + 32 + evictor window) + 16 ceil(C/16)

holds for ``R`` request slots whatever their lengths, so :func:`bounded_split` gives SGLang ``R`` slots
and a logical pool of ``R x context length`` tokens: admission is limited by request slots only (more
concurrent requests than a dense pool of the same memory whenever contexts exceed the per-request
bound), and ``PoolExhausted`` still cannot happen during a forward; requests beyond ``R`` queue.

With prefix caching (:mod:`radix_ext`) a request restored from a snapshot holds a private copy of a
ring whose tokens the tree already counts: up to ``W_local + 16`` tokens per stream more. The split
then also reserves that much for ``restore_slots`` requests (:func:`restore_reserve`), and the radix
cache lets no more restored requests run at once. Snapshot pages need no reserve: the cache drops
them whenever a step would not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_wgkv.config import PAGE_SIZE
from sglang_wgkv.memory import DualCachePool

SLACK_TOKENS = 4 * PAGE_SIZE
# At most this fraction of the budget goes to per-request slack; past it, fewer request slots.
MAX_SLACK_FRACTION = 0.25


@dataclass(frozen=True)
class CapacitySplit:
    logical_tokens: int       # SGLang's max_total_num_tokens
    max_requests: int         # SGLang's max_running_requests (request slots)
    physical_tokens: int      # dual-pool capacity, in tokens of all layers and heads
    restore_slots: int = 0    # prefix-restored requests that may run at once
    max_request_tokens: int | None = None  # overcommit: longest request (integration/overcommit.py)


# At most this fraction of the budget is reserved for the ring copies of prefix-restored requests.
MAX_RESTORE_FRACTION = 0.125


def restore_reserve(budget_tokens: int, max_requests: int, local_window: int) -> tuple[int, int]:
    """``(restore_slots, reserved tokens)`` for prefix caching: at least one restored request, at
    most half the request slots, within :data:`MAX_RESTORE_FRACTION` of the budget where possible."""
    ring = local_window + PAGE_SIZE
    slots = max(1, min(max(1, max_requests // 2), int(budget_tokens * MAX_RESTORE_FRACTION) // ring))
    return slots, slots * ring


def split_capacity(budget_tokens: int, max_running_requests: int,
                   prefix_cache_window: int | None = None) -> CapacitySplit:
    """Split SGLang's KV budget (in dense tokens) between the logical and the physical pool;
    ``prefix_cache_window`` (W_local) when the radix cache is on.

    Raises ValueError when the budget cannot hold one request's slack plus a useful remainder.
    """
    requests = min(max_running_requests, int(budget_tokens * MAX_SLACK_FRACTION) // SLACK_TOKENS)
    if requests < 1:
        raise ValueError(
            f"WG-KV needs a KV budget of at least {int(SLACK_TOKENS / MAX_SLACK_FRACTION)} tokens "
            f"(got {budget_tokens}); raise --max-total-tokens or the memory fraction"
        )
    slots, reserve = 0, 0
    if prefix_cache_window is not None:
        slots, reserve = restore_reserve(budget_tokens, requests, prefix_cache_window)
    logical = budget_tokens - SLACK_TOKENS * requests - reserve
    if logical < budget_tokens // 2:
        raise ValueError(f"WG-KV with prefix caching needs a larger KV budget than {budget_tokens} tokens "
                         f"for W_local = {prefix_cache_window}; raise --max-total-tokens or pass "
                         f"--disable-radix-cache")
    return CapacitySplit(logical, requests, budget_tokens, slots)


def request_bound_tokens(kv_budget: int, local_window: int) -> int:
    """Dense-token equivalent of one request's pages between steps in bounded mode (ring + budget)."""
    return local_window + PAGE_SIZE * -(-kv_budget // PAGE_SIZE)


def bounded_split(budget_tokens: int, max_running_requests: int, *, kv_budget: int, local_window: int,
                  chunk_tokens: int, context_len: int, window_tokens: int = 0,
                  prefix_cache: bool = False) -> CapacitySplit | None:
    """The bounded-mode split (module docstring) of SGLang's KV budget, or None when the budget cannot
    hold one request plus the extend reserve. ``window_tokens``: the evictor's query window per request
    slot (also carved from the budget); ``physical_tokens`` is what is left for the dual pool. With
    ``prefix_cache``, snapshots pinned between a match and their restore (at most ``restore_slots``)
    get a reserve of one request bound each (unpinned snapshots are dropped when a step needs room)."""
    steady = request_bound_tokens(kv_budget, local_window)
    per_request = steady + 2 * PAGE_SIZE + window_tokens
    fixed = PAGE_SIZE * -(-chunk_tokens // PAGE_SIZE)

    def fit(reserve: int) -> int:
        return min(max_running_requests, (budget_tokens - fixed - reserve) // per_request)

    requests, slots = fit(0), 0
    if prefix_cache and requests >= 1:
        cap = max(1, int(budget_tokens * MAX_RESTORE_FRACTION) // (steady + PAGE_SIZE))
        slots = max(1, min(requests // 2, cap))
        requests = fit(slots * (steady + PAGE_SIZE))
    if requests < 1:
        return None
    return CapacitySplit(logical_tokens=requests * context_len, max_requests=requests,
                         physical_tokens=budget_tokens - requests * window_tokens, restore_slots=slots)


def evictor_window_tokens(num_q_heads: int, num_kv_heads: int, window: int) -> int:
    """The evictor's query window of one request slot (``window`` queries of every query head and
    layer), in dense-token equivalents of KV memory (one token = K and V of every KV head and layer)."""
    return -(-num_q_heads * window // (2 * num_kv_heads))


def physical_pages(physical_tokens: int, num_layers: int, num_kv_heads: int) -> int:
    """Pages that hold ``physical_tokens`` dense tokens of every layer and KV head."""
    return physical_tokens * num_layers * num_kv_heads // PAGE_SIZE


class WGKVTokenToKVPool(MHATokenToKVPool):
    """An ``MHATokenToKVPool`` whose K/V live in a :class:`DualCachePool` (``self.dual``).

    Constructed by SGLang's ``KVCacheConfigurator._build_mha_kv_pool`` with its usual arguments
    (``functools.partial`` supplies ``dual``). ``size`` is the logical token count. Only the
    ``wgkv`` attention backend may touch the K/V: the token-slot accessors raise.
    """

    def __init__(self, size: int, *args, dual: DualCachePool, prefix_restore_slots: int = 0,
                 overcommit_request_tokens: int | None = None, **kwargs):
        self.dual = dual
        self.prefix_restore_slots = prefix_restore_slots  # read by radix_ext's cache factory
        # set in overcommit mode: the scheduler-side guard (integration/overcommit.py) is on
        self.overcommit_request_tokens = overcommit_request_tokens
        super().__init__(size, *args, **kwargs)

    def _create_buffers_normal(self):
        # One page of placeholders per layer keeps SGLang's pointer/stride bookkeeping valid.
        shape_k = (self.page_size, self.head_num, self.head_dim)
        shape_v = (self.page_size, self.head_num, self.v_head_dim)
        self.k_buffer = [torch.zeros(shape_k, dtype=self.store_dtype, device=self.device)
                         for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros(shape_v, dtype=self.store_dtype, device=self.device)
                         for _ in range(self.layer_num)]

    def get_kv_size_bytes(self):
        return (self.dual.k_pages.numel() * self.dual.k_pages.element_size(),
                self.dual.v_pages.numel() * self.dual.v_pages.element_size())

    def _token_slot_access(self, *args, **kwargs):
        raise RuntimeError(
            "WGKVTokenToKVPool has no per-token K/V storage; K/V live in the dual-cache pool and "
            "only the 'wgkv' attention backend reads or writes them"
        )

    set_kv_buffer = _token_slot_access
    get_key_buffer = _token_slot_access
    get_value_buffer = _token_slot_access
    get_kv_buffer = _token_slot_access
    move_kv_cache = _token_slot_access
    get_cpu_copy = _token_slot_access
    load_cpu_copy = _token_slot_access
