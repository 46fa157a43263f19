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
``PoolExhausted`` cannot happen during a forward. Admission makes the physical use smaller than the
logical one; turning that headroom into more concurrent requests is the evictor/scale work.
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


def split_capacity(budget_tokens: int, max_running_requests: int) -> CapacitySplit:
    """Split SGLang's KV budget (in dense tokens) between the logical and the physical pool.

    Raises ValueError when the budget cannot hold one request's slack plus a useful remainder.
    """
    requests = min(max_running_requests, int(budget_tokens * MAX_SLACK_FRACTION) // SLACK_TOKENS)
    if requests < 1:
        raise ValueError(
            f"WG-KV needs a KV budget of at least {int(SLACK_TOKENS / MAX_SLACK_FRACTION)} tokens "
            f"(got {budget_tokens}); raise --max-total-tokens or the memory fraction"
        )
    return CapacitySplit(budget_tokens - SLACK_TOKENS * requests, requests, budget_tokens)


def physical_pages(physical_tokens: int, num_layers: int, num_kv_heads: int) -> int:
    """Pages that hold ``physical_tokens`` dense tokens of every layer and KV head."""
    return physical_tokens * num_layers * num_kv_heads // PAGE_SIZE


class WGKVTokenToKVPool(MHATokenToKVPool):
    """An ``MHATokenToKVPool`` whose K/V live in a :class:`DualCachePool` (``self.dual``).

    Constructed by SGLang's ``KVCacheConfigurator._build_mha_kv_pool`` with its usual arguments
    (``functools.partial`` supplies ``dual``). ``size`` is the logical token count. Only the
    ``wgkv`` attention backend may touch the K/V: the token-slot accessors raise.
    """

    def __init__(self, size: int, *args, dual: DualCachePool, **kwargs):
        self.dual = dual
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
