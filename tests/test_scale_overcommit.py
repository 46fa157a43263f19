"""Overcommit capacity (``--wgkv-overcommit``, ``integration/overcommit.py``): admission alone runs more
requests at once than a dense pool of the same KV budget, and a workload that exhausts the physical
pool is retracted / queued by SGLang's scheduler instead of crashing, with every output equal to the
request's output run alone and a clean idle check afterwards.
"""

import concurrent.futures as cf
import random

import pytest
import requests
import torch

from serving_support import BASE_ARGS, Server, long_prompt, save_head_gates
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool

pytestmark = pytest.mark.scale

BUDGET = int(BASE_ARGS[BASE_ARGS.index("--max-total-tokens") + 1])  # dense tokens of KV memory
FACTOR = 2.0
W_LOCAL = 16


def test_overcommit_split():
    from sglang_wgkv.integration.kv_pool import split_capacity
    from sglang_wgkv.integration.overcommit import overcommit_split

    dense = split_capacity(2048, 1000)
    s = overcommit_split(2048, 1000, 2.0)
    assert (s.logical_tokens, s.max_requests, s.physical_tokens) == (2 * dense.logical_tokens,
                                                                     2 * dense.max_requests, 2048)
    assert s.max_request_tokens == dense.logical_tokens
    assert overcommit_split(2048, 10, 3.0).max_requests == 10


def test_overcommit_flag():
    from sglang_wgkv.integration.settings import ENV_VAR, ServingSettings
    from sglang_wgkv.launch_server import resolve

    settings, _, env = resolve(["--wgkv-overcommit", "2.5"])
    assert settings.overcommit == 2.5 and ServingSettings.from_env(env).overcommit == 2.5
    assert resolve([])[0].overcommit is None and ENV_VAR in env
    for bad in (["--wgkv-overcommit", "1"], ["--wgkv-overcommit", "2", "--kv-budget", "64"],
                ["--disable-wgkv", "--wgkv-overcommit", "2"]):
        with pytest.raises(ValueError):
            resolve(bad)


@pytest.mark.parametrize("seed", range(20))
def test_extend_bound_covers_any_chunking(seed):
    """What the chunks of an extend allocate, plus the reserve each chunk's begin_extend checks, never
    exceeds :meth:`DualCachePool.extend_bound` of the whole extend (the prefill guard's reserve)."""
    rng = random.Random(seed)
    L, H, D, W = 2, 2, 4, rng.choice([16, 32, 48])
    pool = DualCachePool(L, H, D, num_pages=2000, max_requests=2, max_context_len=400,
                         config=WGKVConfig(local_window=W), dtype=torch.float32)
    pool.alloc_request(0)
    prefix = rng.randrange(0, 80)
    if prefix:
        pool.begin_extend([0], [0], [prefix])
        for layer in range(L):
            pool.write_extend(layer, torch.zeros(prefix, H, D), torch.zeros(prefix, H, D),
                              torch.rand(prefix, H) < 0.5)
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


def test_decode_worst_case_matches_begin_decode():
    pool = DualCachePool(1, 2, 4, num_pages=100, max_requests=4, max_context_len=200,
                         config=WGKVConfig(local_window=32), dtype=torch.float32)
    # ring page boundary (0, 16) or promoting (>= 32): one page per stream (2 streams)
    assert pool.decode_worst_case([0, 5, 16, 31, 32, 40]) == 2 * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overcommit")
    gates = save_head_gates(tmp / "gates", [30.0, -30.0, -30.0], W_LOCAL)  # 1 of 3 heads admits
    srv = Server(["--wgkv-gates", str(gates), "--wgkv-local-window", str(W_LOCAL),
                  "--wgkv-overcommit", str(FACTOR), "--disable-radix-cache"], tmp / "server.log")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


def _generate(server, prompt, out, admission=True):
    params = {"ignore_eos": True}
    if not admission:
        params["custom_params"] = {"wgkv": {"admission": False}}
    return server.generate(prompt, max_new_tokens=out, sampling_params=params)


def _run_together_and_alone(server, prompts, out, admission):
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: _generate(server, p, out, admission), prompts))
    stats = server.wait_idle_checked()
    alone = [_generate(server, p, out, admission) for p in prompts]
    for t, a in zip(together, alone):
        assert t["meta_info"]["completion_tokens"] == out
        assert t["output_ids"] == a["output_ids"]
    return together, stats


def test_more_concurrent_requests_than_dense(server):
    from sglang_wgkv.integration.kv_pool import split_capacity
    from sglang_wgkv.integration.overcommit import overcommit_split

    info = requests.get(server.url + "/get_server_info", timeout=60).json()
    expect = overcommit_split(BUDGET, 10**6, FACTOR)
    slots = info["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert info["max_total_num_tokens"] == expect.logical_tokens and slots == expect.max_requests

    prompts = [long_prompt(24, seed=i) for i in range(12)]
    together, stats = _run_together_and_alone(server, prompts, 8, admission=True)
    prompt_tokens = min(o["meta_info"]["prompt_tokens"] for o in together)
    # a dense pool of the same budget holds every token of a running request
    dense_fit = split_capacity(BUDGET, 10**6).logical_tokens // prompt_tokens
    assert stats["peak_active_requests"] > dense_fit
    assert server.alive()


def test_physical_exhaustion_retracts_and_recovers(server):
    """Admission off (every token kept): the logical pool admits about twice what the physical pool
    holds; the decode guard makes SGLang retract, the prefill guard makes requests wait."""
    log_before = server.log_path.read_text(errors="replace").count("Retract requests")
    prompts = [long_prompt(24, seed=100 + i) for i in range(8)]
    _, stats = _run_together_and_alone(server, prompts, 40, admission=False)
    assert server.log_path.read_text(errors="replace").count("Retract requests") > log_before
    stats = server.wait_idle_checked()
    assert stats["active_requests"] == 0 and server.alive()
