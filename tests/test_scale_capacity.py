"""Bounded capacity (``--kv-budget`` + chunked prefill, ``integration/pools/kv_pool.py``): a WG-KV server runs
more requests at once than any dense pool of the same KV budget could hold, queues the rest, never
exhausts its physical pool, and keeps every output equal to the request's output run alone.
Also: streaming OpenAI responses carry ``usage["wgkv"]`` in their usage chunk.
"""

import concurrent.futures as cf
import json

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_wgkv.testing.server_pool import shared_server
from sglang_wgkv.testing.serving import embedded_plan, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.scale

BUDGET = 832  # --max-total-tokens: dense tokens of KV memory
W_LOCAL = 16
KV_BUDGET = 16
CHUNK = 128
N_REQUESTS = 10
OUT = 8
STREAMS = SHORT_LAYERS * 3  # the servers' model: the embedded one's first layers, 3 KV heads


def test_bounded_split_arithmetic():
    from sglang_wgkv.integration.pools.capacity import bounded_split, prompt_reserve, request_bound_tokens

    assert request_bound_tokens(4096, 256) == 4352 and request_bound_tokens(33, 16) == 16 + 48
    # P: what the longest prompt admits beyond the budget, at most 1/4 of it
    assert prompt_reserve(10_000, kv_budget=64, local_window=32, context_len=4096) == 2496
    assert prompt_reserve(100_000, kv_budget=64, local_window=32, context_len=4096) == 4096 - 96
    s = bounded_split(
        10_000, 2048, kv_budget=64, local_window=32, chunk_tokens=100, context_len=4096, window_tokens=10
    )
    slot = 32 + 64 + 32
    # nothing is set aside for prompts: every slot is a request's, prompts take free slots' pages
    assert s.max_requests == 10_000 // (slot + 10) and s.prompt_cap == 64 + 2496
    assert s.logical_tokens == s.max_requests * 4096 and s.physical_tokens == 10_000 - 10 * s.max_requests
    assert s.prompt.spare_tokens == s.physical_tokens - s.max_requests * slot >= 0
    assert (
        bounded_split(
            10_000, 5, kv_budget=64, local_window=32, chunk_tokens=100, context_len=4096
        ).max_requests
        == 5
    )
    with_prefix = bounded_split(
        10_000,
        2048,
        kv_budget=64,
        local_window=32,
        chunk_tokens=100,
        context_len=4096,
        window_tokens=10,
        prefix_cache=True,
    )
    assert with_prefix.restore_slots >= 1
    # a restored snapshot may hold a prompt's global part (taken before the prompt's end)
    restored = 32 + 64 + 2496 + 16
    assert with_prefix.max_requests * (slot + 10) + with_prefix.restore_slots * restored <= 10_000


@pytest.mark.parametrize(
    "budget, chunk, cap",
    [
        (600, 256, 64 + 144),  # P = 1/4 of the budget: the longest prompt fits beside nothing else
        (520, 320, 64 + 48),  # it would not (P = 128): P shrinks to the free slots' room, 3 x 128 + 8
        (520, 512, None),  # one chunk's excess alone does not fit: no bounded plan
    ],
)
def test_bounded_split_lets_the_longest_prompt_run(budget, chunk, cap):
    from sglang_wgkv.integration.pools.capacity import bounded_split

    s = bounded_split(budget, 64, kv_budget=64, local_window=32, chunk_tokens=chunk, context_len=4096)
    assert (s.prompt_cap if s else None) == cap
    if s:
        assert s.max_requests == 4 and s.prompt.excess_tokens(4096) <= s.prompt.room(1)


def test_prompt_rule_table():
    from sglang_wgkv.integration.pools.capacity import PromptRule

    # W_local 256, budget 512 (a slot: 256 + 512 + 32), cap 512 + 1024, chunk 2048, 10 slots, 100 spare
    rule = PromptRule(
        local_window=256, slot_tokens=800, cap=1536, chunk_tokens=2048, requests=10, spare_tokens=100
    )
    for prompt_len, excess in [
        (0, 0),
        (752, 0),  # within the slot: ring + 31 pages of global + the 3 spare pages
        (768, 16),  # ring + budget exactly: one page past the slot
        (1024, 272),  # 768 global tokens: 256 past the budget, + 1 page
        (8192, 1536 + 2048 + 48 - 512 - 32),  # capped: cap + one chunk, never the whole prompt
    ]:
        assert rule.excess_tokens(prompt_len) == excess, prompt_len
    assert rule.room(10) == 100 and rule.room(1) == 9 * 800 + 100


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(0, 20), st.integers(1, 40), st.integers(0, 30), st.data())
def test_prompt_excess_covers_every_chunk_of_the_pool(w_pages, b_tokens, chunk_pages, p_pages, data):
    """What a prompt's stream holds when a chunk starts (ring + global, cut to ``cap`` at the
    boundary before) plus what the chunk's step may allocate and reserve
    (``DualCachePool.extend_bound``, the pool's own bound) stays within slot + excess."""
    import torch

    from sglang_wgkv.config import PAGE_SIZE, WGKVConfig
    from sglang_wgkv.integration.pools.capacity import PromptRule, request_bound_tokens
    from sglang_wgkv.memory import DualCachePool

    W, C = PAGE_SIZE * w_pages, data.draw(st.integers(1, PAGE_SIZE * chunk_pages))
    steady = request_bound_tokens(b_tokens, W)
    rule = PromptRule(
        local_window=W,
        slot_tokens=steady + 2 * PAGE_SIZE,
        cap=steady - W + PAGE_SIZE * p_pages,
        chunk_tokens=PAGE_SIZE * -(-C // PAGE_SIZE),
        requests=1,
        spare_tokens=0,
    )
    pool = DualCachePool(
        1,
        1,
        4,
        num_pages=8,
        max_requests=1,
        max_context_len=4096,
        config=WGKVConfig(local_window=W),
        dtype=torch.float32,
    )
    length = data.draw(st.integers(1, 2000))
    start = data.draw(st.integers(0, length - 1))  # a chunk boundary
    n = min(length - start, C)
    ring = -(-min(start, W) // PAGE_SIZE)
    glob = -(-min(max(0, start - W), rule.cap) // PAGE_SIZE)
    held = PAGE_SIZE * (ring + glob + pool.extend_bound(start, n))
    assert held <= rule.slot_tokens + rule.excess_tokens(length)


# fresh gates admit every token: the evictor alone bounds each stream
server = shared_server(
    "--model-path",
    ShortModel(),  # capacity plans in tokens are the full model's
    "--max-total-tokens",
    str(BUDGET),
    "--wgkv-gates",
    "fresh",
    "--wgkv-local-window",
    str(W_LOCAL),
    "--kv-budget",
    str(KV_BUDGET),
    "--chunked-prefill-size",
    str(CHUNK),
    "--disable-radix-cache",
)


def _generate(server, prompt):
    return server.generate(prompt, max_new_tokens=OUT, sampling_params={"ignore_eos": True})


def test_more_concurrent_requests_than_dense_and_queueing(server):
    info = requests.get(server.url + "/get_server_info", timeout=60).json()
    expect = embedded_plan(
        BUDGET, kv_budget=KV_BUDGET, local_window=W_LOCAL, evictor_window=W_LOCAL, chunk_tokens=CHUNK
    )
    assert expect.mode == "bounded"
    slots = info["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert slots == expect.max_requests == 8 and info["max_total_num_tokens"] == expect.logical_tokens

    prompts = [long_prompt(24, seed=i) for i in range(N_REQUESTS)]
    with cf.ThreadPoolExecutor(N_REQUESTS) as ex:
        together = list(ex.map(lambda p: _generate(server, p), prompts))
    prompt_tokens = min(o["meta_info"]["prompt_tokens"] for o in together)
    dense_fit = BUDGET // prompt_tokens  # a dense pool holds every token of a running request
    stats = server.wait_idle_checked()
    # capacity: more than twice the requests a dense pool holds; seen: more running at once than it
    # could hold (how many of the slots fill depends on scheduling order); the rest queued
    assert slots > 2 * dense_fit and slots >= stats["peak_active_requests"] > dense_fit
    for out in together:
        usage = out["meta_info"]["wgkv"][-1]
        assert out["meta_info"]["completion_tokens"] == OUT
        # a decode step may promote one token after the last eviction (cut at the next step boundary)
        assert usage["max_global_tokens_per_head"] <= KV_BUDGET + 1 and usage["cached_tokens"] > 4 * KV_BUDGET
    # the same request alone gives the same tokens: nothing lost or disturbed by the crowd
    assert _generate(server, prompts[-1])["output_ids"] == together[-1]["output_ids"]
    assert server.alive() and server.wait_idle_checked()["active_requests"] == 0


# A server where one long prompt's excess is more than what 7 decoding requests leave of the pool:
# 8 slots of 112 tokens (W_local 64 + budget 16 + 2 pages) and 96 spare; prompt_cap 464 (P = 448).
TIGHT = {"budget": 1800, "w_local": 64, "chunk": 256}


tight_server = shared_server(
    "--model-path",
    ShortModel(),
    "--max-total-tokens",
    str(TIGHT["budget"]),
    "--wgkv-gates",
    "fresh",
    "--wgkv-local-window",
    str(TIGHT["w_local"]),
    "--kv-budget",
    str(KV_BUDGET),
    "--chunked-prefill-size",
    str(TIGHT["chunk"]),
    "--disable-radix-cache",
)


def test_long_prompt_waits_for_room_while_every_other_slot_decodes(tight_server):
    """The prompt guard (integration/scheduling/prefill_guard.py): a long prompt holds more than a slot's bound
    until its end (here up to ring + 448 global tokens per stream in its second chunk); arriving while
    7 of the 8 slots decode, it waits until enough of them finish instead of exhausting the physical
    pool mid-prefill. Every output equals the request's output run alone."""
    import threading
    import time

    server = tight_server
    plan = embedded_plan(
        TIGHT["budget"],
        kv_budget=KV_BUDGET,
        local_window=TIGHT["w_local"],
        evictor_window=TIGHT["w_local"],
        chunk_tokens=TIGHT["chunk"],
    )
    assert (plan.max_requests, plan.prompt_cap, plan.prompt.slot_tokens) == (8, 464, 112)
    long = long_prompt(50, seed=9)
    shorts = [long_prompt(1, seed=i) for i in range(7)]  # ~20 tokens, within the ring: no excess
    new_tokens = 160
    with cf.ThreadPoolExecutor(8) as ex:
        started = threading.Event()

        def short(p):
            started.set()
            return server.generate(p, max_new_tokens=new_tokens, sampling_params={"ignore_eos": True})

        decoding = [ex.submit(short, p) for p in shorts]
        started.wait(60)
        # wait until their rings are full and they promote (>= 5 of a slot's 7 pages per stream):
        # arriving earlier, the long prompt would find the pages they have not taken yet
        deadline, full = time.time() + 180, len(shorts) * STREAMS * 5
        while server.wgkv_stats()["used_pages"] < full and time.time() < deadline:
            time.sleep(0.1)
        stats = server.wgkv_stats()
        assert stats["active_requests"] == len(shorts) and stats["used_pages"] >= full
        late = ex.submit(_generate, server, long).result()
        outs = [f.result() for f in decoding]
    n = late["meta_info"]["prompt_tokens"]
    assert n > TIGHT["chunk"] * 2 and plan.prompt.excess_tokens(n) > plan.prompt.room(len(shorts) + 1)
    assert server.alive()
    assert _generate(server, long)["output_ids"] == late["output_ids"]
    alone = server.generate(shorts[0], max_new_tokens=new_tokens, sampling_params={"ignore_eos": True})
    assert alone["output_ids"] == outs[0]["output_ids"]
    assert server.wait_idle_checked()["active_requests"] == 0


def _stream_usage(server, path, body):
    r = requests.post(
        server.url + path,
        timeout=600,
        stream=True,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    r.raise_for_status()
    usage_chunks = []
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage") and not chunk.get("choices"):
                usage_chunks.append(chunk["usage"])
    assert len(usage_chunks) == 1
    return usage_chunks[0]


def test_streaming_usage_carries_wgkv(server):
    prompt = long_prompt(12, seed=5)
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
    }
    streamed = _stream_usage(server, "/v1/chat/completions", chat)
    plain = requests.post(server.url + "/v1/chat/completions", json=chat, timeout=600).json()["usage"]
    assert streamed["completion_tokens"] == plain["completion_tokens"]
    assert streamed["wgkv"]["cached_tokens"] == plain["wgkv"]["cached_tokens"] > W_LOCAL
    assert streamed["wgkv"]["admitted_fraction"] == pytest.approx(1.0)
    comp = _stream_usage(
        server, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    )
    assert comp["wgkv"]["mean_kv_tokens_per_head"] > W_LOCAL
    server.wait_idle_checked()
