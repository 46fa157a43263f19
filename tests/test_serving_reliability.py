"""Reliability of the wgkv server on CPU: bad input through every entry point, and clients that drop
their streams.

One server (W_local 32, 128-token prefill chunks, gates that admit on KV heads 1-2 and not on head 0,
prefix cache on).

Bad input (:data:`BAD_INPUT`): each case must get a 4xx with a message while the server stays up
and two greedy requests running meanwhile produce exactly what they produce alone. Upstream
SGLang 0.5.17 already answers most of them with 400; the cases marked ``# was`` gave a 500 or killed
the scheduler before ``integration/requests/validation.py``, those marked ``# was 200`` were
accepted: an unknown top-level key of ``/generate`` (dropped silently), and ``/generate`` with
``"stream": true``, which upstream answers with a 200 and the error as the stream's first event
(the ``/generate`` middleware now holds the headers until that event: a 4xx status).

Accepted (:func:`test_accepted_requests_and_valid_streams`): unknown top-level keys of the OpenAI
requests (SGLang's pydantic models ignore them, as OpenAI clients' ``extra_body`` relies on), a
valid ``/generate`` stream (a 200 event stream), and ``n > 1`` with logprobs, which must work with
admission on (:func:`test_parallel_sampling_with_logprobs`).
"""

import asyncio
import json
import threading

import pytest
import requests

from sglang_wgkv.testing.server_pool import shared_server
from sglang_wgkv.testing.serving import long_prompt
from sglang_wgkv.testing.soak import CPU_SERVER_ARGS

pytestmark = pytest.mark.serving

GEN, CHAT, COMP = "/generate", "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]
LONG = long_prompt(500)  # ~6500 tokens, over this server's max_req_input_len
SP = {"max_new_tokens": 4}


def _sp(**kw):
    return {**SP, **kw}


# (name, path, body: dict or raw bytes, substring of the error message)
BAD_INPUT = [
    ("malformed json /generate", GEN, b'{"text": "Hi", "sampling_params": {', "JSON decode error"),
    ("malformed json chat", CHAT, b'{"model": "default", "messages": [', "JSON decode error"),
    ("malformed json completions", COMP, b"not json", "JSON decode error"),
    ("NaN temperature", GEN, b'{"text": "Hi", "sampling_params": {"temperature": NaN}}', "JSON decode error"),
    (
        "Infinity top_p chat",
        CHAT,
        b'{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "top_p": Infinity}',
        "JSON decode error",
    ),
    (
        "NaN tau",
        GEN,
        b'{"text": "Hi", "sampling_params": {"custom_params": {"wgkv": {"tau": NaN}}}}',
        "JSON decode error",
    ),
    ("text not a string", GEN, {"text": 123}, "valid string"),
    ("input_ids a string", GEN, {"input_ids": "abc"}, "input_ids"),
    ("input_ids floats", GEN, {"input_ids": [1.5, 2]}, "input_ids"),
    ("messages a string", CHAT, {"model": "default", "messages": "hi"}, "valid list"),
    ("sampling_params a string", GEN, {"text": "Hi", "sampling_params": "x"}, "sampling_params"),
    (
        "max_new_tokens a string",
        GEN,
        {"text": "Hi", "sampling_params": _sp(max_new_tokens="ten")},  # was 500
        "sampling_params.max_new_tokens",
    ),
    (
        "temperature a string",
        GEN,
        {"text": "Hi", "sampling_params": _sp(temperature="hot")},  # was 500
        "sampling_params.temperature",
    ),
    ("top_k a float", GEN, {"text": "Hi", "sampling_params": _sp(top_k=2.5)}, "sampling_params.top_k"),
    ("stop a number", GEN, {"text": "Hi", "sampling_params": _sp(stop=5)}, "sampling_params.stop"),  # was 500
    (
        "stop_token_ids nested",
        GEN,
        {"text": "Hi", "sampling_params": _sp(stop_token_ids=[[1]])},  # was 500
        "sampling_params.stop_token_ids",
    ),
    (
        "stop_token_ids nested chat",
        CHAT,
        {"model": "default", "messages": MSG, "max_tokens": 4, "stop_token_ids": [[1]]},
        "stop_token_ids",
    ),
    (
        "logit_bias 1e999",
        GEN,
        b'{"text": "Hi", "sampling_params": {"logit_bias": {"5": 1e999}}}',
        "JSON decode error",
    ),
    ("temperature < 0", GEN, {"text": "Hi", "sampling_params": _sp(temperature=-1)}, "temperature"),
    ("top_p 2", GEN, {"text": "Hi", "sampling_params": _sp(top_p=2)}, "top_p"),
    ("max_new_tokens < 0", GEN, {"text": "Hi", "sampling_params": _sp(max_new_tokens=-1)}, "max_new_tokens"),
    (
        "top_logprobs_num > vocab",
        GEN,
        {
            "text": "Hi",
            "return_logprob": True,
            "top_logprobs_num": 10**6,  # was dead
            "sampling_params": SP,
        },
        "top_logprobs_num",
    ),
    (
        "top_logprobs_num < 0",
        GEN,
        {"text": "Hi", "return_logprob": True, "top_logprobs_num": -3, "sampling_params": SP},
        "top_logprobs_num",
    ),
    (
        "tau > 1",
        GEN,
        {"text": "Hi", "sampling_params": _sp(custom_params={"wgkv": {"tau": 2}})},
        "custom_params.wgkv",
    ),
    (
        "tau < 0 chat",
        CHAT,
        {"model": "default", "messages": MSG, "max_tokens": 4, "custom_params": {"wgkv": {"tau": -0.1}}},
        "custom_params.wgkv",
    ),
    (
        "tau a string completions",
        COMP,
        {"model": "default", "prompt": "Hi", "max_tokens": 4, "custom_params": {"wgkv": {"tau": "0.3"}}},
        "custom_params.wgkv",
    ),
    (
        "admission not a bool",
        GEN,
        {"text": "Hi", "sampling_params": _sp(custom_params={"wgkv": {"admission": 0}})},
        "custom_params.wgkv",
    ),
    (
        "wgkv not an object",
        GEN,
        {"text": "Hi", "sampling_params": _sp(custom_params={"wgkv": [0.3]})},
        "custom_params.wgkv",
    ),
    (
        "custom_params a string",
        GEN,
        {"text": "Hi", "sampling_params": _sp(custom_params="x")},  # was ignored
        "custom_params",
    ),
    (
        "one bad tau in a batch",
        GEN,
        {"text": ["Hi", "Yo"], "sampling_params": [SP, _sp(custom_params={"wgkv": {"tau": 5}})]},
        "custom_params.wgkv",
    ),
    (
        "bad tau chat stream",
        CHAT,
        {
            "model": "default",
            "messages": MSG,
            "max_tokens": 4,
            "stream": True,
            "custom_params": {"wgkv": {"tau": 5}},
        },
        "custom_params.wgkv",
    ),
    (
        "bad tau completions stream",
        COMP,
        {
            "model": "default",
            "prompt": "Hi",
            "max_tokens": 4,
            "stream": True,
            "custom_params": {"wgkv": {"tau": 5}},
        },
        "custom_params.wgkv",
    ),
    (
        "bad tau /generate stream",
        GEN,
        {
            "text": "Hi",
            "stream": True,  # was 200
            "sampling_params": _sp(custom_params={"wgkv": {"tau": 5}}),
        },
        "custom_params.wgkv",
    ),
    (
        "unknown sampling param /generate stream",
        GEN,
        {
            "text": "Hi",
            "stream": True,  # was 200
            "sampling_params": _sp(foo=1),
        },
        "unknown field",
    ),
    (
        "over-long text /generate stream",
        GEN,
        {"text": LONG, "stream": True, "sampling_params": SP},  # was 200
        "exceeds the maximum allowed length",
    ),
    (
        "unknown top-level key",
        GEN,
        {"text": "Hi", "sampling_params": SP, "max_new_tokens": 4},  # was 200
        "unknown field(s) ['max_new_tokens']",
    ),
    (
        "unknown top-level key stream",
        GEN,
        {"text": "Hi", "stream": True, "sampling_param": SP},  # was 200
        "unknown field(s) ['sampling_param']",
    ),
    ("id -1", GEN, {"input_ids": [1, -1, 3], "sampling_params": SP}, "outside the vocabulary"),  # was dead
    (
        "id = vocab",
        GEN,
        {"input_ids": [1, 49152], "sampling_params": SP},
        "outside the vocabulary",
    ),  # was dead
    ("id 2^63", GEN, {"input_ids": [1, 2**63], "sampling_params": SP}, "int64"),
    (
        "id out of vocab in a batch",
        GEN,
        {"input_ids": [[1, 2], [3, 10**6]], "sampling_params": SP},  # was dead
        "outside the vocabulary",
    ),
    (
        "id out of vocab completions",
        COMP,
        {"model": "default", "prompt": [1, 10**6], "max_tokens": 4},  # was dead
        "outside the vocabulary",
    ),
    (
        "id out of vocab stream",
        GEN,
        {"input_ids": [1, 10**6], "stream": True, "sampling_params": SP},  # was dead, 200
        "outside the vocabulary",
    ),
    ("over-long text", GEN, {"text": LONG, "sampling_params": SP}, "exceeds the maximum allowed length"),
    (
        "over-long ids",
        GEN,
        {"input_ids": [100] * 10000, "sampling_params": SP},
        "longer than the model's context",
    ),
    (
        "over-long chat",
        CHAT,
        {"model": "default", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4},
        "exceeds the maximum allowed length",
    ),
    (
        "over-long completions",
        COMP,
        {"model": "default", "prompt": LONG, "max_tokens": 4},
        "exceeds the maximum allowed length",
    ),
    (
        "max_new_tokens 1e9",
        GEN,
        {"text": "Hi", "sampling_params": _sp(max_new_tokens=10**9)},
        "context length",
    ),
    (
        "max_tokens 1e9 chat",
        CHAT,
        {"model": "default", "messages": MSG, "max_tokens": 10**9},
        "context length",
    ),
    (
        "unknown sampling param",
        GEN,
        {"text": "Hi", "sampling_params": _sp(foo=1)},
        "unknown field",
    ),  # was 500
    (
        "internal sampling param",
        GEN,
        {"text": "Hi", "sampling_params": _sp(is_normalized=True)},
        "unknown field",
    ),
    (
        "unknown wgkv key",
        GEN,
        {"text": "Hi", "sampling_params": _sp(custom_params={"wgkv": {"x": 1}})},
        "unknown field",
    ),
    ("empty text", GEN, {"text": "", "sampling_params": SP}, "cannot be empty"),
    ("empty messages", CHAT, {"model": "default", "messages": [], "max_tokens": 4}, "cannot be empty"),
]


def test_request_checks_unit():
    from types import SimpleNamespace

    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_wgkv.integration.requests.validation import check_request, check_sampling_params

    frontend = {
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": None,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "ignore_eos": False,
        "regex": None,
    }
    for ok in (
        None,
        {},
        frontend,
        {"temperature": None, "logit_bias": {"5": -2}, "custom_params": {"wgkv": {"tau": 0.3}}},
    ):
        check_sampling_params(ok, SamplingParams)
    for bad, msg in (
        ("x", "an object"),
        ({"foo": 1}, "unknown"),
        ({"stop_strs": ["a"]}, "unknown"),
        ({"max_new_tokens": "4"}, "max_new_tokens"),
        ({"n": True}, "sampling_params.n"),
        ({"top_k": 2.5}, "top_k"),
        ({"logit_bias": {"5": float("nan")}}, "finite"),
    ):
        with pytest.raises(ValueError, match=msg):
            check_sampling_params(bad, SamplingParams)
    manager = SimpleNamespace(
        model_config=SimpleNamespace(vocab_size=100), sampling_params_class=SamplingParams
    )
    req = SimpleNamespace(sampling_params={}, return_logprob=True, top_logprobs_num=100, image_data=None)
    check_request(manager, req, [0, 99])
    with pytest.raises(ValueError, match=r"input_ids\[1\] = 100"):
        check_request(manager, req, [0, 100])
    with pytest.raises(ValueError, match=r"input_ids\[0\] = -1"):
        check_request(manager, req, [-1])
    with pytest.raises(ValueError, match="top_logprobs_num"):
        check_request(manager, SimpleNamespace(**{**vars(req), "top_logprobs_num": 101}), [1])
    check_request(manager, SimpleNamespace(**{**vars(req), "image_data": ["img"]}), [10**6])  # placeholders


def test_generate_body_checks_unit():
    """The /generate middleware in-process, on a stand-in app: unknown top-level keys are a 400
    naming them; a stream whose first event is SGLang's error event, or the scheduler's abort with a
    status, becomes that status with the error as JSON; a stream that starts normally, an abort
    without a status, a non-stream request and other paths pass unchanged."""
    from sglang_wgkv.integration.requests.validation import GenerateBodyChecks

    def app_answering(*chunks, status=200):
        async def app(scope, receive, send):
            request = await receive()
            await send({"type": "http.response.start", "status": status, "headers": []})
            for chunk in chunks or [request["body"]]:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return app

    def call(app, body, path="/generate"):
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        middleware = GenerateBodyChecks(app, fields=frozenset({"text", "stream", "sampling_params"}))
        asyncio.run(middleware({"type": "http", "path": path, "method": "POST"}, receive, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    status, body = call(app_answering(), b'{"text": "Hi", "sampling_param": {}, "foo": 1}')
    assert status == 400 and b"['foo', 'sampling_param']" in body
    assert call(app_answering(), b'{"text": "Hi", "foo": 1}', path="/v1/completions")[0] == 200
    assert call(app_answering(), b'{"text": "Hi"}') == (200, b'{"text": "Hi"}')  # the body is replayed
    assert call(app_answering(), b"not json")[0] == 200  # SGLang's own parser answers

    error = b'data: {"error": {"message": "bad tau", "type": "invalid_request_error", "code": 400}}\n\n'
    status, body = call(app_answering(error, b"data: [DONE]\n\n"), b'{"text": "Hi", "stream": true}')
    assert status == 400 and json.loads(body) == {
        "error": {"message": "bad tau", "type": "invalid_request_error", "code": 400}
    }
    ok = b'data: {"text": "Paris"}\n\n'
    assert call(app_answering(ok, error), b'{"text": "Hi", "stream": true}') == (200, ok + error)
    assert call(app_answering(error), b'{"text": "Hi"}') == (200, error)  # not a stream: untouched
    too_long = (
        b'data: {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Input length '
        b'(6511 tokens) exceeds", "status_code": 400, "err_type": "BadRequestError"}}}\n\n'
    )
    status, body = call(app_answering(too_long), b'{"text": "Hi", "stream": true}')
    assert status == 400 and json.loads(body)["error"]["message"] == "Input length (6511 tokens) exceeds"
    aborted = b'data: {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Abort"}}}\n\n'
    assert call(app_answering(aborted), b'{"text": "Hi", "stream": true}') == (200, aborted)


def _post(server, path, body, timeout=300):
    if isinstance(body, bytes):
        return requests.post(
            server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=timeout
        )
    return requests.post(server.url + path, json=body, timeout=timeout)


# the CPU soak's server (shared with tests/test_soak.py): admission on, KV head 0 keeps no token
server = shared_server(*CPU_SERVER_ARGS)


def _greedy(server, prompt, n):
    return server.generate(prompt, max_new_tokens=n, sampling_params={"ignore_eos": True})["output_ids"]


BYSTANDERS = [(long_prompt(12, seed=5), 48), ("The capital of France is", 32)]


def test_bad_input_is_4xx_and_harmless(server):
    alone = [_greedy(server, p, n) for p, n in BYSTANDERS]
    during = [None] * len(BYSTANDERS)

    def bystander(i):
        during[i] = _greedy(server, *BYSTANDERS[i])

    threads = [threading.Thread(target=bystander, args=(i,)) for i in range(len(BYSTANDERS))]
    for t in threads:
        t.start()
    wrong = []
    for name, path, body, expected in BAD_INPUT:
        r = _post(server, path, body)
        status, message = r.status_code, r.text
        if not (400 <= status < 500 and expected in message):
            wrong.append(f"{name}: {status} {message[:200]}")
        assert server.alive(), f"server died on {name!r}:\n{server.log_tail()}"
    for t in threads:
        t.join(timeout=900)
    assert during == alone
    assert not wrong, "\n".join(wrong)
    stats = server.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]


def test_parallel_sampling_with_logprobs(server):
    """``n > 1`` with logprobs while admission is on: valid, so answered (SGLang prefills the prompt
    once, then forks it: the fork shares the prefix through the snapshot cache). Sampled at temperature
    0.8, a fork may draw EOS before its fourth token, so EOS is ignored where the length is checked."""
    prompt = "The capital of France is"
    r = _post(
        server,
        GEN,
        {
            "text": prompt,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": _sp(n=2, temperature=0.8, ignore_eos=True),
        },
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 2 and all(len(o["meta_info"]["output_token_logprobs"]) == 4 for o in outs)
    r = _post(
        server,
        COMP,
        {"model": "default", "prompt": prompt, "max_tokens": 4, "n": 2, "logprobs": 2, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert [len(c["logprobs"]["tokens"]) for c in r.json()["choices"]] == [4, 4]
    r = _post(
        server,
        CHAT,
        {
            "model": "default",
            "messages": MSG,
            "max_tokens": 4,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "custom_params": {"wgkv": {"tau": 0.5}},
        },
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    stats = server.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]


def test_accepted_requests_and_valid_streams(server):
    """Unknown top-level keys of the OpenAI requests are ignored (SGLang's pydantic semantics); a
    valid ``/generate`` stream is still a 200 event stream, ending with ``[DONE]``."""
    r = _post(server, CHAT, {"model": "default", "messages": MSG, "max_tokens": 2, "foo": 1})
    assert r.status_code == 200 and r.json()["choices"], r.text
    r = _post(server, COMP, {"model": "default", "prompt": "Hi", "max_tokens": 2, "foo": {"bar": 1}})
    assert r.status_code == 200 and r.json()["choices"], r.text
    r = _post(
        server, GEN, {"text": "Hi", "stream": True, "sampling_params": _sp(max_new_tokens=2, ignore_eos=True)}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [line for line in r.text.splitlines() if line.startswith("data:")]
    assert (
        events[-1] == "data: [DONE]"
        and json.loads(events[-2][len("data:") :])["meta_info"]["completion_tokens"] == 2
    )


def _stream(server, path, body, drop_after, out, key):
    """Stream ``body`` into ``out[key]`` (the list of parsed events); with ``drop_after`` events
    received, close the connection without a word (a client that went away)."""
    events = []
    with (
        requests.Session() as session,
        session.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=900) as r,
    ):
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[len(b"data:") :]))
                if len(events) == drop_after:
                    break
    out[key] = events


def _text_of(path, events):
    if path == GEN:
        return events[-1]["text"]
    field = "delta" if path == CHAT else None
    return "".join(
        (c[field].get("content") or "") if field else c["text"] for e in events for c in e["choices"]
    )


KEPT = [
    (
        GEN,
        {
            "text": long_prompt(10, seed=1),
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
        },
    ),
    (
        GEN,
        {
            "text": long_prompt(3, seed=2),
            "sampling_params": {
                "max_new_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
                "custom_params": {"wgkv": {"tau": 0.5}},
            },
        },
    ),
    (
        CHAT,
        {
            "model": "default",
            "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
            "max_tokens": 32,
            "temperature": 0,
        },
    ),
]
DROPPED = [
    (
        GEN,
        {
            "text": long_prompt(20, seed=3),
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        },
        3,
    ),
    (
        GEN,
        {
            "text": long_prompt(6, seed=4),
            "sampling_params": {
                "max_new_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "custom_params": {"wgkv": {"admission": False}},
            },
        },
        1,
    ),
    (
        CHAT,
        {
            "model": "default",
            "messages": [{"role": "user", "content": long_prompt(8, seed=5)}],
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
        },
        4,
    ),
    (
        COMP,
        {
            "model": "default",
            "prompt": long_prompt(15, seed=6),
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
        },
        2,
    ),
]


def test_dropped_streams_release_pages_and_leave_others_unchanged(server):
    alone = {}
    for i, (path, body) in enumerate(KEPT):
        _stream(server, path, body, None, alone, i)
    before = server.wait_idle_checked()
    out = {}
    jobs = [(path, body, None, i) for i, (path, body) in enumerate(KEPT)]
    jobs += [(path, body, drop, f"drop-{i}") for i, (path, body, drop) in enumerate(DROPPED)]
    threads = [threading.Thread(target=_stream, args=(server, *job[:3], out, job[3])) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    for i, (path, _) in enumerate(KEPT):
        assert _text_of(path, out[i]) == _text_of(path, alone[i]), f"kept stream {i} ({path}) changed"
    for i, (_, _, drop) in enumerate(DROPPED):  # (EOS ignored: each was still running when dropped)
        assert len(out[f"drop-{i}"]) == drop
    # SGLang notices a gone client at its next output and aborts the request: slots and pages return
    stats = server.wait_idle_checked(timeout=300)
    assert stats["requests_started"] - before["requests_started"] >= len(KEPT) + len(DROPPED)
    assert stats["requests_started"] == stats["requests_released"]
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]
    assert server.alive()
