"""SGLang's own frontend test programs (``sglang.test.test_programs``) against a running server, judged
on mechanics: did every request succeed, did every constrained output obey its constraint, is the
server still up. A 135M model's answers are recorded, not required.

Outcome per program:

* ``ok``: the function returned (its own answer checks, where it has any, passed);
* ``answer``: every request succeeded and every constrained output obeyed its regex, but the function
  raised (an answer check, or parsing the model's answer, e.g. ``eval`` in tool_use);
* ``error``: a request failed (HTTP status, connection), a constrained output broke its regex, or the
  server did not answer a one-token request afterwards (:func:`server_healthy`).

Constraint check: the frontend turns ``gen_int`` / ``gen(dtype=...)`` / ``gen(regex=...)`` into a
``regex`` sampling parameter; each such output must match its regex in full when generation ended on
EOS, and be a prefix of a match when it ended on a stop string or the token limit (``regex`` package,
``partial=True``).
"""

from __future__ import annotations

import dataclasses
import time
import traceback

import regex
import requests

# (name, function in sglang.test.test_programs, keyword arguments): the list, in its order.
PROGRAMS = (
    ("few_shot_qa", "test_few_shot_qa", {}),
    ("mt_bench", "test_mt_bench", {}),
    ("select", "test_select", {"check_answer": False}),
    ("decode_int", "test_decode_int", {}),
    ("decode_json_regex", "test_decode_json_regex", {}),
    ("decode_json", "test_decode_json", {}),
    ("regex", "test_regex", {}),
    ("dtype_gen", "test_dtype_gen", {}),
    ("tool_use", "test_tool_use", {}),
    ("react", "test_react", {}),
    ("parallel_decoding", "test_parallel_decoding", {}),
    ("stream", "test_stream", {}),
)


def constraint_violation(pattern: str, text: str, finish_reason: dict | None) -> str | None:
    """Why ``text`` breaks ``pattern`` given how generation ended, or None if it obeys it."""
    ended_on_eos = (finish_reason or {}).get("type") == "stop" and isinstance(
        finish_reason.get("matched"), int
    )
    if ended_on_eos:
        ok = regex.fullmatch(pattern, text) is not None
    else:
        ok = regex.fullmatch(pattern, text, partial=True) is not None
    if ok:
        return None
    return f"{text!r} {'does not match' if ended_on_eos else 'is no prefix of a match of'} {pattern!r}"


def checked_endpoint_class():
    """:class:`RuntimeEndpoint` that records failed requests and constrained outputs, and caps
    ``max_new_tokens`` (None: the programs' own limits)."""
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    class CheckedEndpoint(RuntimeEndpoint):
        def __init__(self, url: str, max_new_tokens: int | None = None):
            super().__init__(url)
            self.max_new_tokens = max_new_tokens
            self.failures: list[str] = []
            self.violations: list[str] = []
            self.constrained_outputs = 0
            self.requests = 0

        def _capped(self, sampling_params):
            if self.max_new_tokens is None or sampling_params.max_new_tokens <= self.max_new_tokens:
                return sampling_params
            return dataclasses.replace(sampling_params, max_new_tokens=self.max_new_tokens)

        def _call(self, method, *args):
            """One request through ``method``; any failure is recorded (the frontend's worker thread
            would otherwise swallow it) and re-raised."""
            self.requests += 1
            try:
                return method(*args)
            except Exception as e:
                self.failures.append(f"{method.__name__}: {type(e).__name__}: {e}"[:300])
                raise

        def generate(self, s, sampling_params):
            sampling_params = self._capped(sampling_params)
            text, meta = self._call(super().generate, s, sampling_params)  # (sets .regex from dtype)
            if sampling_params.regex is not None:
                self.constrained_outputs += 1
                why = constraint_violation(sampling_params.regex, text, meta.get("finish_reason"))
                if why:
                    self.violations.append(why)
            return text, meta

        def generate_stream(self, s, sampling_params):
            self.requests += 1
            try:
                yield from super().generate_stream(s, self._capped(sampling_params))
            except Exception as e:
                self.failures.append(f"generate_stream: {type(e).__name__}: {e}"[:300])
                raise

        def select(self, s, choices, temperature, choices_method):
            return self._call(super().select, s, choices, temperature, choices_method)

    return CheckedEndpoint


def server_healthy(url: str, timeout_s: float = 300) -> bool:
    """Does the server still serve: a one-token greedy ``/generate`` answered within ``timeout_s``.

    Not SGLang's ``/health_generate``: it answers 503 when no output of its own one-token request
    reached the HTTP process within 20 s (``SGLANG_HEALTH_CHECK_TIMEOUT``), which a live scheduler
    on a loaded CPU machine misses. A dead scheduler takes the server down (the request fails), a
    hung one times out here."""
    body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        r = requests.post(url + "/generate", json=body, timeout=timeout_s)
    except requests.RequestException:
        return False
    return r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1


def run_program(url: str, function_name: str, kwargs: dict, max_new_tokens: int | None) -> dict:
    """Run one program against ``url``; its outcome record (see the module docstring)."""
    import sglang as sgl
    from sglang.test import test_programs

    record = {"program": function_name}
    t0 = time.perf_counter()
    try:
        endpoint = checked_endpoint_class()(url, max_new_tokens)
    except Exception as e:  # the server is unreachable: nothing ran
        return {
            **record,
            "outcome": "error",
            "detail": f"endpoint: {type(e).__name__}: {e}"[:500],
            "seconds": 0.0,
        }
    sgl.set_default_backend(endpoint)
    raised = None
    try:
        getattr(test_programs, function_name)(**kwargs)
    except Exception as e:  # judged below: a failed request or a broken constraint is an error
        raised = f"{type(e).__name__}: {e}"[:500]
        record["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
    healthy = server_healthy(url)
    record.update(
        seconds=round(time.perf_counter() - t0, 1),
        requests=endpoint.requests,
        constrained_outputs=endpoint.constrained_outputs,
        failures=endpoint.failures,
        violations=endpoint.violations,
        server_healthy_after=healthy,
    )
    if endpoint.failures or endpoint.violations or not healthy:
        outcome = "error"
    else:
        outcome = "answer" if raised else "ok"
    record.update(outcome=outcome, detail=raised)
    return record


def run_programs(url: str, max_new_tokens: int | None = None, names=None) -> dict:
    """Every program of :data:`PROGRAMS` (or those in ``names``) in order: {name: outcome record}."""
    return {
        name: run_program(url, fn, kwargs, max_new_tokens)
        for name, fn, kwargs in PROGRAMS
        if names is None or name in names
    }
