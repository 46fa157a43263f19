"""The ``wgkv_snapshot`` radix-cache backend: its name, SGLang factory and registration."""

from __future__ import annotations

RADIX_BACKEND = "wgkv_snapshot"


def create_cache(ctx):
    """``RadixCacheFactory`` for :data:`RADIX_BACKEND` (SGLang's ``TreeCacheBuildContext`` in)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from radix_ext.snapshot_radix_cache import SnapshotRadixCache
    from sglang_wgkv.integration.kv_pool import WGKVTokenToKVPool
    from sglang_wgkv.integration.req_pool import WGKVReqToTokenPool

    if ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)
    params = ctx.params
    kv = params.token_to_kv_pool_allocator.get_kvcache()
    if not isinstance(params.req_to_token_pool, WGKVReqToTokenPool) or not isinstance(kv, WGKVTokenToKVPool):
        raise ValueError(f"--radix-cache-backend {RADIX_BACKEND} needs --attention-backend wgkv")
    if params.page_size != 1:
        raise ValueError(f"--radix-cache-backend {RADIX_BACKEND} needs --page-size 1")
    return SnapshotRadixCache(params, restore_slots=kv.prefix_restore_slots)


def register() -> None:
    """Idempotent: plugins load more than once per process in some SGLang entry paths."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(RADIX_BACKEND) is None:
        register_radix_cache_backend(RADIX_BACKEND, create_cache)
