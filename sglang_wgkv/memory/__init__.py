"""Memory for WG-KV: a device-side page allocator, the dual-cache (ring + global) paged pool and the
SnapKV evictor that bounds the global cache."""

from sglang_wgkv.memory.dual_pool import DualCachePool
from sglang_wgkv.memory.evictor import SnapKVEvictor
from sglang_wgkv.memory.page_allocator import PageAllocator, PoolExhausted
from sglang_wgkv.memory.pool_integrity import PoolIntegrityError

__all__ = ["DualCachePool", "PageAllocator", "PoolExhausted", "PoolIntegrityError", "SnapKVEvictor"]
