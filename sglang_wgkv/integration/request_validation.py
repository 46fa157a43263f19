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
"""

from __future__ import annotations

import functools
import math
import typing

import msgspec

# SamplingParams fields that SGLang sets itself (normalize); a client setting them would skip or
# corrupt that processing (``is_normalized`` skips ``__post_init__``).
_INTERNAL_FIELDS = frozenset({"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                              "is_normalized"})


@functools.lru_cache(maxsize=None)
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
