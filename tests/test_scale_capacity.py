"""Bounded capacity (``--kv-budget`` + chunked prefill, ``integration/kv_pool.py``): a WG-KV server runs
more requests at once than any dense pool of the same KV budget could hold, queues the rest, never
exhausts its physical pool, and keeps every output equal to the request's output run alone.
Also: streaming OpenAI responses carry ``usage["wgkv"]`` in their usage chunk.
"""

import concurrent.futures as cf
import json

import pytest
import requests

from serving_support import Server, embedded_plan, long_prompt

pytestmark = pytest.mark.scale

BUDGET = 832       # --max-total-tokens: dense tokens of KV memory
W_LOCAL = 16
KV_BUDGET = 16
CHUNK = 128
N_REQUESTS = 7
OUT = 8


def test_bounded_split_arithmetic():
    from sglang_wgkv.integration.capacity import bounded_split, prompt_reserve, request_bound_tokens

    assert request_bound_tokens(4096, 256) == 4352 and request_bound_tokens(33, 16) == 16 + 48
    # the prompt being prefilled: what the longest prompt admits beyond the budget, at most 1/4 of it
    assert prompt_reserve(10_000, kv_budget=64, local_window=32, context_len=4096) == 2496
    assert prompt_reserve(100_000, kv_budget=64, local_window=32, context_len=4096) == 4096 - 96
    s = bounded_split(10_000, 2048, kv_budget=64, local_window=32, chunk_tokens=100, context_len=4096,
                      window_tokens=10)
    per_request = 32 + 64 + 32 + 10
    assert s.max_requests == (10_000 - 112 - 2496) // per_request and s.prompt_cap == 64 + 2496
    assert s.logical_tokens == s.max_requests * 4096 and s.physical_tokens == 10_000 - 10 * s.max_requests
    assert bounded_split(10_000, 5, kv_budget=64, local_window=32, chunk_tokens=100, context_len=4096).max_requests == 5
    assert bounded_split(1000, 64, kv_budget=64, local_window=32, chunk_tokens=1024, context_len=4096) is None
    with_prefix = bounded_split(10_000, 2048, kv_budget=64, local_window=32, chunk_tokens=100, context_len=4096,
                                window_tokens=10, prefix_cache=True)
    assert with_prefix.restore_slots >= 1
    # a restored snapshot may hold a prompt's global part (taken before the prompt's end)
    restored = 32 + 64 + 2496 + 16
    assert with_prefix.max_requests * per_request + with_prefix.restore_slots * restored + 112 + 2496 <= 10_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale_capacity")
    # fresh gates admit every token: the evictor alone bounds each stream
    srv = Server(["--max-total-tokens", str(BUDGET), "--wgkv-gates", "fresh", "--wgkv-local-window", str(W_LOCAL),
                  "--kv-budget", str(KV_BUDGET), "--chunked-prefill-size", str(CHUNK), "--disable-radix-cache"], tmp / "server.log")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


def _generate(server, prompt):
    return server.generate(prompt, max_new_tokens=OUT, sampling_params={"ignore_eos": True})


def test_more_concurrent_requests_than_dense_and_queueing(server):
    info = requests.get(server.url + "/get_server_info", timeout=60).json()
    expect = embedded_plan(BUDGET, kv_budget=KV_BUDGET, local_window=W_LOCAL, evictor_window=W_LOCAL,
                           chunk_tokens=CHUNK)
    assert expect.mode == "bounded"
    slots = info["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert slots == expect.max_requests == 5 and info["max_total_num_tokens"] == expect.logical_tokens

    prompts = [long_prompt(24, seed=i) for i in range(N_REQUESTS)]
    with cf.ThreadPoolExecutor(N_REQUESTS) as ex:
        together = list(ex.map(lambda p: _generate(server, p), prompts))
    prompt_tokens = min(o["meta_info"]["prompt_tokens"] for o in together)
    dense_fit = BUDGET // prompt_tokens            # a dense pool holds every token of a running request
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


def _stream_usage(server, path, body):
    r = requests.post(server.url + path, timeout=600, stream=True,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
    r.raise_for_status()
    usage_chunks = []
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage") and not chunk.get("choices"):
                usage_chunks.append(chunk["usage"])
    assert len(usage_chunks) == 1
    return usage_chunks[0]


def test_streaming_usage_carries_wgkv(server):
    prompt = long_prompt(12, seed=5)
    chat = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            "temperature": 0}
    streamed = _stream_usage(server, "/v1/chat/completions", chat)
    plain = requests.post(server.url + "/v1/chat/completions", json=chat, timeout=600).json()["usage"]
    assert streamed["completion_tokens"] == plain["completion_tokens"]
    assert streamed["wgkv"]["cached_tokens"] == plain["wgkv"]["cached_tokens"] > W_LOCAL
    assert streamed["wgkv"]["admitted_fraction"] == pytest.approx(1.0)
    comp = _stream_usage(server, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 3,
                                                     "temperature": 0})
    assert comp["wgkv"]["mean_kv_tokens_per_head"] > W_LOCAL
    server.wait_idle_checked()
