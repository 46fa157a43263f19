"""The HookRegistry hooks of the WG-KV plugin (registered in :mod:`sglang_wgkv.integration.plugin.register`;
the request-control, metrics and overlap-scheduler hooks are listed there and live in their own modules).

Every hook is inert unless ``--attention-backend wgkv`` is selected.

======================================================  ======  ==========================================
target (sglang.srt. ...)                                type    effect with wgkv
======================================================  ======  ==========================================
server_args.ServerArgs.__post_init__                    BEFORE  validate options; radix_ext cache, graphs
server_args.ServerArgs.__post_init__                    AFTER   running batch capped at the largest decode graph
server_args.ServerArgs._handle_gpu_memory_settings      AROUND  SGLang's own memory fraction, less a reserve
...KVCacheConfigurator._derive_pool_sizes               AFTER   capacity plan; the process's WGKVRuntime
...KVCacheConfigurator._build_default_req_pool          AROUND  dual pool + evictor; WGKVReqToTokenPool
...KVCacheConfigurator._build_token_to_kv_pool          AROUND  WGKVTokenToKVPool over the dual pool
...SchedulerInvariantChecker._check_req_pool            AFTER   idle: no slot, no page held, integrity
managers.scheduler.Scheduler.get_internal_state         AFTER   ``wgkv`` stats in /server_info
utils.common.support_triton                             AROUND  False on CPU (SGLang decides by name)
model_executor.forward_batch_info.ForwardBatch.init_new AFTER   host copy of the batch's request slots
managers.scheduler.Scheduler.init_req_max_new_tokens   AFTER   overcommit: 400 for a request that can't run
managers.schedule_batch.ScheduleBatch.check_decode_mem  AFTER   overcommit: the dual pool holds the step
...scheduler.Scheduler._get_new_batch_prefill_raw       AROUND  mixed_batches: mixing, forward budget
managers.schedule_policy.PrefillAdder.add_one_req       AROUND  prefill_guard: overcommit / bounded prompts; branch_split
managers.schedule_policy.PrefillAdder.add_chunked_req   AROUND  prefill_guard: the chunked prompt counts
managers.scheduler.Scheduler.run_batch                  BEFORE  overlap: prefix snapshots ahead of launch
managers.scheduler.Scheduler.run_batch                  BEFORE  overlap: usage counts at launch
managers.scheduler.Scheduler.run_batch                  AFTER   overlap: the forward fence
...scheduler.Scheduler.process_batch_result             BEFORE  overlap: results processed (usage)
======================================================  ======  ==========================================
"""

from __future__ import annotations

import functools
import logging
import math

import msgspec

from sglang_wgkv.integration.plugin.settings import BACKEND_NAME, GPU_RESERVE_MIB, ServingSettings
from sglang_wgkv.integration.pools.kv_dtype import SERVED_KV_CACHE_DTYPES

logger = logging.getLogger(__name__)

CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
INVARIANT_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"


def wgkv_selected(server_args) -> bool:
    return server_args.attention_backend == BACKEND_NAME


def prepare_server_args(server_args, *args, **kwargs):
    """BEFORE ``ServerArgs.__post_init__``: reject what the wgkv backend cannot run, select radix_ext's
    snapshot radix cache unless ``--disable-radix-cache`` (the overlap scheduler stays as SGLang sets
    it: :mod:`~sglang_wgkv.integration.plugin.overlap` orders the pool work under it), turn off
    prefill CUDA graphs (extend gathers context on the host) and decode CUDA graphs where the backend
    cannot run under them (:meth:`ServingSettings.decode_graph_blocker`: CPU, reference attention)."""
    chosen = {
        server_args.attention_backend,
        server_args.prefill_attention_backend,
        server_args.decode_attention_backend,
    } - {None}
    if BACKEND_NAME not in chosen:
        return None
    if chosen != {BACKEND_NAME}:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} cannot be mixed with other prefill/decode "
            f"backends (got {sorted(chosen)}): its KV cache lives in its own pool"
        )
    server_args.attention_backend = BACKEND_NAME
    unsupported = {
        "--speculative-algorithm": server_args.speculative_algorithm is not None,
        "--enable-two-batch-overlap": server_args.enable_two_batch_overlap,
        "--enable-pdmux": server_args.enable_pdmux,
        "--enable-hierarchical-cache": server_args.enable_hierarchical_cache,
        "--pp-size > 1": server_args.pp_size > 1,
        "--dp-size > 1": server_args.dp_size > 1,
        "--page-size > 1 (SGLang's pages are logical here; the dual pool pages itself)": server_args.page_size
        not in (None, 1),
        f"--kv-cache-dtype other than {'/'.join(SERVED_KV_CACHE_DTYPES)}": server_args.kv_cache_dtype
        not in SERVED_KV_CACHE_DTYPES,
    }
    bad = [flag for flag, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"--attention-backend {BACKEND_NAME} does not support {', '.join(bad)}")
    settings = ServingSettings.from_env()  # (fails here, in the launcher, on a malformed variable)
    if not server_args.disable_radix_cache:
        from radix_ext.factory import RADIX_BACKEND

        if server_args.radix_cache_backend not in (None, RADIX_BACKEND):
            raise ValueError(
                f"--attention-backend {BACKEND_NAME} needs --radix-cache-backend {RADIX_BACKEND} "
                f"or --disable-radix-cache, got {server_args.radix_cache_backend!r}"
            )
        server_args.radix_cache_backend = RADIX_BACKEND
    server_args.disable_prefill_cuda_graph = True
    blocker = settings.decode_graph_blocker(server_args.device, server_args.dtype)
    if blocker:
        logger.info("wgkv: decode CUDA graphs off: %s", blocker)
        server_args.disable_decode_cuda_graph = True
    return None


def cap_running_requests(result, server_args, *args, **kwargs):
    """AFTER ``ServerArgs.__post_init__``: without ``--max-running-requests``, a wgkv server with decode
    CUDA graphs runs at most its largest captured decode batch. Its pool admits far more than a dense
    one, and a decode step past that batch runs eagerly: on M1D (an H100), 344 running decoded at 5-7K
    tokens/s eagerly against 11K at 193 under graphs (``benchmarks/results/serving/
    M1D_forward_tokens_ab.json``, the 8,192 run's log)."""
    if not wgkv_selected(server_args) or server_args.max_running_requests is not None:
        return result
    from sglang.srt.model_executor.cuda_graph_config import Backend

    decode = server_args.cuda_graph_config.decode
    if decode.backend != Backend.DISABLED and decode.max_bs:
        # resolved ServerArgs are read-only: override() is SGLang's one mutation point after __post_init__
        server_args.override("wgkv", max_running_requests=decode.max_bs)
        logger.info("wgkv: --max-running-requests %d (the largest decode CUDA graph)", decode.max_bs)
    return result


def reserve_gpu_memory(original, server_args, gpu_mem):
    """AROUND ``ServerArgs._handle_gpu_memory_settings``: where SGLang chooses ``mem_fraction_static``
    itself (not given) on a GPU, the wgkv server's is :data:`GPU_RESERVE_MIB` lower, so that what
    the backend holds outside the static pool leaves at least the headroom upstream SGLang leaves.
    A fraction given on the command line is kept as is."""
    chosen_by_sglang = server_args.mem_fraction_static is None
    result = original(server_args, gpu_mem)
    if chosen_by_sglang and gpu_mem and wgkv_selected(server_args):
        before = server_args.mem_fraction_static
        server_args.mem_fraction_static = math.floor((before - GPU_RESERVE_MIB / gpu_mem) * 1000) / 1000
        logger.info(
            "wgkv: --mem-fraction-static %.3g (SGLang's choice %.3g less %d MiB for the backend's "
            "memory outside the pool)",
            server_args.mem_fraction_static,
            before,
            GPU_RESERVE_MIB,
        )
    return result


def split_pool_sizes(sizes, configurator, *args, **kwargs):
    """AFTER ``_derive_pool_sizes``: the capacity plan of the KV budget SGLang derived
    (:func:`~sglang_wgkv.integration.pools.capacity.plan_capacity`) becomes SGLang's logical pool and
    request slots; the process's :class:`~sglang_wgkv.integration.plugin.runtime.WGKVRuntime` keeps it for
    the pool hooks below."""
    if not wgkv_selected(configurator.server_args):
        return None
    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime, install_runtime, load_settings

    plan = install_runtime(WGKVRuntime.plan_for(load_settings(), sizes, configurator)).plan
    return msgspec.structs.replace(
        sizes, max_total_num_tokens=plan.logical_tokens, max_running_requests=plan.max_requests
    )


def build_req_pool(original, configurator, *, max_num_reqs: int, extra_max_context_len: int):
    """AROUND ``_build_default_req_pool``: the runtime builds the dual pool (and evictor); the request
    pool owns the dual-cache slot lifetimes."""
    if not wgkv_selected(configurator.server_args):
        return original(configurator, max_num_reqs=max_num_reqs, extra_max_context_len=extra_max_context_len)
    from sglang.srt.runtime_context import get_exec

    from sglang_wgkv.integration.plugin.runtime import get_runtime
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    runtime = get_runtime()
    pool = WGKVReqToTokenPool(
        size=max_num_reqs,
        max_context_len=configurator.model_config.context_len + extra_max_context_len,
        device=configurator.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        runtime=runtime,
    )
    runtime.build_pools(
        configurator, max_requests=pool.req_to_token.shape[0], max_context_len=pool.max_context_len
    )
    return pool


def build_kv_pool(original, configurator, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    """AROUND ``_build_token_to_kv_pool``: SGLang's MHA pool interface over the runtime's dual pool."""
    if not wgkv_selected(configurator.server_args):
        return original(
            configurator,
            sizes=sizes,
            is_dsa_model=is_dsa_model,
            is_dsv4_model=is_dsv4_model,
            req_to_token_pool=req_to_token_pool,
        )
    from sglang_wgkv.integration.plugin.runtime import get_runtime
    from sglang_wgkv.integration.pools.kv_pool import WGKVTokenToKVPool
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    if is_dsa_model or is_dsv4_model:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} supports plain multi-head/GQA attention "
            f"models (Llama, Qwen3), not {configurator.model_config.hf_config.architectures}"
        )
    if not isinstance(req_to_token_pool, WGKVReqToTokenPool):
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} needs its request pool, "
            f"got {type(req_to_token_pool).__name__}"
        )
    runtime = get_runtime()
    plan = runtime.plan
    if (plan.logical_tokens, plan.max_requests) != (sizes.max_total_num_tokens, sizes.max_running_requests):
        raise RuntimeError(f"wgkv: pool sizes {sizes} differ from the capacity plan {plan}")
    return configurator._build_mha_kv_pool(
        max_total_num_tokens=sizes.max_total_num_tokens,
        mha_pool_class=functools.partial(WGKVTokenToKVPool, runtime=runtime),
    )


def check_idle_pool(result, checker, *args, **kwargs):
    """AFTER ``SchedulerInvariantChecker._check_req_pool`` (runs when the scheduler is idle)."""
    from sglang.srt.environ import envs
    from sglang.srt.utils.common import raise_error_or_warn

    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    pool = checker.req_to_token_pool
    if not isinstance(pool, WGKVReqToTokenPool):
        return None
    problems = pool.idle_check()
    if problems:
        raise_error_or_warn(
            checker,
            envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get(),
            "count_req_pool_leak_warnings",
            "wgkv: " + "; ".join(problems),
        )
    return None


def add_internal_state(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_internal_state``: ``internal_states[i]["wgkv"]`` in ``/server_info``."""
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    pool = scheduler.req_to_token_pool
    if isinstance(pool, WGKVReqToTokenPool):
        result.internal_state["wgkv"] = pool.stats()
        knee = pool.runtime.running_knee
        if knee is not None:
            result.internal_state["wgkv"]["running_knee"] = knee.state()
    return None


def support_triton(original, backend: str) -> bool:
    """AROUND ``support_triton``: SGLang picks Triton helpers (positions, req_to_token writes) by
    backend name and lists only its own CPU backends as Triton-free; ``wgkv`` on CPU is one too."""
    if backend == BACKEND_NAME:
        from sglang.srt.utils import is_cpu

        return not is_cpu()
    return original(backend)
