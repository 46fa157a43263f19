"""Request checks that turn bad input into SGLang's usual 400 instead of a 500 or a dead scheduler.

Measured on SGLang 0.5.17 (``tests/test_serving_reliability.py`` holds the whole table): the HTTP
layer already answers 400 for malformed JSON (NaN and Infinity included: its JSON parser rejects
them), wrong container types, over-long prompts and the ranges ``SamplingParams.verify`` knows.
What it does not catch, closed here by one check in the tokenizer manager before a request is
tokenized into a scheduler request (each a ValueError, which SGLang answers with a 400):

* prompt token ids outside ``[0, vocab_size)`` (``/generate`` ``input_ids``, OpenAI completions
  with a token-id prompt) reach the embedding lookup and kill the scheduler (``IndexError``; on
  CUDA a device-side assert). SGLang has an in-vocabulary check but never calls it.
* ``top_logprobs_num`` above the vocabulary (or negative) kills the scheduler in ``topk``.
* a sampling parameter of the wrong scalar type (``"max_new_tokens": "ten"``) or an unknown one
  is a ``TypeError`` (500) in the length check or the ``SamplingParams`` constructor, which checks
  no types; some pass and fail later in the scheduler (``"top_k": 2.5``). Each key is checked
  against ``SamplingParams``' own fields and annotations.
* a non-finite ``logit_bias`` value passes ``verify`` and makes the sampler's probabilities NaN
  (HTTP's JSON parser rejects NaN and 1e999 already; the offline ``sglang.Engine`` does not).

Valid requests are untouched. Beyond the failures above, a ``custom_params`` that is not an object
(SGLang accepted and ignored it, so a request's ``wgkv`` settings were silently lost) and SGLang's
internal fields (``is_normalized`` would skip its normalization) are rejected too.

``/generate`` also gets an ASGI middleware (:class:`GenerateBodyChecks`, added to SGLang's app just
before uvicorn starts), because two of its answers happen where no hook reaches:

* unknown top-level keys (``{"txt": ...}``, ``{"sampling_param": ...}``): the HTTP layer builds the
  request dataclass and drops them, so a typo silently ran with defaults. Now a 400 naming them.
  The fields SGLang's own clients add (:data:`CLIENT_FIELDS`, the router's ``model``) pass.
  The OpenAI endpoints keep SGLang's pydantic semantics (unknown keys ignored, as the OpenAI
  clients' ``extra_body`` and other servers' extensions rely on).
* ``"stream": true``: SGLang sends the 200 headers before tokenizing and reports a rejected request
  as the stream's first event (``"code": 400``; a prompt over the context, rejected by the
  scheduler, as a first event that is an abort with ``"status_code": 400``). The middleware holds
  the headers until the first event: a rejection there (:func:`rejection`) becomes the HTTP status
  with the error as JSON, as a non-streamed request gets it; anything else is sent on unchanged.
  Holding the headers costs a client nothing: the first event is the first token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import msgspec
import orjson

# SamplingParams fields that SGLang sets itself (normalize); a client setting them would skip or
# corrupt that processing (``is_normalized`` skips ``__post_init__``).
_INTERNAL_FIELDS = frozenset(
    {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"}
)


@functools.cache
def _field_types(cls) -> dict[str, object]:
    """The annotated type of each client-settable field of a ``SamplingParams`` (sub)class."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in cls.__struct_fields__ if name not in _INTERNAL_FIELDS}


def check_sampling_params(params, params_class) -> None:
    """Raise ValueError unless ``params`` (one request's ``sampling_params`` dict, as sent) has only
    fields of ``params_class``, each of its declared type (an int where a float is declared is
    fine; a bool or a string where a number is declared is not; None everywhere), and finite ``logit_bias`` values."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be an object, got {params!r}")
    types = _field_types(params_class)
    unknown = sorted(set(params) - set(types))
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {unknown}")
    for name, value in params.items():
        if value is None:  # every field takes None (default; OpenAI requests send None for unset ones)
            continue
        try:
            msgspec.convert(value, types[name], strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params.{name}: {e} ({value!r})") from None
    bias = params.get("logit_bias")
    if bias:
        bad = {k: v for k, v in bias.items() if not math.isfinite(v)}
        if bad:
            raise ValueError(f"sampling_params.logit_bias values must be finite numbers, got {bad}")


def check_request(manager, obj, input_ids, *args, **kwargs):
    """BEFORE ``TokenizerManager._validate_one_request(obj, input_ids)`` (one request of a possibly
    batched call, prompt tokenized): its sampling parameters, ``top_logprobs_num`` and prompt ids.
    The id range is not checked for multimodal requests, whose prompts carry placeholder ids."""
    vocab = manager.model_config.vocab_size
    if hasattr(obj, "sampling_params"):
        check_sampling_params(obj.sampling_params, manager.sampling_params_class)
    top = getattr(obj, "top_logprobs_num", None)
    if getattr(obj, "return_logprob", False) and isinstance(top, int) and not 0 <= top <= vocab:
        raise ValueError(f"top_logprobs_num must be in [0, {vocab}], got {top}")
    multimodal = any(getattr(obj, f, None) for f in ("image_data", "video_data", "audio_data"))
    if input_ids and not multimodal and not 0 <= min(input_ids) <= max(input_ids) < vocab:
        bad = next(i for i, t in enumerate(input_ids) if not 0 <= t < vocab)
        raise ValueError(f"input_ids[{bad}] = {input_ids[bad]} is outside the vocabulary [0, {vocab})")
    return None


GENERATE_PATH = "/generate"
# Top-level /generate fields that SGLang's own clients send though GenerateReqInput has none: the
# router (sglang-router) forwards every body with ``model`` (its model id, or null); SGLang ignores it.
CLIENT_FIELDS = frozenset({"model"})


def json_object(body: bytes) -> dict | None:
    """The request body as a JSON object, or None (SGLang's own parser answers anything else)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def rejection(chunk: bytes) -> tuple[int, dict] | None:
    """``(status, body)`` when ``chunk``, a stream's first event, rejects the request, else None.

    Two shapes, as a non-streamed request would get them: SGLang's error event (``data: {"error":
    {..., "code": 400}}``: the tokenizer manager's checks, before the request is scheduled), and the
    scheduler's abort with a status (``meta_info.finish_reason = {"type": "abort", "status_code": 400,
    "message": ...}``, e.g. a prompt over the context), which a non-streamed request gets as that
    status. An abort without a status (``/abort_request``, a client that left) is no rejection."""
    if not chunk.startswith(b"data: {"):
        return None
    try:
        event = orjson.loads(chunk[len(b"data: ") :])
    except orjson.JSONDecodeError:
        return None
    error = event.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        return (code if isinstance(code, int) and 400 <= code < 600 else 400), {"error": error}
    meta = event.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    code = finish.get("status_code") if isinstance(finish, dict) and finish.get("type") == "abort" else None
    if isinstance(code, int) and 400 <= code < 600:
        return code, {
            "error": {"message": finish.get("message", ""), "type": finish.get("err_type"), "code": code}
        }
    return None


async def _send_json(send, status: int, payload: dict) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _FirstEventStatus:
    """An ASGI ``send`` that holds ``http.response.start`` until the first non-empty body chunk:
    a :func:`rejection` there is sent as a JSON error response with its status (whatever SGLang
    sends after it, ``[DONE]``, is dropped), anything else goes out unchanged after the held start."""

    def __init__(self, send):
        self.send = send
        self.start = None
        self.state = "holding"  # -> "passing" | "replaced"

    async def __call__(self, message) -> None:
        if self.state == "passing":
            return await self.send(message)
        if self.state == "replaced":
            return None
        if message["type"] == "http.response.start":
            self.start = message
            return None
        if message["type"] != "http.response.body" or self.start is None:
            return await self.send(message)
        chunk = message.get("body", b"")
        if not chunk and message.get("more_body", False):
            return None
        error = rejection(chunk) if self.start["status"] == 200 else None
        if error is not None:
            self.state = "replaced"
            return await _send_json(self.send, *error)
        self.state = "passing"
        await self.send(self.start)
        return await self.send(message)


class GenerateBodyChecks:
    """ASGI middleware of ``POST/PUT /generate`` (see the module docstring); other paths pass through."""

    def __init__(self, app, fields: frozenset[str]):
        self.app = app
        self.fields = fields

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["path"] != GENERATE_PATH
            or scope["method"] not in ("POST", "PUT")
        ):
            return await self.app(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending its body
                return None
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        obj = json_object(body) or {}
        unknown = sorted(set(obj) - self.fields)
        if unknown:
            return await _send_json(
                send,
                400,
                {
                    "error": {
                        "message": (f"unknown field(s) {unknown} in the {GENERATE_PATH} request body"),
                        "type": "invalid_request_error",
                        "code": 400,
                    }
                },
            )
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # from here on: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, _FirstEventStatus(send) if obj.get("stream") is True else send)


def install_generate_checks(*args, **kwargs):
    """BEFORE ``http_server._setup_and_run_http_server`` (the launcher, before uvicorn builds the
    app's middleware stack): adds :class:`GenerateBodyChecks` to SGLang's app."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields = frozenset(f.name for f in dataclasses.fields(GenerateReqInput)) | CLIENT_FIELDS
    http_server.app.add_middleware(GenerateBodyChecks, fields=fields)
    return None
