"""radix_ext's ``SnapshotRadixCache`` over a dual pool, without a server: what a runtime gives it (its
pool, restore slots and forward fence), and a prompt snapshotted as a server's cache call does. The
radix cache's units and ``benchmarks.reclaim_syncs`` drive the cache through these."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_wgkv.integration.plugin.forward_fence import ForwardFence


def snapshot_cache(dual, fence: ForwardFence | None = None, restore_slots: int = 2):
    """The cache over ``dual`` (page size 1 to SGLang, as a server runs it), ordering its pool work by
    ``fence`` (a fresh one: nothing to wait for)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from radix_ext.snapshot_radix_cache import SnapshotRadixCache

    runtime = SimpleNamespace(
        dual=dual,
        plan=SimpleNamespace(restore_slots=restore_slots),
        forward_fence=fence if fence is not None else ForwardFence(),
        attach_prefix_cache=lambda cache: None,
    )
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1
    )
    return SnapshotRadixCache(params, runtime)


def snapshot_prompt(cache, slot: int, tokens: list[int]) -> None:
    """SGLang's insert of the prompt ``tokens`` that slot ``slot`` holds, then its cache call at the
    prompt's end (the slot's snapshot on the node there)."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache.insert(InsertParams(key=RadixKey(tokens), value=torch.arange(len(tokens))))
    req = SimpleNamespace(req_pool_idx=slot, origin_input_ids=tokens, output_ids=[], extra_key=None)
    cache._snapshot_request(req, path_len=len(tokens), priority=0)
