"""The evictor on CUDA: the model-checked long runs of test_evictor_run, and a bf16 run at model scale."""

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor

from test_evictor_run import RUNS, long_random_run

pytestmark = [pytest.mark.evictor, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device)")]


@pytest.mark.parametrize("W,window,budget,p_admit,seed,lead", RUNS)
def test_long_random_run_on_cuda(W, window, budget, p_admit, seed, lead):
    long_random_run(W, window, budget, p_admit, seed, "cuda", lead)


def test_bf16_model_scale_budget_and_pages():
    # Qwen3-4B attention shape (36 layers, 8 KV heads, GQA 4, head_dim 128), small budget and window
    L, H, G, D, W, budget = 36, 8, 4, 128, 64, 256
    pool = DualCachePool(L, H, D, num_pages=40_000, max_requests=4, max_context_len=2048,
                         config=WGKVConfig(local_window=W), dtype=torch.bfloat16, device="cuda")
    ev = SnapKVEvictor(pool, budget=budget, num_q_heads=H * G, window=W, max_score_elems=1 << 24)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [700, 300, 1000]
    for r in range(3):
        pool.alloc_request(r)
    pool.begin_extend([0, 1, 2], [0, 0, 0], lens)
    N = sum(lens)
    for layer in range(L):
        ev.observe_extend(layer, torch.randn(N, H * G, D, device="cuda", generator=gen, dtype=torch.bfloat16))
        kv = torch.randn(2, N, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        pool.write_extend(layer, kv[0], kv[1], torch.rand(N, H, device="cuda", generator=gen) < 0.9)
    ev.maybe_evict()
    assert int(pool.global_len.max()) <= budget
    pool.check_integrity()
    seq = list(lens)
    for _ in range(150):
        pool.begin_decode([0, 1, 2], seq)
        for layer in range(L):
            kv = torch.randn(2, 3, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
            pool.write_decode(layer, kv[0], kv[1], torch.rand(3, H, device="cuda", generator=gen) < 0.9)
            ev.observe_decode(layer, torch.randn(3, H * G, D, device="cuda", generator=gen, dtype=torch.bfloat16))
        ev.maybe_evict()
        assert int(pool.global_len.max()) <= budget
        seq = [n + 1 for n in seq]
    pool.check_integrity()
    assert ev.triggers[:3].min() > 0
    for r in range(3):
        pool.free_request(r)
    pool.check_integrity()
    assert pool.num_free_pages() == 40_000
