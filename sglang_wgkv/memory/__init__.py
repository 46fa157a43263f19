"""Memory for WG-KV: a device-side page allocator, the dual-cache (ring + global) paged pool and the
SnapKV evictor that bounds the global cache."""

from sglang_wgkv.memory.dual_pool import DualCachePool, PoolIntegrityError
from sglang_wgkv.memory.evictor import SnapKVEvictor
from sglang_wgkv.memory.page_allocator import PageAllocator, PoolExhausted

__all__ = ["DualCachePool", "PageAllocator", "PoolExhausted", "PoolIntegrityError", "SnapKVEvictor"]
