"""Memory for WG-KV: a device-side page allocator and the dual-cache (ring + global) paged pool."""

from sglang_wgkv.memory.dual_pool import DualCachePool, PoolIntegrityError
from sglang_wgkv.memory.page_allocator import PageAllocator, PoolExhausted

__all__ = ["DualCachePool", "PageAllocator", "PoolExhausted", "PoolIntegrityError"]
