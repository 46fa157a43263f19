"""The ``wgkv_snapshot`` radix-cache backend: its name, SGLang factory and registration."""

from __future__ import annotations

RADIX_BACKEND = "wgkv_snapshot"


def create_cache(ctx):
    """``RadixCacheFactory`` for :data:`RADIX_BACKEND` (SGLang's ``TreeCacheBuildContext`` in)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    from radix_ext.snapshot_radix_cache import SnapshotRadixCache
    from sglang_wgkv.integration.plugin.runtime import get_runtime, has_runtime

    if ctx.disable_radix_cache:
        return default_radix_cache_factory(ctx)
    params = ctx.params
    runtime = get_runtime() if has_runtime() else None
    if runtime is None or getattr(params.req_to_token_pool, "runtime", None) is not runtime:
        raise ValueError(f"--radix-cache-backend {RADIX_BACKEND} needs --attention-backend wgkv")
    if params.page_size != 1:
        raise ValueError(f"--radix-cache-backend {RADIX_BACKEND} needs --page-size 1")
    return SnapshotRadixCache(params, runtime)


def register() -> None:
    """Idempotent: plugins load more than once per process in some SGLang entry paths."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(RADIX_BACKEND) is None:
        register_radix_cache_backend(RADIX_BACKEND, create_cache)
