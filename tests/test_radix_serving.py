"""Prefix caching with admission (radix_ext) in a real CPU server.

One server (W_local = 32, 64-token prefill chunks, so snapshots land every 64 tokens and prompts
leave the ring). "Radix off" is the same server with ``/flush_cache`` before every request: every
prompt is then prefilled from scratch, exactly what ``--disable-radix-cache`` does. Greedy outputs
must be identical; the hit rate (``meta_info.cached_tokens``) and wall times are printed (``-s``).
"""

import json
import os
import random
import threading
import time

import pytest
import requests

from sglang_wgkv.testing.server_pool import ShippedGates, shared_server
from sglang_wgkv.testing.serving import flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = [pytest.mark.serving, pytest.mark.radix]

NEW_TOKENS = 6


server = shared_server(
    "--model-path", ShortModel(), "--wgkv-local-window", "32", "--chunked-prefill-size", "64",
    "--wgkv-gates", ShippedGates(32, SHORT_LAYERS),
)  # fmt: skip


def _run(server, prompts, cold: bool):
    """Sequential greedy generations: (output ids, cached tokens, prompt tokens, seconds) each."""
    out = []
    for p in prompts:
        if cold:
            flush_cache(server)
        t = time.perf_counter()
        o = server.generate(p, max_new_tokens=NEW_TOKENS)
        dt = time.perf_counter() - t
        m = o["meta_info"]
        out.append((o["output_ids"], m["cached_tokens"], m["prompt_tokens"], dt))
    return out


def _compare(name, server, prompts):
    cold = _run(server, prompts, cold=True)
    flush_cache(server)
    warm = _run(server, prompts, cold=False)
    assert [c[0] for c in cold] == [w[0] for w in warm]
    assert all(c[1] == 0 for c in cold)
    hit = sum(w[1] for w in warm) / sum(w[2] for w in warm)
    t_cold, t_warm = sum(c[3] for c in cold), sum(w[3] for w in warm)
    print(
        f"\n{name}: hit rate {hit:.1%} ({sum(w[1] for w in warm)}/{sum(w[2] for w in warm)} prompt tokens), "
        f"wall {t_cold:.2f} s cold vs {t_warm:.2f} s warm ({NEW_TOKENS} new tokens per request)"
    )
    stats = server.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]
    return hit, stats


def test_shared_system_prompt_same_outputs_with_hits(server):
    system = long_prompt(16)  # ~200 tokens shared
    prompts = [f"{system} Question {i}: which item has number {i}?" for i in range(5)]
    hit, stats = _compare("shared system prompt", server, prompts)
    assert hit > 0.4  # requests 2..5 resume from the last 64-token boundary inside the prefix
    assert stats["radix"]["prefix_hits"] >= 4


def test_multi_turn_chat_same_outputs_with_hits(server):
    # each turn's prompt is the previous prompt + the greedy reply + a new user line
    flush_cache(server)
    turns, text = [], "User: " + long_prompt(6) + "\nAssistant:"
    for i in range(4):
        o = server.generate(text, max_new_tokens=NEW_TOKENS)
        turns.append(text)
        text = text + o["text"] + f"\nUser: and item {i + 2}?\nAssistant:"
    hit, _ = _compare("multi-turn chat", server, turns)
    assert hit > 0.4


def _stream(server, rid, prompt, abort_after, results):
    body = {
        "text": prompt,
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    last, chunks = None, 0
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=900) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks, last = chunks + 1, line
                if chunks == abort_after:
                    requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=60)
    results[rid] = json.loads(last[len(b"data:") :])["meta_info"] if last else None


# the 500-request soak runs in the soak tier (WGKV_RADIX_SOAK=N to change it); the default run
# sends the first SMOKE_RANDOM of the same requests
N_RANDOM = int(os.environ.get("WGKV_RADIX_SOAK", "500"))
SMOKE_RANDOM = 60


@pytest.mark.parametrize("n_jobs", [SMOKE_RANDOM, pytest.param(N_RANDOM, marks=pytest.mark.soak)])
def test_random_requests_with_aborts_keep_integrity(server, n_jobs):
    rng = random.Random(0)
    prefixes = [long_prompt(n, seed=s) for n, s in ((8, 1), (14, 2), (20, 3))]
    jobs = [
        (
            f"rnd-{i}",
            rng.choice(prefixes)[: rng.randint(60, 400)] + f" Q{rng.randint(0, 999)}?",
            rng.choice([None, None, None, 1, 3]),
        )
        for i in range(n_jobs)
    ]
    results = {}
    for start in range(0, n_jobs, 6):  # six concurrent streams at a time
        threads = [
            threading.Thread(target=_stream, args=(server, *job, results)) for job in jobs[start : start + 6]
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
    assert len(results) == n_jobs and server.alive()
    assert sum(m["cached_tokens"] for m in results.values() if m) > 0
    stats = server.wait_idle_checked()  # strict idle check: a leak kills the scheduler
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]
    assert (
        server.generate("The capital of France is", max_new_tokens=4)["meta_info"]["completion_tokens"] == 4
    )
    flush_cache(server)
    stats = server.wait_idle_checked()
    assert stats["radix"]["snapshots"] == 0 and stats["free_pages"] == stats["total_pages"]


def _ids_run(server, ids_list, cold: bool):
    """Greedy generations from token ids: (output ids, cached tokens) each."""
    out = []
    for ids in ids_list:
        if cold:
            flush_cache(server)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
        r = requests.post(server.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        out.append((r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]))
    return out


def test_branch_points_get_snapshots(server):
    """A prompt sharing more of the tree than the deepest snapshot ends its first chunk where the
    shared part ends, so the next request sharing it resumes there (branch_split.py). Chunks of 64,
    W_local 32: three prompts sharing 250 tokens resume from 192 (the last chunk boundary A left),
    then 250; the same 300-token prompt thrice: nothing, 256, then 299 (SGLang matches at most S - 1);
    greedy outputs as from an empty cache."""
    rng = random.Random(7)
    shared = [rng.randrange(200, 4000) for _ in range(250)]
    branches = [shared + [rng.randrange(200, 4000) for _ in range(10)] for _ in range(3)]
    same = [rng.randrange(200, 4000) for _ in range(300)]
    prompts = [*branches, same, same, same]
    cold = _ids_run(server, prompts, cold=True)
    flush_cache(server)
    warm = _ids_run(server, prompts, cold=False)
    assert [c[0] for c in cold] == [w[0] for w in warm]
    assert [w[1] for w in warm] == [0, 192, 250, 0, 256, 299]
    stats = server.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]
