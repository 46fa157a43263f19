"""Entry point ``sglang.srt.plugins: wgkv``: registers the ``wgkv`` attention backend and its hooks.

SGLang calls :func:`load_plugin` in the launcher (before parsing arguments) and in every scheduler
subprocess (before building the scheduler), then applies the registered hooks. Nothing else in this
package patches SGLang; see :mod:`sglang_wgkv.integration.plugin.hooks` for the hook table, and
:mod:`sglang_wgkv.integration.requests.constrained` for the constrained-decoding hooks (registered for every
attention backend).
"""

from __future__ import annotations

import multiprocessing

from sglang_wgkv.integration.plugin.settings import BACKEND_NAME


def create_wgkv_backend(model_runner):
    from sglang_wgkv.integration.backend.attn_backend import WGKVAttnBackend

    return WGKVAttnBackend(model_runner)


def load_plugin() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from radix_ext import factory as radix_factory
    from sglang_wgkv.integration.backend.batch_slots import carry_batch_slots, record_batch_slots
    from sglang_wgkv.integration.plugin import hooks, metrics, overlap
    from sglang_wgkv.integration.requests import control as request_control
    from sglang_wgkv.integration.requests import validation as request_validation
    from sglang_wgkv.integration.scheduling import mixed_batches, overcommit, prefill_guard, running_knee

    register_attention_backend(BACKEND_NAME)(create_wgkv_backend)
    radix_factory.register()
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    for target, fn, kind in (
        ("sglang.srt.server_args.ServerArgs.__post_init__", hooks.prepare_server_args, HookType.BEFORE),
        ("sglang.srt.server_args.ServerArgs.__post_init__", hooks.cap_running_requests, HookType.AFTER),
        (
            "sglang.srt.server_args.ServerArgs._handle_gpu_memory_settings",
            hooks.reserve_gpu_memory,
            HookType.AROUND,
        ),
        (f"{hooks.CONFIGURATOR}._derive_pool_sizes", hooks.split_pool_sizes, HookType.AFTER),
        (f"{hooks.CONFIGURATOR}._build_default_req_pool", hooks.build_req_pool, HookType.AROUND),
        (f"{hooks.CONFIGURATOR}._build_token_to_kv_pool", hooks.build_kv_pool, HookType.AROUND),
        (f"{hooks.INVARIANT_CHECKER}._check_req_pool", hooks.check_idle_pool, HookType.AFTER),
        (
            "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
            hooks.add_internal_state,
            HookType.AFTER,
        ),
        ("sglang.srt.utils.common.support_triton", hooks.support_triton, HookType.AROUND),
        (
            "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
            record_batch_slots,
            HookType.AFTER,
        ),
        (
            "sglang.srt.model_executor.runner.eager_runner.EagerRunner.load_batch",
            carry_batch_slots,
            HookType.AFTER,
        ),
        (
            "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens",
            overcommit.check_request_length,
            HookType.AFTER,
        ),
        (
            "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
            overcommit.check_decode_mem,
            HookType.AFTER,
        ),
        (
            "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
            mixed_batches.schedule_prefill,
            HookType.AROUND,
        ),
        (
            "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
            prefill_guard.add_one_req,
            HookType.AROUND,
        ),
        (
            "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
            prefill_guard.add_chunked_req,
            HookType.AROUND,
        ),
        (
            "sglang.srt.sampling.sampling_params.SamplingParams.verify",
            request_control.validate_sampling_params,
            HookType.AFTER,
        ),
        (
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
            request_validation.check_request,
            HookType.BEFORE,
        ),
        (
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
            request_control.check_request_budget,
            HookType.BEFORE,
        ),
        (
            "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._build_chat_response",
            request_control.add_openai_usage,
            HookType.AFTER,
        ),
        (
            "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response",
            request_control.add_openai_usage,
            HookType.AFTER,
        ),
        (
            "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream",
            request_control.stream_openai_usage,
            HookType.AROUND,
        ),
        (
            "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._generate_completion_stream",
            request_control.stream_openai_usage,
            HookType.AROUND,
        ),
        (
            "sglang.srt.managers.schedule_batch.Req.__init__",
            request_control.isolate_prefix_cache,
            HookType.AFTER,
        ),
        (
            "sglang.srt.managers.scheduler.Scheduler.run_batch",
            overlap.snapshot_ahead_of_launch,
            HookType.BEFORE,
        ),
        (
            "sglang.srt.managers.scheduler.Scheduler.run_batch",
            overlap.record_usage_at_launch,
            HookType.BEFORE,
        ),
        ("sglang.srt.managers.scheduler.Scheduler.run_batch", running_knee.observe_launch, HookType.BEFORE),
        ("sglang.srt.managers.scheduler.Scheduler.run_batch", overlap.fence_forward, HookType.AFTER),
        ("sglang.srt.managers.scheduler.Scheduler.run_batch", overlap.refresh_free_pages, HookType.AFTER),
        (
            "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
            overlap.count_processed,
            HookType.BEFORE,
        ),
        ("sglang.srt.managers.scheduler.Scheduler.init_metrics_reporter", metrics.install, HookType.AFTER),
        (
            "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats",
            metrics.log_stats,
            HookType.AFTER,
        ),
    ):
        HookRegistry.register(target, fn, kind)
    if multiprocessing.parent_process() is None:
        # the HTTP app lives in the launcher only: the scheduler processes need not import it
        HookRegistry.register(
            "sglang.srt.entrypoints.http_server._setup_and_run_http_server",
            request_validation.install_generate_checks,
            HookType.BEFORE,
        )
    register_constrained_decoding()


def register_constrained_decoding() -> None:
    """Constrained decoding on the CPU (and a 400, not a crash, where a device cannot mask): not tied to
    the wgkv backend, so the ``--disable-wgkv`` baseline has it too."""
    from sglang_wgkv.integration.requests import constrained

    constrained.register()
