"""The soak's job kinds (:data:`MIX`, drawn with a fixed seed by
:meth:`~sglang_wgkv.testing.soak.Soak.jobs`), each one request pattern whose answer is checked."""

from __future__ import annotations

import json

from sglang_wgkv.testing.serving import long_prompt

MIX = {
    "generate": 14,
    "generate_tau": 6,
    "generate_dense": 4,
    "stream": 10,
    "stream_abort": 6,
    "stream_drop": 5,
    "chat": 10,
    "chat_stream": 8,
    "completion": 8,
    "program": 7,
    "pressure": 4,
    "bad_input": 10,
}

SYSTEM = "You are a terse assistant. Answer in one short sentence."
BAD = [
    ({"text": "Hi", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"input_ids": [1, 10**7], "sampling_params": {"max_new_tokens": 2}}, "vocabulary"),
    ({"text": "Hi", "sampling_params": {"custom_params": {"wgkv": {"tau": 7}}}}, "custom_params.wgkv"),
    (
        {"text": "Hi", "return_logprob": True, "top_logprobs_num": 10**7, "sampling_params": {}},
        "top_logprobs",
    ),
    ({"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"text": "Hi", "max_new_tokens": 2}, "unknown field"),
]


class SoakJobs:
    """The job kinds of :class:`~sglang_wgkv.testing.soak.Soak` (a mixin: the soak owns ``url``,
    ``config``, ``prefixes``, :meth:`post`, :meth:`fail` and :meth:`stats`); job ``kind`` runs
    ``_<kind>(job, rng)``."""

    def _prompt(self, rng):
        prefix = rng.choice(self.prefixes)
        return prefix[: rng.randint(len(prefix) // 2, len(prefix))] + f" Question {rng.randint(0, 999)}?"

    def _generate_body(self, rng, extra_params=None, n=None):
        n = n or rng.randint(1, self.config.new_tokens)
        return {
            "text": self._prompt(rng),
            "sampling_params": {
                "max_new_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                **(extra_params or {}),
            },
        }, n

    def _check_generate(self, job, out, n, usage_expected=True):
        meta = out["meta_info"]
        if meta["finish_reason"]["type"] != "length" or meta["completion_tokens"] != n:
            self.fail(job, f"expected {n} tokens, got {meta['completion_tokens']} ({meta['finish_reason']})")
        if not usage_expected:
            return None
        usage = (meta.get("wgkv") or [None])[-1]
        if not usage or usage["cached_tokens"] < meta["prompt_tokens"]:
            self.fail(job, f"usage missing or short: {usage}")
        return usage

    def _generate(self, job, rng):
        body, n = self._generate_body(rng)
        r = self.post("/generate", body)
        r.raise_for_status()
        self._check_generate(job, r.json(), n)

    def _generate_tau(self, job, rng):
        tau = rng.choice([0.0, 0.05, 0.3, 0.9])
        body, n = self._generate_body(rng, {"custom_params": {"wgkv": {"tau": tau}}})
        r = self.post("/generate", body)
        r.raise_for_status()
        usage = self._check_generate(job, r.json(), n)
        if usage and usage["tau"] != tau:
            self.fail(job, f"tau {usage['tau']} != {tau}")

    def _generate_dense(self, job, rng):
        body, n = self._generate_body(rng, {"custom_params": {"wgkv": {"admission": False}}})
        r = self.post("/generate", body)
        r.raise_for_status()
        usage = self._check_generate(job, r.json(), n)
        if usage and (usage["admission"] or usage["admitted_fraction"] not in (None, 1.0)):
            self.fail(job, f"admission off but {usage}")

    def _stream_events(self, path, body, stop_after=None, abort_rid=None):
        events = []
        with self.post(path, {**body, "stream": True}, stream=True) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    events.append(json.loads(line[len(b"data:") :]))
                    if len(events) == stop_after:
                        if abort_rid is None:
                            break  # the client goes away
                        self.post("/abort_request", {"rid": abort_rid}).raise_for_status()
        return events

    def _stream(self, job, rng):
        body, n = self._generate_body(rng)
        events = self._stream_events("/generate", body)
        self._check_generate(job, events[-1], n, usage_expected=False)

    def _stream_abort(self, job, rng):
        body, _ = self._generate_body(rng, n=200)
        body["rid"] = f"soak-{self.config.seed}-{job[0]}"
        events = self._stream_events("/generate", body, stop_after=rng.randint(1, 4), abort_rid=body["rid"])
        meta = events[-1]["meta_info"]
        if meta["finish_reason"]["type"] not in ("abort", "length") or meta["completion_tokens"] > 200:
            self.fail(job, f"aborted stream ended as {meta['finish_reason']}")

    def _stream_drop(self, job, rng):
        body, _ = self._generate_body(rng, n=200)
        self._stream_events("/generate", body, stop_after=rng.randint(1, 4))

    def _messages(self, rng):
        turns = [{"role": "system", "content": SYSTEM}]
        for k in range(rng.randint(0, 2)):
            turns += [
                {"role": "user", "content": f"Name a city, number {k}."},
                {"role": "assistant", "content": rng.choice(["Paris.", "Tokyo.", "Lima."])},
            ]
        return turns + [{"role": "user", "content": rng.choice(["What is 2+2?", "Name a river.", "Say hi."])}]

    def _chat(self, job, rng):
        body = {
            "model": "default",
            "messages": self._messages(rng),
            "max_tokens": self.config.new_tokens,
            "temperature": 0,
        }
        if rng.random() < 0.3:
            body["custom_params"] = {"wgkv": {"tau": 0.2}}
        r = self.post("/v1/chat/completions", body)
        r.raise_for_status()
        usage = r.json()["usage"]
        if not 1 <= usage["completion_tokens"] <= self.config.new_tokens or "wgkv" not in usage:
            self.fail(job, f"chat usage {usage}")

    def _chat_stream(self, job, rng):
        body = {
            "model": "default",
            "messages": self._messages(rng),
            "max_tokens": self.config.new_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        events = self._stream_events("/v1/chat/completions", body)
        usage = next((e["usage"] for e in events if e.get("usage") and not e.get("choices")), None)
        if not usage or "wgkv" not in usage:
            self.fail(job, f"no wgkv usage chunk in {len(events)} events")

    def _completion(self, job, rng):
        n = rng.randint(1, self.config.new_tokens)
        r = self.post(
            "/v1/completions",
            {"model": "default", "prompt": self._prompt(rng), "max_tokens": n, "temperature": 0},
        )
        r.raise_for_status()
        usage = r.json()["usage"]
        if not 1 <= usage["completion_tokens"] <= n or "wgkv" not in usage:
            self.fail(job, f"completion usage {usage}")

    def _program(self, job, rng):
        import sglang as sgl

        @sgl.function
        def quiz(s, city):
            s += SYSTEM + f"\nQuestion: In which country is {city}?\nAnswer:"
            s += sgl.gen("country", max_tokens=6, temperature=0, stop=["\n", "."])
            s += "\nIs that in Europe? Answer yes or no.\nAnswer:"
            s += sgl.select("europe", choices=[" yes", " no"])

        with self._lock:
            self.http_requests += 3  # gen, then select's prefix + choices scoring
        state = quiz.run(
            city=rng.choice(["Paris", "Berlin", "Tokyo", "Lima", "Cairo"]),
            backend=sgl.RuntimeEndpoint(self.url),
        )
        if state["europe"] not in (" yes", " no"):
            self.fail(job, f"select answered {state['europe']!r}")

    def _pressure(self, job, rng):
        """A batch of long requests admitted together: their decodes outgrow a small pool, so the
        scheduler retracts some (their slots and pages freed, the requests re-run)."""
        n, c = self.config.pressure_tokens, self.config
        texts = [
            long_prompt(c.pressure_items, seed=rng.randint(0, 2)) + f" Q{rng.randint(0, 99)}"
            for _ in range(c.pressure_batch)
        ]
        r = self.post(
            "/generate",
            {"text": texts, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
        )
        r.raise_for_status()
        for out in r.json():
            self._check_generate(job, out, n)

    def _bad_input(self, job, rng):
        body, expected = rng.choice(BAD)
        r = self.post("/generate", body)
        if not 400 <= r.status_code < 500 or expected not in r.text:
            self.fail(job, f"bad input answered {r.status_code}: {r.text[:200]}")

    # -- run ------------------------------------------------------------------------------------
