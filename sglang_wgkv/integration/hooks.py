"""The HookRegistry hooks of the WG-KV plugin (registered in :mod:`sglang_wgkv.integration.plugin`;
the request-control and metrics hooks are listed there and live in their own modules).

Every hook is inert unless ``--attention-backend wgkv`` is selected.

======================================================  ======  ==========================================
target (sglang.srt. ...)                                type    effect with wgkv
======================================================  ======  ==========================================
server_args.ServerArgs.__post_init__                    BEFORE  validate options; radix_ext cache, graphs
...KVCacheConfigurator._derive_pool_sizes               AFTER   capacity split (bounded with --kv-budget)
...KVCacheConfigurator._build_default_req_pool          AROUND  WGKVReqToTokenPool (request lifecycle)
...KVCacheConfigurator._build_token_to_kv_pool          AROUND  DualCachePool + WGKVTokenToKVPool
...SchedulerInvariantChecker._check_req_pool            AFTER   idle: no slot, no page held, integrity
managers.scheduler.Scheduler.get_internal_state         AFTER   ``wgkv`` stats in /server_info
utils.common.support_triton                             AROUND  False on CPU (SGLang decides by name)
model_executor.forward_batch_info.ForwardBatch.init_new AFTER   host copy of the batch's request slots
managers.scheduler.Scheduler.init_model_worker          AFTER   overcommit: cap one request's length
managers.schedule_batch.ScheduleBatch.check_decode_mem  AFTER   overcommit: the dual pool holds the step
managers.schedule_policy.PrefillAdder.add_one_req       AROUND  overcommit: the dual pool holds the prompt
managers.schedule_policy.PrefillAdder.add_chunked_req   AROUND  overcommit: reserve the chunked prompt
======================================================  ======  ==========================================
"""

from __future__ import annotations

import functools
import logging

import msgspec

from sglang_wgkv.integration.settings import BACKEND_NAME, ServingSettings

logger = logging.getLogger(__name__)

CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
# capacity split of each KV-cache configurator, from _derive_pool_sizes to _build_token_to_kv_pool
# (the configurator takes no new attributes)
_SPLITS: dict = {}
INVARIANT_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"


def wgkv_selected(server_args) -> bool:
    return server_args.attention_backend == BACKEND_NAME


def prepare_server_args(server_args, *args, **kwargs):
    """BEFORE ``ServerArgs.__post_init__``: reject what the wgkv backend cannot run, select radix_ext's
    snapshot radix cache unless ``--disable-radix-cache`` (snapshots are restored into request slots
    between scheduling and the forward, so the overlap scheduler is off with it), turn off prefill
    CUDA graphs (extend gathers context on the host) and decode CUDA graphs where the backend cannot
    run under them (:meth:`ServingSettings.decode_graph_blocker`: CPU, reference attention)."""
    chosen = {server_args.attention_backend, server_args.prefill_attention_backend,
              server_args.decode_attention_backend} - {None}
    if BACKEND_NAME not in chosen:
        return None
    if chosen != {BACKEND_NAME}:
        raise ValueError(f"--attention-backend {BACKEND_NAME} cannot be mixed with other prefill/decode "
                         f"backends (got {sorted(chosen)}): its KV cache lives in its own pool")
    server_args.attention_backend = BACKEND_NAME
    unsupported = {
        "--speculative-algorithm": server_args.speculative_algorithm is not None,
        "--enable-mixed-chunk": server_args.enable_mixed_chunk,
        "--enable-two-batch-overlap": server_args.enable_two_batch_overlap,
        "--enable-pdmux": server_args.enable_pdmux,
        "--enable-hierarchical-cache": server_args.enable_hierarchical_cache,
        "--pp-size > 1": server_args.pp_size > 1,
        "--dp-size > 1": server_args.dp_size > 1,
        "--page-size > 1 (SGLang's pages are logical here; the dual pool pages itself)":
            server_args.page_size not in (None, 1),
        "--kv-cache-dtype other than auto/bf16/fp16/fp32":
            server_args.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"),
    }
    bad = [flag for flag, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"--attention-backend {BACKEND_NAME} does not support {', '.join(bad)}")
    if not server_args.disable_radix_cache:
        from radix_ext.factory import RADIX_BACKEND

        if server_args.radix_cache_backend not in (None, RADIX_BACKEND):
            raise ValueError(f"--attention-backend {BACKEND_NAME} needs --radix-cache-backend {RADIX_BACKEND} "
                             f"or --disable-radix-cache, got {server_args.radix_cache_backend!r}")
        if ServingSettings.from_env().overcommit is not None:
            raise ValueError("--wgkv-overcommit needs --disable-radix-cache")
        server_args.radix_cache_backend = RADIX_BACKEND
        server_args.disable_overlap_schedule = True
    server_args.disable_prefill_cuda_graph = True
    blocker = ServingSettings.from_env().decode_graph_blocker(server_args.device, server_args.dtype)
    if blocker:  # (also fails here, in the launcher, on a malformed settings variable)
        logger.info("wgkv: decode CUDA graphs off: %s", blocker)
        server_args.disable_decode_cuda_graph = True
    return None


def split_pool_sizes(sizes, configurator, *args, **kwargs):
    """AFTER ``_derive_pool_sizes``: with ``--wgkv-overcommit``, the overcommit split
    (:mod:`~sglang_wgkv.integration.overcommit`); with ``--kv-budget`` and chunked prefill, the bounded split
    (request slots from the per-request bound, logical pool = slots x context length; see
    :mod:`~sglang_wgkv.integration.kv_pool`); otherwise the logical pool is the budget minus
    per-request slack. The split is kept for :func:`build_kv_pool` (same configurator, same process)."""
    if not wgkv_selected(configurator.server_args):
        return None
    from sglang_wgkv.integration.kv_pool import bounded_split, evictor_window_tokens, split_capacity

    args, mc = configurator.server_args, configurator.model_config
    settings = ServingSettings.from_env()
    config = settings.config
    split = None
    chunk = args.chunked_prefill_size
    if settings.overcommit is not None:
        from sglang_wgkv.integration.overcommit import overcommit_split

        split = overcommit_split(sizes.max_total_num_tokens, sizes.max_running_requests, settings.overcommit)
        logger.info("wgkv: overcommit x%g: KV budget %d tokens -> %d logical tokens, %d request slots, "
                    "requests of at most %d tokens", settings.overcommit, split.physical_tokens,
                    split.logical_tokens, split.max_requests, split.max_request_tokens)
    elif config.kv_budget is not None and chunk is not None and chunk > 0:
        window = evictor_window_tokens(mc.num_attention_heads, mc.num_key_value_heads,
                                       min(256, config.local_window))
        split = bounded_split(sizes.max_total_num_tokens, sizes.max_running_requests,
                              kv_budget=config.kv_budget, local_window=config.local_window, chunk_tokens=chunk,
                              context_len=mc.context_len, window_tokens=window,
                              prefix_cache=not args.disable_radix_cache)
        if split is None:
            logger.warning("wgkv: KV budget %d tokens cannot hold one request under --kv-budget %d plus a "
                           "prefill chunk of %d; using the dense-equivalent split (lower "
                           "--chunked-prefill-size for the bounded one)", sizes.max_total_num_tokens,
                           config.kv_budget, chunk)
        else:
            logger.info("wgkv: bounded mode: KV budget %d tokens -> %d request slots of at most %d tokens "
                        "each, %d logical tokens, %d prefix-restore slots", sizes.max_total_num_tokens,
                        split.max_requests, config.local_window + config.kv_budget, split.logical_tokens,
                        split.restore_slots)
    if split is None:
        if config.kv_budget is not None:
            sizes = _carve_evictor_windows(sizes, mc, config)
        window = None if args.disable_radix_cache else config.local_window
        split = split_capacity(sizes.max_total_num_tokens, sizes.max_running_requests, prefix_cache_window=window)
        logger.info("wgkv: KV budget %d tokens -> %d logical tokens, %d request slots, %d prefix-restore slots",
                    split.physical_tokens, split.logical_tokens, split.max_requests, split.restore_slots)
    _SPLITS[id(configurator)] = split
    return msgspec.structs.replace(sizes, max_total_num_tokens=split.logical_tokens,
                                   max_running_requests=split.max_requests)


def _carve_evictor_windows(sizes, model_config, config):
    """With ``--kv-budget`` the evictor keeps ``min(256, W_local)`` queries per (request slot, layer):
    that memory comes out of SGLang's KV budget, and at most a quarter of the budget goes to it (fewer
    request slots past that), so the process stays inside the memory SGLang planned for."""
    from sglang_wgkv.integration.kv_pool import evictor_window_tokens

    per_request = evictor_window_tokens(model_config.num_attention_heads,
                                        model_config.num_key_value_heads, min(256, config.local_window))
    budget = sizes.max_total_num_tokens
    requests = min(sizes.max_running_requests, max(1, budget // 4 // per_request))
    logger.info("wgkv: evictor query windows take %d tokens of the KV budget (%d request slots)",
                requests * per_request, requests)
    return msgspec.structs.replace(sizes, max_total_num_tokens=budget - requests * per_request,
                                   max_running_requests=requests)


def build_req_pool(original, configurator, *, max_num_reqs: int, extra_max_context_len: int):
    """AROUND ``_build_default_req_pool``: the request pool that owns dual-cache slot lifetimes."""
    if not wgkv_selected(configurator.server_args):
        return original(configurator, max_num_reqs=max_num_reqs, extra_max_context_len=extra_max_context_len)
    from sglang.srt.runtime_context import get_exec

    from sglang_wgkv.integration.req_pool import WGKVReqToTokenPool

    return WGKVReqToTokenPool(
        size=max_num_reqs,
        max_context_len=configurator.model_config.context_len + extra_max_context_len,
        device=configurator.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
    )


def build_kv_pool(original, configurator, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    """AROUND ``_build_token_to_kv_pool``: the dual-cache pool, behind SGLang's MHA pool interface."""
    if not wgkv_selected(configurator.server_args):
        return original(configurator, sizes=sizes, is_dsa_model=is_dsa_model, is_dsv4_model=is_dsv4_model,
                        req_to_token_pool=req_to_token_pool)
    from sglang.srt.runtime_context import get_parallel

    from sglang_wgkv.integration.kv_pool import WGKVTokenToKVPool, physical_pages
    from sglang_wgkv.integration.req_pool import WGKVReqToTokenPool
    from sglang_wgkv.memory import DualCachePool

    mc = configurator.model_config
    if (configurator.use_mla_backend or configurator.is_hybrid_swa or configurator.mambaish_config
            or is_dsa_model or is_dsv4_model or mc.head_dim != mc.v_head_dim):
        raise ValueError(f"--attention-backend {BACKEND_NAME} supports plain multi-head/GQA attention "
                         f"models (Llama, Qwen3), not {mc.hf_config.architectures}")
    if not isinstance(req_to_token_pool, WGKVReqToTokenPool):
        raise ValueError(f"--attention-backend {BACKEND_NAME} needs its request pool, "
                         f"got {type(req_to_token_pool).__name__}")
    num_layers = configurator.layer_info.num_effective_layers
    num_kv_heads = mc.get_num_kv_heads(get_parallel().attn_tp_size)
    split = _SPLITS.pop(id(configurator))  # set by split_pool_sizes
    if (split.logical_tokens, split.max_requests) != (sizes.max_total_num_tokens, sizes.max_running_requests):
        raise RuntimeError(f"wgkv: pool sizes {sizes} differ from the capacity split {split}")
    physical_tokens, restore_slots = split.physical_tokens, split.restore_slots
    dual = DualCachePool(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=mc.head_dim,
        num_pages=physical_pages(physical_tokens, num_layers, num_kv_heads),
        max_requests=req_to_token_pool.req_to_token.shape[0],
        max_context_len=req_to_token_pool.max_context_len,
        config=ServingSettings.from_env().config, dtype=configurator.kv_cache_dtype,
        device=configurator.device,
    )
    req_to_token_pool.attach(dual)
    return configurator._build_mha_kv_pool(
        max_total_num_tokens=sizes.max_total_num_tokens,
        mha_pool_class=functools.partial(WGKVTokenToKVPool, dual=dual, prefix_restore_slots=restore_slots,
                                         overcommit_request_tokens=split.max_request_tokens),
    )


def check_idle_pool(result, checker, *args, **kwargs):
    """AFTER ``SchedulerInvariantChecker._check_req_pool`` (runs when the scheduler is idle)."""
    from sglang.srt.environ import envs
    from sglang.srt.utils.common import raise_error_or_warn

    from sglang_wgkv.integration.req_pool import WGKVReqToTokenPool

    pool = checker.req_to_token_pool
    if not isinstance(pool, WGKVReqToTokenPool):
        return None
    problems = pool.idle_check()
    if problems:
        raise_error_or_warn(checker, envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get(),
                            "count_req_pool_leak_warnings", "wgkv: " + "; ".join(problems))
    return None


def add_internal_state(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_internal_state``: ``internal_states[i]["wgkv"]`` in ``/server_info``."""
    from sglang_wgkv.integration.req_pool import WGKVReqToTokenPool

    pool = scheduler.req_to_token_pool
    if isinstance(pool, WGKVReqToTokenPool):
        result.internal_state["wgkv"] = pool.stats()
    return None


def support_triton(original, backend: str) -> bool:
    """AROUND ``support_triton``: SGLang picks Triton helpers (positions, req_to_token writes) by
    backend name and lists only its own CPU backends as Triton-free; ``wgkv`` on CPU is one too."""
    if backend == BACKEND_NAME:
        from sglang.srt.utils import is_cpu

        return not is_cpu()
    return original(backend)
