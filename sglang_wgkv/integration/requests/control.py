"""Per-request admission control and per-request usage, end to end through SGLang's own fields.

Request → scheduler: the client puts ``{"wgkv": {"tau": T}}``, ``{"wgkv": {"admission": false}}`` or
``{"wgkv": {"kv_budget": N}}`` (global tokens kept per layer and KV head, :mod:`~sglang_wgkv.integration.scheduling.long_requests`)
in the sampling parameters' ``custom_params`` (``/generate``: ``sampling_params.custom_params``;
OpenAI: ``extra_body={"custom_params": {...}}``). :func:`validate_sampling_params` runs after
``SamplingParams.verify`` in the tokenizer manager, so a bad value is SGLang's usual 400; the
budget's range (the ring W_local to the context length) is checked there too, by
:func:`check_request_budget`.
:class:`~sglang_wgkv.integration.pools.req_pool.WGKVReqToTokenPool` reads it when it gives the request a
slot and writes the slot's row of ``slot_tau`` (``-inf`` = admission off), which the backend gathers
per token. Such a request also gets its own prefix-cache namespace (:func:`isolate_prefix_cache`).

Scheduler → response: when the request pool frees a finished request's slot it computes
:func:`request_usage` and stores it in ``Req.customized_info["wgkv"]`` at the last output token
(SGLang's per-token channel: scheduler → detokenizer → tokenizer manager ``meta_info``). So
``/generate`` returns ``meta_info["wgkv"]``, a list aligned with the output tokens whose last entry
is the usage dict (earlier entries null); the OpenAI responses get it as ``usage["wgkv"]``:
non-streaming ones in their body (:func:`add_openai_usage`), streaming ones in the final usage chunk
that ``stream_options: {"include_usage": true}`` asks for (:func:`stream_openai_usage`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

from sglang_wgkv.integration.plugin.settings import ENV_VAR
from sglang_wgkv.integration.requests.usage_ledger import read_counts

PARAM_KEY = "wgkv"
USAGE_KEY = "wgkv"
ADMISSION_OFF_TAU = -math.inf


@dataclass(frozen=True)
class RequestAdmission:
    """Per-request admission override. ``tau`` None = the server's τ; ``admission`` False = keep
    every token (dense within the request; the server's budget/evictor still applies);
    ``kv_budget`` None = the server's ``--kv-budget`` (if any), else at most this many global tokens
    per (layer, KV head), enforced by the SnapKV evictor."""

    tau: float | None = None
    admission: bool = True
    kv_budget: int | None = None

    @classmethod
    def parse(cls, raw) -> RequestAdmission:
        """From the ``custom_params["wgkv"]`` value; ValueError with the offending field."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f'custom_params.{PARAM_KEY} must be an object like {{"tau": 0.3}}, got {raw!r}')
        unknown = set(raw) - {"tau", "admission", "kv_budget"}
        if unknown:
            raise ValueError(
                f"custom_params.{PARAM_KEY}: unknown field(s) {sorted(unknown)}; "
                "allowed: tau (number in [0, 1]), admission (bool), kv_budget (integer)"
            )
        tau, admission, budget = raw.get("tau"), raw.get("admission", True), raw.get("kv_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(
                f"custom_params.{PARAM_KEY}.kv_budget must be a positive integer (global tokens per "
                f"layer and KV head), got {budget!r}"
            )
        if not isinstance(admission, bool):
            raise ValueError(f"custom_params.{PARAM_KEY}.admission must be true or false, got {admission!r}")
        if tau is not None:
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
                raise ValueError(f"custom_params.{PARAM_KEY}.tau must be a number in [0, 1], got {tau!r}")
            if not admission:
                raise ValueError(f"custom_params.{PARAM_KEY}: tau has no effect with admission false")
            tau = float(tau)
        return cls(tau=tau, admission=admission, kv_budget=budget)

    @classmethod
    def of_request(cls, req) -> RequestAdmission:
        params = getattr(req.sampling_params, "custom_params", None)
        return cls.parse(params.get(PARAM_KEY) if isinstance(params, dict) else None)

    def cache_key(self) -> str:
        """What separates this request's prefix-cache entries from others' ("" for the server's
        setting): a prefix admitted under one threshold is not the prefix another would keep."""
        if not self.admission:
            return "wgkv:admission=off"
        return "" if self.tau is None else f"wgkv:tau={self.tau!r}"

    def effective_tau(self, server_tau: float) -> float:
        """The threshold the backend applies to this request's rows."""
        if not self.admission:
            return ADMISSION_OFF_TAU
        return server_tau if self.tau is None else self.tau

    def check_budget(self, local_window: int, context_len: int, server_budget: int | None) -> None:
        """ValueError unless ``kv_budget`` (if set) lies in ``[local_window, context_len]`` and, on a
        server with ``--kv-budget`` (whose capacity plan bounds every request by it), at most that."""
        budget, field = self.kv_budget, f"custom_params.{PARAM_KEY}.kv_budget"
        if budget is None:
            return
        if budget < local_window:
            raise ValueError(
                f"{field} {budget} is below the ring (W_local = {local_window} tokens): the last "
                f"W_local tokens of every layer and KV head are always kept, so no request can be "
                f"compressed below them"
            )
        if budget > context_len:
            raise ValueError(f"{field} {budget} is above the context length {context_len}")
        if server_budget is not None and budget > server_budget:
            raise ValueError(
                f"{field} {budget} is above the server's --kv-budget {server_budget}, which its "
                f"capacity plan bounds every request by"
            )


def validate_sampling_params(result, sampling_params, *args, **kwargs):
    """AFTER ``SamplingParams.verify`` (tokenizer manager): reject a malformed ``custom_params.wgkv``."""
    params = sampling_params.custom_params
    if isinstance(params, dict) and PARAM_KEY in params:
        RequestAdmission.parse(params[PARAM_KEY])
    return None


@functools.cache
def _served_config(raw: str | None):
    """The served :class:`WGKVConfig` of the launcher's settings variable ``raw`` (None without WG-KV)."""
    from sglang_wgkv.integration.plugin.settings import ServingSettings

    return None if raw is None else ServingSettings.from_env({ENV_VAR: raw}).config


def check_request_budget(manager, obj, input_ids, *args, **kwargs):
    """BEFORE ``TokenizerManager._validate_one_request``: the range of ``custom_params.wgkv.kv_budget``
    against the served W_local, context length and ``--kv-budget`` (a ValueError is SGLang's 400)."""
    sampling = getattr(obj, "sampling_params", None)
    params = sampling.get("custom_params") if isinstance(sampling, dict) else None
    config = _served_config(os.environ.get(ENV_VAR))
    if config is None or not isinstance(params, dict) or PARAM_KEY not in params:
        return None
    RequestAdmission.parse(params[PARAM_KEY]).check_budget(
        config.local_window, manager.context_len, config.kv_budget
    )
    return None


def isolate_prefix_cache(result, req, *args, **kwargs):
    """AFTER ``Req.__init__`` (scheduler): a request that overrides admission gets its own prefix-cache
    namespace through SGLang's ``extra_key`` (which the radix cache keys on, as for LoRA)."""
    key = RequestAdmission.of_request(req).cache_key()
    if key:
        req.extra_key = (req.extra_key or "") + "|" + key
    return None


def request_usage(
    dual, slot: int, admission: RequestAdmission, evictor=None, reduce=None, bound=None, counts=None
) -> dict:
    """Usage of the request in dual-pool ``slot`` (read before the slot is freed), from ``counts``
    (:class:`~.usage_ledger.SlotCounts`; read from the slot, a sync, when not given).

    ``mean_kv_tokens_per_head``: ring + global tokens per (layer, KV head) at the end;
    ``admitted_fraction``: tokens admitted to the global cache over tokens that left the ring, summed
    over streams (evicted tokens count as admitted; None when no token left the ring);
    ``eviction_triggers``: evictor passes that cut one of its streams (0 without ``--kv-budget``);
    ``early_prompt_compressions``: those before the end of its prompt (the prompt passed the
    evictor's ``prompt_cap``).
    ``kv_budget``: the global tokens per head the request was held to (its own ``kv_budget``, the
    server's ``--kv-budget``, or what the pool held for a request longer than it; None: unbounded),
    ``kv_budget_total``: the global tokens summed over its layers and heads it was held to (a
    request longer than the pool); ``kv_budget_source``: ``request``, ``server`` or ``pool``
    (``bound``: the request's
    :class:`~sglang_wgkv.integration.scheduling.long_requests.RequestBound`, None when it had none of its own).
    ``reduce(sums, maxes) -> (sums, maxes)`` combines the per-rank counts under tensor parallelism
    (each rank's pool holds its own KV heads), so every rank reports the whole model's usage.
    """
    c = counts if counts is not None else read_counts(dual, slot, evictor)
    streams = dual.num_layers * dual.num_kv_heads
    cached = c.cached
    sums = [c.kept, c.evicted, max(cached - dual.window, 0) * streams, streams]
    maxes = [c.triggers, c.max_global, c.early]
    if reduce is not None:
        sums, maxes = reduce(sums, maxes)
    kept, evicted, left, streams = sums
    triggers, max_global, early = maxes
    mean_global = kept / streams
    return {
        "mean_kv_tokens_per_head": mean_global + min(cached, dual.window),
        "mean_global_tokens_per_head": mean_global,
        "max_global_tokens_per_head": max_global,
        "eviction_triggers": triggers,
        "evicted_tokens": evicted,
        "early_prompt_compressions": early,
        "cached_tokens": cached,
        "admitted_fraction": (kept + evicted) / left if left else None,
        "admission": admission.admission,
        "tau": admission.effective_tau(dual.config.tau) if admission.admission else None,
        "kv_budget": bound.budget if bound is not None else dual.config.kv_budget,
        "kv_budget_total": bound.total_budget if bound is not None else None,
        "kv_budget_source": (
            bound.source if bound is not None else ("server" if dual.config.kv_budget is not None else None)
        ),
    }


def attach_usage(req, usage: dict) -> None:
    """Put ``usage`` at the request's last output token in ``Req.customized_info[USAGE_KEY]``."""
    n = len(req.output_ids)
    if n == 0:
        return
    info = dict(req.customized_info or {})
    info[USAGE_KEY] = [None] * (n - 1) + [usage]
    req.customized_info = info


def usage_of(meta_info: dict) -> dict | None:
    """The usage dict carried in ``meta_info[USAGE_KEY]`` (its last non-null entry), if any."""
    values = meta_info.get(USAGE_KEY)
    if not isinstance(values, list):
        return None
    return next((v for v in reversed(values) if v is not None), None)


def merge_usage(per_response: list[dict]) -> dict:
    """One ``usage["wgkv"]`` for a response with several choices: means of the per-head sizes and
    the admitted fraction, sums of the counters, the per-choice dicts under ``choices``."""
    if len(per_response) == 1:
        return per_response[0]
    merged = {"choices": per_response}
    for key in ("mean_kv_tokens_per_head", "mean_global_tokens_per_head"):
        merged[key] = sum(u[key] for u in per_response) / len(per_response)
    for key in ("eviction_triggers", "evicted_tokens", "early_prompt_compressions"):
        merged[key] = sum(u[key] for u in per_response)
    fractions = [u["admitted_fraction"] for u in per_response if u["admitted_fraction"] is not None]
    merged["admitted_fraction"] = sum(fractions) / len(fractions) if fractions else None
    return merged


def add_openai_usage(response, serving, request, ret, *args, **kwargs):
    """AFTER ``OpenAIServingChat._build_chat_response`` / ``OpenAIServingCompletion._build_completion_response``:
    ``usage["wgkv"]`` from the responses' ``meta_info``. ``UsageInfo`` has no extra fields, so the
    response goes out as the same JSON with the one key added."""
    from fastapi.responses import ORJSONResponse

    usages = [u for u in (usage_of(r.get("meta_info", {})) for r in ret) if u is not None]
    if not usages or getattr(response, "usage", None) is None:
        return None
    body = response.model_dump(mode="json")
    body["usage"][USAGE_KEY] = merge_usage(usages)
    return ORJSONResponse(content=body)


class _UsageTap:
    """Stands in for the tokenizer manager of one streaming call: passes everything through and
    records the usage in each choice's ``meta_info`` as ``generate_request`` yields it."""

    def __init__(self, manager):
        self._manager = manager
        self.usages: dict[int, dict] = {}

    def __getattr__(self, name):
        return getattr(self._manager, name)

    async def generate_request(self, *args, **kwargs):
        async for content in self._manager.generate_request(*args, **kwargs):
            usage = usage_of(content.get("meta_info", {}))
            if usage is not None:
                self.usages[content.get("index", 0)] = usage
            yield content


class _ServingView:
    """The OpenAI serving object with its ``tokenizer_manager`` replaced (other attributes delegate)."""

    def __init__(self, serving, manager):
        self._serving, self.tokenizer_manager = serving, manager

    def __getattr__(self, name):
        return getattr(self._serving, name)


async def stream_openai_usage(original, serving, *args, **kwargs):
    """AROUND ``OpenAIServingChat._generate_chat_stream`` / ``OpenAIServingCompletion._generate_completion_stream``:
    the stream unchanged except for its usage chunk (``choices == []``, ``usage`` set), which gets
    ``usage["wgkv"]`` from the streamed ``meta_info`` (merged over choices like :func:`add_openai_usage`)."""
    tap = _UsageTap(serving.tokenizer_manager)
    async for chunk in original(_ServingView(serving, tap), *args, **kwargs):
        if tap.usages and chunk.startswith("data: {") and '"usage"' in chunk:
            body = json.loads(chunk[len("data: ") :])
            if body.get("choices") == [] and isinstance(body.get("usage"), dict):
                body["usage"][USAGE_KEY] = merge_usage([tap.usages[i] for i in sorted(tap.usages)])
                chunk = f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
        yield chunk
