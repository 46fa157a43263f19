"""Mixed batches served (SGLang's ``--enable-mixed-chunk``): decode rows in the same forward as a
prefill chunk give the greedy outputs of separate forwards, and the forward token budget
(``--wgkv-forward-tokens``) bounds a mixed forward's prefill share.

Two real CPU float32 servers (the short model of ``sglang_wgkv.testing.short_model``) with per-head gates at W_local = 32 (KV head 0 admits nothing, heads 1
and 2 everything, so a decode row's admission decides what later queries see on head 0): ``mixed``
(64-token forward budget, which turns mixed chunks on; no radix cache, so SGLang's overlap scheduler
is on, as in the served benchmarks) and ``separate`` (SGLang's own scheduling, no mixed batch).
Short requests decode while long prompts (several chunks) arrive, so the mixed server runs forwards
of both; the pool counts them.
"""

import json
import threading

import pytest
import requests

from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel
from sglang_wgkv.testing.soak import CPU_SERVER_ARGS

pytestmark = pytest.mark.serving

BUDGET = 64
SHORT = ["The capital of France is", "Write a haiku about the sea.\n", "List three colors:"]
LONG = [long_prompt(25, seed=1), long_prompt(30, seed=2)]  # ~300-360 tokens: several 128-token chunks


# ``separate`` is the reliability tests' server (shared; it also exports metrics); ``mixed`` adds the
# forward budget, turns the radix cache off and times its forwards for the running knee (which at most
# delays a prompt here: the outputs are greedy)
separate_server = shared_server(*CPU_SERVER_ARGS)
mixed_server = shared_server(
    *CPU_SERVER_ARGS,
    "--wgkv-forward-tokens",
    str(BUDGET),
    "--disable-radix-cache",
    "--wgkv-running-knee",
    "8",
)


@pytest.fixture(scope="module")
def servers(separate_server, mixed_server):
    flush_cache(separate_server)  # outputs computed afresh, as on the mixed server
    return mixed_server, separate_server


def _stream(server, prompt, max_new_tokens, first_token: threading.Event, out: dict, key):
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    last = None
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                last = json.loads(line[len(b"data:") :])
                first_token.set()
    out[key] = last["output_ids"]


def _traffic(server, longs=LONG, short_tokens: int = 64, long_tokens: int = 16) -> dict:
    """Short requests decoding ``short_tokens``; once they decode, the ``longs`` prompts arrive
    (``long_tokens`` each)."""
    out, threads = {}, []
    decoding = [threading.Event() for _ in SHORT]
    for i, prompt in enumerate(SHORT):
        threads.append(
            threading.Thread(
                target=_stream, args=(server, prompt, short_tokens, decoding[i], out, ("short", i))
            )
        )
        threads[-1].start()
    for event in decoding:
        assert event.wait(300), "a short request produced no token"
    for i, prompt in enumerate(longs):
        threads.append(
            threading.Thread(
                target=_stream, args=(server, prompt, long_tokens, threading.Event(), out, ("long", i))
            )
        )
        threads[-1].start()
    for t in threads:
        t.join(900)
    assert len(out) == len(SHORT) + len(longs)
    return out


def test_mixed_forwards_give_the_greedy_outputs_of_separate_ones(servers):
    mixed, separate = servers
    got, want = _traffic(mixed), _traffic(separate)
    assert got == want
    stats, plain = mixed.wait_idle_checked(), separate.wait_idle_checked()
    assert stats["mixed_forwards"] > 0, "no mixed batch ran: the test did not exercise decode rows"
    assert plain["mixed_forwards"] == 0
    assert stats["tokens_left_ring"] > 0 and 0 < stats["admitted_fraction"] < 1
    # the budget bounded every mixed forward's prefill share (SGLang's own: 128 less the decode rows)
    assert 0 < stats["mixed_prefill_tokens_max"] <= BUDGET
    knee = stats["running_knee"]  # the launches were timed in the scheduler: a decode step's fixed cost
    assert knee["fixed_step_ms"] > 0 and knee["target_ms"] == pytest.approx(
        9 * knee["fixed_step_ms"], rel=1e-3
    )
    assert "running_knee" not in plain


# a mixed server with the SnapKV evictor (``--kv-budget 16``: streams past the ring are cut); pooled
bounded = shared_server(
    "--model-path", ShortModel(), "--chunked-prefill-size", "128", "--wgkv-local-window", "32",
    "--wgkv-gates", HeadGates((30.0, 30.0, 30.0), 32, SHORT_LAYERS), "--kv-budget", "16",
    "--wgkv-forward-tokens", str(BUDGET), "--disable-radix-cache",
)  # fmt: skip


def test_mixed_forwards_with_the_evictor(bounded):
    """Prompts prefilled beside decoding requests are compressed at their end and the decoding ones
    evicted from: every request completes, the pool's idle check passes."""
    out = _traffic(bounded)
    assert all(len(ids) == (64 if key[0] == "short" else 16) for key, ids in out.items())
    stats = bounded.wait_idle_checked()
    assert stats["mixed_forwards"] > 0 and stats["eviction_triggers_total"] > 0


# the running knee holding a burst (``--wgkv-running-knee 0.01``: past the dense pool's count every
# window with a prefill is over its target), under overcommit so that SGLang's own pool admits past that
# count; the gates admit nothing past the ring, so the 4x logical pool never runs short; SGLang's own
# chunks (128 tokens: each burst prompt takes three passes, so most passes end in a chunked prompt). Pooled
knee_holds = shared_server(
    "--model-path", ShortModel(), "--chunked-prefill-size", "128", "--wgkv-local-window", "32",
    "--wgkv-gates", HeadGates((-30.0, -30.0, -30.0), 32, SHORT_LAYERS), "--wgkv-overcommit", "4",
    "--disable-radix-cache", "--wgkv-running-knee", "0.01", "--max-total-tokens", "1024",
)  # fmt: skip
BURST = [long_prompt(25 + i % 6, seed=10 + i) for i in range(16)]


def test_a_held_burst_loses_nothing(knee_holds):
    """Past the dense count the knee keeps new requests waiting while it runs the chunked prompt's next
    chunk with SGLang's waiting queue out of sight: every request of the burst completes with all its
    tokens, a held prompt's greedy output equals its output alone, the pool's idle check passes."""
    out = _traffic(knee_holds, BURST, short_tokens=48, long_tokens=64)  # shorts first: the knee times a step
    assert sorted(out) == sorted(
        [("short", i) for i in range(len(SHORT))] + [("long", i) for i in range(len(BURST))]
    )
    assert all(len(ids) == (48 if key[0] == "short" else 64) for key, ids in out.items())
    stats = knee_holds.wait_idle_checked()
    knee = stats["running_knee"]
    assert knee["fixed_step_ms"] > 0 and knee["held_chunk_passes"] > 0, knee  # held with a chunk in flight
    alone = {}
    _stream(knee_holds, BURST[-1], 64, threading.Event(), alone, "alone")  # the burst's last, held longest
    assert alone["alone"] == out[("long", len(BURST) - 1)]
    knee_holds.wait_idle_checked()
