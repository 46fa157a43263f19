"""The WG-KV runtime of one scheduler process: settings, capacity plan, dual pool, evictor, prefix cache;
under attention tensor parallelism, the KV heads a rank holds and per-request usage summed over ranks.

SGLang builds a scheduler process's parts in a fixed order and hands none of them a context
argument, so the runtime is created once, by the first pool-building hook, and read through
:func:`get_runtime` (set once; a second :func:`install_runtime` raises)::

    SGLang step (KVCacheConfigurator, ...)     WG-KV                         reads
    -----------------------------------------  ----------------------------  --------------------------
    _derive_pool_sizes        (hook, AFTER)     settings (from the env, the   ServingSettings, sizes
                                                only place), plan_capacity,
                                                install_runtime
    _build_default_req_pool   (hook, AROUND)    runtime.build_pools: dual     plan, model shape
                                                pool, evictor, TP reducer
                                                -> WGKVReqToTokenPool
    _build_token_to_kv_pool   (hook, AROUND)    WGKVTokenToKVPool             runtime.dual, plan
    ModelRunner attention backend               WGKVAttnBackend               settings, dual, evictor,
                                                                              use_kernels
    Scheduler tree cache (radix_ext factory)    SnapshotRadixCache ->         dual, plan.restore_slots
                                                runtime.attach_prefix_cache

The request pool, backend and radix cache get their parts from the runtime; nothing is wired by
setting another object's attributes. The torch/Triton choice (:attr:`WGKVRuntime.use_kernels`) is
made here once and given to the dual pool (Triton promotion) and the backend (Triton attention).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sglang_wgkv.integration.plugin.forward_fence import ForwardFence
from sglang_wgkv.integration.plugin.settings import BACKEND_NAME, ServingSettings
from sglang_wgkv.integration.pools.capacity import CapacityPlan, physical_pages, plan_capacity
from sglang_wgkv.integration.pools.slot_costs import ModelShape
from sglang_wgkv.integration.requests.usage_ledger import UsageLedger
from sglang_wgkv.memory import DualCachePool

if TYPE_CHECKING:
    from sglang_wgkv.memory import SnapKVEvictor

logger = logging.getLogger(__name__)


def rank_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads SGLang's ``QKVParallelLinear`` gives ``tp_rank``: a contiguous block, or one
    replicated head when there are more ranks than KV heads."""
    if tp_size >= total_kv_heads:
        return [tp_rank * total_kv_heads // tp_size]
    per_rank = total_kv_heads // tp_size
    return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def counts_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> bool:
    """Whether ``tp_rank``'s heads count in a sum over ranks: False where the rank before it holds the
    same (replicated) head, so each KV head counts once."""
    earlier = rank_kv_heads(total_kv_heads, tp_size, tp_rank - 1) if tp_rank else []
    return rank_kv_heads(total_kv_heads, tp_size, tp_rank) != earlier


def tp_usage_reducer(counts_heads: bool):
    """Under attention tensor parallelism, a ``reduce`` for
    :func:`~sglang_wgkv.integration.requests.control.request_usage` that sums the per-rank counts over
    the ranks' CPU group (``counts_heads`` False on a rank whose KV head an earlier rank already
    holds, so each head counts once) and takes the maxima; None on one rank. Every rank frees the
    same requests in the same order (SGLang's TP schedulers run in lockstep), so the collective
    cannot deadlock."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    group = get_attn_tp_group()
    if group.world_size == 1:
        return None
    weight = 1 if counts_heads else 0

    def reduce(sums, maxes):
        s = torch.tensor(sums, dtype=torch.float64) * weight
        m = torch.tensor(maxes, dtype=torch.float64)
        torch.distributed.all_reduce(s, group=group.cpu_group)
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return [int(x) for x in s.tolist()], [int(x) for x in m.tolist()]

    return reduce


def kernels_fit(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the GPU kernels (Triton prefill, decode, promotion) can serve a model of ``dtype``."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)


class WGKVRuntime:
    """Parameters
    ----------
    settings : the server's WG-KV settings.
    plan : the capacity plan SGLang's pools were sized with (None for a runtime around a pool
        built elsewhere, e.g. a unit test's).
    dual, evictor : an existing dual pool and evictor; otherwise :meth:`build_pools` builds them.
    use_kernels : see :meth:`choose_kernels`; given explicitly with an existing pool.
    chunk_tokens : SGLang's ``chunked_prefill_size`` (None or <= 0: chunked prefill off), which
        bounds what a prompt holds while it is prefilled (:mod:`~sglang_wgkv.integration.scheduling.long_requests`).
    """

    def __init__(
        self,
        settings: ServingSettings,
        plan: CapacityPlan | None = None,
        *,
        dual: DualCachePool | None = None,
        evictor: SnapKVEvictor | None = None,
        use_kernels: bool = False,
        chunk_tokens: int | None = None,
    ):
        self.settings = settings
        self.chunk_tokens = chunk_tokens
        self.plan = plan
        self._dual = dual
        self._evictor = evictor
        self.use_kernels = use_kernels
        self._prefix_cache = None
        # the last forward launched under the overlap scheduler, which scheduler-side pool ops wait for
        self.forward_fence = ForwardFence()
        # a freed slot's usage counts without a sync behind the forward in flight
        self.usage_ledger = UsageLedger()
        # TP: ``reduce(sums, maxes)`` of request usage over the attention-TP ranks (None on one rank)
        self.reduce_usage: Callable | None = None
        self.kv_heads: list[int] | None = None
        # --wgkv-running-knee: the admission rule past the dense pool's running count (None: off)
        self.running_knee = None
        if settings.running_knee is not None:
            from sglang_wgkv.integration.scheduling.running_knee import RunningKnee

            self.running_knee = RunningKnee(settings.running_knee)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def plan_for(cls, settings: ServingSettings, sizes, configurator) -> WGKVRuntime:
        """The runtime of a scheduler process whose KV budget SGLang's KV-cache ``configurator``
        derived as ``sizes`` (its pools are built later, :meth:`build_pools`)."""
        from sglang.srt.runtime_context import get_parallel

        attn_tp = get_parallel().attn_tp_size
        config, server_args, model_config = (
            settings.config,
            configurator.server_args,
            configurator.model_config,
        )
        shape = ModelShape(
            num_layers=configurator.layer_info.num_effective_layers,
            num_q_heads=model_config.get_num_attention_heads(attn_tp),
            num_kv_heads=model_config.get_num_kv_heads(attn_tp),
            head_dim=model_config.head_dim,
            context_len=model_config.context_len,
            dtype_bytes=torch.empty(0, dtype=configurator.kv_cache_dtype).element_size(),
            query_bytes=torch.empty(0, dtype=model_config.dtype).element_size(),
        )
        plan = plan_capacity(
            sizes.max_total_num_tokens,
            sizes.max_running_requests,
            shape=shape,
            local_window=config.local_window,
            kv_budget=config.kv_budget,
            evictor_window=config.evictor_window,
            overcommit=settings.overcommit,
            chunk_tokens=server_args.chunked_prefill_size,
            prefix_cache=not server_args.disable_radix_cache,
        )
        logger.info(
            "wgkv: %s capacity plan: KV budget %d tokens -> %d logical tokens, %d request slots, "
            "%d physical tokens (%d for per-slot state), %d prefix-restore slots%s%s",
            plan.mode,
            sizes.max_total_num_tokens,
            plan.logical_tokens,
            plan.max_requests,
            plan.physical_tokens,
            plan.fixed_tokens,
            plan.restore_slots,
            f", requests of at most {plan.max_request_tokens} tokens with admission off"
            if plan.max_request_tokens
            else "",
            f", {plan.long_request_rows} bounded requests at once" if plan.long_request_rows else "",
        )
        if plan.prompt_cap is not None:
            logger.info(
                "wgkv: a prompt being prefilled keeps up to %d global tokens per head until its end is "
                "scored; a prompt that admits more is compressed early (logged)",
                plan.prompt_cap,
            )
        runtime = cls(settings, plan, chunk_tokens=server_args.chunked_prefill_size)
        if runtime.running_knee is not None:
            from sglang_wgkv.integration.scheduling.running_knee import scheduler_split

            split = scheduler_split(server_args.tp_size, server_args.pp_size, server_args.dp_size)
            if split:  # ranks the launcher did not see must not admit apart either
                logger.warning("wgkv: the running knee is off: it runs on one scheduler, got %s", split)
                runtime.running_knee = None
        return runtime

    @staticmethod
    def choose_kernels(settings: ServingSettings, device, dtype: torch.dtype) -> bool:
        """The one torch/Triton choice: ``kernels`` (raises where they cannot run), ``reference``,
        or ``auto`` = kernels where they fit (CUDA, fp16/bf16; both paths read every pool dtype
        served, :mod:`~sglang_wgkv.integration.pools.kv_dtype`)."""
        fit = kernels_fit(device, dtype)
        if settings.attention == "kernels" and not fit:
            raise ValueError("--wgkv-attention kernels needs a CUDA device and a float16/bfloat16 model")
        return settings.attention == "kernels" or (settings.attention == "auto" and fit)

    def build_pools(self, configurator, max_requests: int, max_context_len: int) -> DualCachePool:
        """Build the dual pool (and with ``--kv-budget`` the evictor) for ``max_requests`` request
        slots of ``max_context_len`` tokens, on SGLang's KV-cache configurator's device and dtype."""
        from sglang.srt.runtime_context import get_parallel

        if self._dual is not None:
            raise RuntimeError("wgkv: the dual pool of this process is already built")
        mc = configurator.model_config
        if (
            configurator.use_mla_backend
            or configurator.is_hybrid_swa
            or configurator.mambaish_config
            or mc.head_dim != mc.v_head_dim
        ):
            raise ValueError(
                f"--attention-backend {BACKEND_NAME} supports plain multi-head/GQA attention "
                f"models (Llama, Qwen3), not {mc.hf_config.architectures}"
            )
        par = get_parallel()
        num_layers = configurator.layer_info.num_effective_layers
        num_kv_heads = mc.get_num_kv_heads(par.attn_tp_size)
        total_kv_heads = mc.get_total_num_kv_heads()
        self.kv_heads = rank_kv_heads(total_kv_heads, par.attn_tp_size, par.attn_tp_rank)
        if len(self.kv_heads) != num_kv_heads:
            raise ValueError(
                f"rank {par.attn_tp_rank} holds KV heads {self.kv_heads}, its pool {num_kv_heads}"
            )
        self.use_kernels = self.choose_kernels(self.settings, configurator.device, mc.dtype)
        self._dual = DualCachePool(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim,
            num_pages=physical_pages(self.plan.physical_tokens, num_layers, num_kv_heads),
            max_requests=max_requests,
            max_context_len=max_context_len,
            config=self.settings.config,
            dtype=configurator.kv_cache_dtype,
            device=configurator.device,
            triton_decode=self.use_kernels,
            triton_extend=self.use_kernels and self.settings.extend_kernels,
            reclaimer=self._reclaim,
            compute_dtype=mc.dtype,
        )
        config = self.settings.config
        from sglang_wgkv.memory import SnapKVEvictor

        if config.kv_budget is not None:
            self._evictor = SnapKVEvictor(
                pool=self._dual,
                budget=config.kv_budget,
                num_q_heads=mc.get_num_attention_heads(par.attn_tp_size),
                window=config.evictor_window,
                prompt_cap=self.plan.prompt_cap,
                lead=config.evictor_lead,
            )
        else:  # bounded requests only (their own kv_budget, or longer than the dense pool)
            self._evictor = SnapKVEvictor(
                pool=self._dual,
                budget=None,
                num_q_heads=mc.get_num_attention_heads(par.attn_tp_size),
                window=config.long_request_window,
                rows=self.plan.long_request_rows,
            )
        if par.attn_tp_size > 1:
            self.reduce_usage = tp_usage_reducer(
                counts_heads(total_kv_heads, par.attn_tp_size, par.attn_tp_rank)
            )
        return self._dual

    def attach_prefix_cache(self, cache) -> None:
        """Called once by radix_ext's ``SnapshotRadixCache`` (built after the pools): request slots
        then restore matched prefixes, and the pool drops its snapshots when a step needs pages."""
        if self._prefix_cache is not None:
            raise RuntimeError("wgkv: a prefix cache is already attached to this runtime")
        self._prefix_cache = cache

    def _reclaim(self, worst_case: int) -> None:
        """The dual pool's reclaimer: a prefix cache, if any, releases snapshots it can spare."""
        if self._prefix_cache is not None:
            self._prefix_cache.reclaim(worst_case)

    # -- parts ----------------------------------------------------------------------------------
    def has_pool(self) -> bool:
        return self._dual is not None

    @property
    def dual(self) -> DualCachePool:
        if self._dual is None:
            raise RuntimeError("wgkv: the dual pool is not built yet")
        return self._dual

    @property
    def evictor(self) -> SnapKVEvictor | None:
        return self._evictor

    @property
    def prefix_cache(self):
        """radix_ext's ``SnapshotRadixCache``, or None (``--disable-radix-cache``, or not built yet)."""
        return self._prefix_cache


class _SetOnce:
    """The process's runtime. SGLang's hooks and factories receive no context argument, so this is
    the one piece of module state of the integration; it is written once per process."""

    def __init__(self):
        self._runtime: WGKVRuntime | None = None

    def install(self, runtime: WGKVRuntime) -> None:
        if self._runtime is not None:
            raise RuntimeError("wgkv: this process already has a WG-KV runtime")
        self._runtime = runtime

    def get(self) -> WGKVRuntime:
        if self._runtime is None:
            raise RuntimeError(
                f"no WG-KV runtime in this process: it is built with SGLang's KV pools "
                f"under --attention-backend {BACKEND_NAME}"
            )
        return self._runtime

    def installed(self) -> bool:
        return self._runtime is not None


_PROCESS = _SetOnce()


def install_runtime(runtime: WGKVRuntime) -> WGKVRuntime:
    _PROCESS.install(runtime)
    return runtime


def get_runtime() -> WGKVRuntime:
    """This process's runtime; RuntimeError when none was built (``wgkv`` not selected)."""
    return _PROCESS.get()


def has_runtime() -> bool:
    return _PROCESS.installed()


def load_settings() -> ServingSettings:
    """The scheduler process's settings, from the launcher's environment variable (the one read)."""
    return ServingSettings.from_env()
