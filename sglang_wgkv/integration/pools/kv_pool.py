"""SGLang's KV pool interface over the dual-cache pool.

Two address spaces coexist:

    SGLang logical token slots             DualCachePool pages (physical K/V)
    -------------------------------------  ----------------------------------------------
    one slot per cached token of a request per (request slot, layer, KV head): a W_local
    (req_to_token, out_cache_loc); what    ring + admitted global tokens, in 16-token
    the scheduler allocates, retracts and  pages shared by all layers and heads; what
    checks (available + evictable == total) the wgkv attention backend reads and writes

The logical slots carry no K/V here (the placeholder buffers below are a few KB), so SGLang's
scheduling, retraction and leak checks run unchanged while the memory SGLang budgets for the KV
cache is spent on the dual pool's pages. How that memory is split between the two is the capacity
plan (:mod:`~sglang_wgkv.integration.pools.capacity`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

if TYPE_CHECKING:
    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime


class WGKVTokenToKVPool(MHATokenToKVPool):
    """An ``MHATokenToKVPool`` whose K/V live in the runtime's :class:`DualCachePool` (``self.dual``).

    Constructed by SGLang's ``KVCacheConfigurator._build_mha_kv_pool`` with its usual arguments
    (``functools.partial`` supplies ``runtime``). ``size`` is the logical token count. Only the
    ``wgkv`` attention backend may touch the K/V: the token-slot accessors raise.
    """

    def __init__(self, size: int, *args, runtime: WGKVRuntime, **kwargs):
        self.runtime = runtime
        self.dual = runtime.dual
        super().__init__(size, *args, **kwargs)

    def _create_buffers_normal(self):
        # One page of placeholders per layer keeps SGLang's pointer/stride bookkeeping valid.
        shape_k = (self.page_size, self.head_num, self.head_dim)
        shape_v = (self.page_size, self.head_num, self.v_head_dim)
        self.k_buffer = [
            torch.zeros(shape_k, dtype=self.store_dtype, device=self.device) for _ in range(self.layer_num)
        ]
        self.v_buffer = [
            torch.zeros(shape_v, dtype=self.store_dtype, device=self.device) for _ in range(self.layer_num)
        ]

    def get_kv_size_bytes(self):
        return (
            self.dual.k_pages.numel() * self.dual.k_pages.element_size(),
            self.dual.v_pages.numel() * self.dual.v_pages.element_size(),
        )

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
