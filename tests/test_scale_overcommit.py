"""Overcommit capacity (``--wgkv-overcommit``, ``integration/scheduling/overcommit.py``): admission alone runs more
requests at once than a dense pool of the same KV budget, and a workload that exhausts the physical
pool is retracted / queued by SGLang's scheduler instead of crashing, with every output equal to the
request's output run alone and a clean idle check afterwards.
"""

import random

import pytest
import requests
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import embedded_plan
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.scale

BUDGET = (
    536  # --max-total-tokens: 4 slots beside the one evictor window row a server keeps for bounded requests
)
FACTOR = 2.0
W_LOCAL = 16


def test_overcommit_split():
    from sglang_wgkv.integration.pools.capacity import dense_split, overcommit_split

    dense = dense_split(2048, 1000)
    s = overcommit_split(2048, 1000, 2.0)
    assert (s.logical_tokens, s.max_requests, s.physical_tokens) == (
        2 * dense.logical_tokens,
        2 * dense.max_requests,
        2048,
    )
    assert s.max_request_tokens == dense.logical_tokens
    assert overcommit_split(2048, 10, 3.0).max_requests == 10


def test_overcommit_flag():
    from sglang_wgkv.integration.plugin.settings import DEFAULT_GPU_OVERCOMMIT, ENV_VAR, ServingSettings
    from sglang_wgkv.launch_server import resolve

    settings, _, env = resolve(["--wgkv-overcommit", "2.5"])
    assert settings.overcommit == 2.5 and ServingSettings.from_env(env).overcommit == 2.5
    assert resolve([])[0].overcommit is None and ENV_VAR in env  # CPU: dense-equivalent
    assert resolve(["--device", "cuda"])[0].overcommit == DEFAULT_GPU_OVERCOMMIT  # GPU default
    assert resolve(["--device", "cuda", "--kv-budget", "512"])[0].overcommit is None
    assert resolve(["--device", "cuda", "--wgkv-overcommit", "2"])[0].overcommit == 2
    for bad in (
        ["--wgkv-overcommit", "1"],
        ["--wgkv-overcommit", "2", "--kv-budget", "64"],
        ["--disable-wgkv", "--wgkv-overcommit", "2"],
    ):
        with pytest.raises(ValueError):
            resolve(bad)


@pytest.mark.parametrize("seed", range(20))
def test_extend_bound_covers_any_chunking(seed):
    """What the chunks of an extend allocate, plus the reserve each chunk's begin_extend checks, never
    exceeds :meth:`DualCachePool.extend_bound` of the whole extend (the prefill guard's reserve)."""
    rng = random.Random(seed)
    L, H, D, W = 2, 2, 4, rng.choice([16, 32, 48])
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=2000,
        max_requests=2,
        max_context_len=400,
        config=WGKVConfig(local_window=W),
        dtype=torch.float32,
    )
    pool.alloc_request(0)
    prefix = rng.randrange(0, 80)
    if prefix:
        pool.begin_extend([0], [0], [prefix])
        for layer in range(L):
            pool.write_extend(
                layer, torch.zeros(prefix, H, D), torch.zeros(prefix, H, D), torch.rand(prefix, H) < 0.5
            )
    total = rng.randrange(1, 250)
    bound = pool.extend_bound(prefix, total)
    start_free = pool.num_free_pages()
    reserves = []
    ensure = pool.allocator.ensure
    pool.allocator.ensure = lambda worst: (reserves.append(worst), ensure(worst))[1]
    done = 0
    while done < total:
        n = min(total - done, rng.choice([1, 3, 15, 16, 17, 40, 100]))
        before = start_free - pool.num_free_pages()
        pool.begin_extend([0], [prefix + done], [n])
        assert before + reserves[-1] <= bound
        admit = torch.rand(n, H) < rng.choice([0.0, 0.5, 1.0])
        for layer in range(L):
            pool.write_extend(layer, torch.zeros(n, H, D), torch.zeros(n, H, D), admit)
        done += n
    assert start_free - pool.num_free_pages() <= bound
    pool.free_request(0)
    pool.check_integrity()


@pytest.mark.parametrize("prefix", [5, 16, 40, 47, 90])
def test_restore_bound_covers_restore(prefix):
    """A prefix-cache hit's restore allocates at most :meth:`DualCachePool.restore_bound` pages (the
    overcommit prefill guard adds it to a hit's prompt reserve), and exactly that much when every
    stream's last global page is partial."""
    L, H, D, W = 2, 3, 4, 32
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=500,
        max_requests=3,
        max_context_len=200,
        config=WGKVConfig(local_window=W),
        dtype=torch.float32,
    )
    pool.alloc_request(0)
    pool.begin_extend([0], [0], [prefix])
    admit = torch.zeros(prefix, H, dtype=torch.bool)
    admit[0] = True  # one global token per stream once it leaves the ring: a partial last page
    for layer in range(L):
        pool.write_extend(layer, torch.randn(prefix, H, D), torch.randn(prefix, H, D), admit)
    snap = pool.take_snapshot(0)
    pool.alloc_request(1)
    free = pool.num_free_pages()
    pool.restore_snapshot(1, snap)
    used = free - pool.num_free_pages()
    bound = pool.restore_bound(prefix)
    assert used <= bound
    assert used == bound if prefix > W else used == bound - L * H
    for r in (0, 1):
        pool.free_request(r)
    pool.release_snapshot(snap)
    pool.check_integrity()


def test_decode_worst_case_matches_begin_decode():
    pool = DualCachePool(
        1,
        2,
        4,
        num_pages=100,
        max_requests=4,
        max_context_len=200,
        config=WGKVConfig(local_window=32),
        dtype=torch.float32,
    )
    # ring page boundary (0, 16) or promoting (>= 32): one page per stream (2 streams)
    assert pool.decode_worst_case([0, 5, 16, 31, 32, 40]) == 2 * 4


server = shared_server(
    "--model-path",
    ShortModel(),  # capacity plans in tokens are the full model's
    "--max-total-tokens",
    str(BUDGET),
    "--wgkv-gates",
    HeadGates((30.0, -30.0, -30.0), W_LOCAL, SHORT_LAYERS),  # 1 of 3 heads admits
    "--wgkv-local-window",
    str(W_LOCAL),
    "--wgkv-overcommit",
    str(FACTOR),
    "--disable-radix-cache",
)


def _prompts(n, length, seed):
    """``n`` token-id prompts of exactly ``length`` tokens (equal lengths: the requests cross page
    boundaries at the same steps, so the physical demand is known)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def _generate(server, input_ids, out, admission):
    params = {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}
    if not admission:
        params["custom_params"] = {"wgkv": {"admission": False}}
    r = requests.post(
        server.url + "/generate", json={"input_ids": input_ids, "sampling_params": params}, timeout=900
    )
    r.raise_for_status()
    return r.json()


def _run_together_and_alone(server, prompts, out, admission):
    """One batched call (all requests reach the scheduler together), then each request alone."""
    together = _generate(server, prompts, out, admission)
    stats = server.wait_idle_checked()
    for t, p in zip(together, prompts):
        assert t["meta_info"]["completion_tokens"] == out
        assert t["output_ids"] == _generate(server, p, out, admission)["output_ids"]
    return stats


def test_more_concurrent_requests_than_dense(server):
    info = requests.get(server.url + "/server_info", timeout=60).json()
    expect = embedded_plan(BUDGET, local_window=W_LOCAL, overcommit=FACTOR)
    slots = info["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert info["max_total_num_tokens"] == expect.logical_tokens and slots == expect.max_requests == 4

    prompt, out = 200, 4
    stats = _run_together_and_alone(server, _prompts(4, prompt, seed=1), out, admission=True)
    # a dense pool of the same memory holds every token of a running request: BUDGET // 204 = 2
    assert stats["peak_active_requests"] > BUDGET // (prompt + out)
    assert server.alive()


def test_physical_exhaustion_retracts_and_recovers(server):
    """Admission off (every token kept). Pages per (layer, KV head) stream, as the plan scales them
    with the layer count: the pool has ~30.7 per stream, a 96-token request holds 6 in each of its
    streams and takes 1 more every 16 decoded tokens (global pages at decode steps 1, 17, 33, 49). The
    prefill guard admits at least 3 of the 5 requests (4 slots; a request needs its 8-page prompt worst
    case + one decode step of every running request); how many more depends on when they reach the
    scheduler. With 3 running, 12 page crossings by step 49 leave ~0.7 free pages per stream < the 3
    the next step may need, so the decode guard makes SGLang retract a request (earlier with 4), which
    frees its pages and runs again later. The logical pool (748 tokens >= 4 x 160) alone would never
    retract."""
    log = server.log_path
    retractions = log.read_text(errors="replace").count("Retract requests")
    stats = _run_together_and_alone(server, _prompts(5, 96, seed=2), 64, admission=False)
    assert log.read_text(errors="replace").count("Retract requests") > retractions
    assert stats["active_requests"] == 0 and stats["free_pages"] == stats["total_pages"] and server.alive()
