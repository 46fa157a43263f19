"""The evictor on CUDA: the model-checked long runs of test_evictor_run, and a bf16 run at model scale."""

import pytest
import torch
from test_evictor_run import RUNS, long_random_run

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor

pytestmark = [
    pytest.mark.evictor,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)"),
]


@pytest.mark.parametrize("W,window,budget,p_admit,seed,lead", RUNS)
def test_long_random_run_on_cuda(W, window, budget, p_admit, seed, lead):
    long_random_run(W, window, budget, p_admit, seed, "cuda", lead)


def test_bf16_model_scale_budget_and_pages():
    # Qwen3-4B attention shape (36 layers, 8 KV heads, GQA 4, head_dim 128), small budget and window
    L, H, G, D, W, budget = 36, 8, 4, 128, 64, 256
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=40_000,
        max_requests=4,
        max_context_len=2048,
        config=WGKVConfig(local_window=W),
        dtype=torch.bfloat16,
        device="cuda",
    )
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
            ev.observe_decode(
                layer, torch.randn(3, H * G, D, device="cuda", generator=gen, dtype=torch.bfloat16)
            )
        ev.maybe_evict()
        assert int(pool.global_len.max()) <= budget
        seq = [n + 1 for n in seq]
    pool.check_integrity()
    assert ev.triggers[:3].min() > 0
    for r in range(3):
        pool.free_request(r)
    pool.check_integrity()
    assert pool.num_free_pages() == 40_000


@pytest.mark.parametrize(
    "dtype,G,D,fp8",
    [
        (torch.bfloat16, 4, 128, None),
        (torch.float16, 3, 64, None),
        (torch.float32, 4, 128, None),
        (torch.bfloat16, 4, 128, torch.float8_e4m3fn),
    ],
)
def test_triton_scores_match_the_reference_at_model_scale(dtype, G, D, fp8):
    """The compiled SnapKV score kernel (the kernels path's evictor) against the torch reference:
    Llama-3.1-8B's GQA 4 x head_dim 128 (bf16), SmolLM2's GQA 3 x 64 (fp16, heads padded), float32
    (IEEE dot), and bf16 queries over an FP8 pool's stored keys with a scale per stream (dequantized in
    registers; the reference reads the dequantized copy); window 256, ring 256, 0-900 global entries,
    empty slots."""
    import math

    from sglang_wgkv.memory.kv_quant import dequantize, quantize
    from sglang_wgkv.memory.snapkv_score import snapkv_scores
    from sglang_wgkv.memory.triton_snapkv import snapkv_scores_triton

    gen = torch.Generator(device="cuda").manual_seed(G * D)
    S, Wq, Nr = 37, 256, 256
    g_len = torch.randint(0, 900, (S,), device="cuda", generator=gen)
    Ng = int(g_len.max())
    q = torch.randn(S, Wq, G, D, device="cuda", generator=gen).to(dtype) * 2
    g_keys = torch.randn(S, Ng, D, device="cuda", generator=gen).to(dtype)
    r_keys = torch.randn(S, Nr, D, device="cuda", generator=gen).to(dtype)
    r_pos = torch.arange(5000, 5000 + Nr, device="cuda").repeat(S, 1)
    r_pos[:, :7] = -1
    q_pos = 5000 + Nr - 1 - torch.arange(Wq, device="cuda").repeat(S, 1)
    q_pos[3] = -1
    scale = 1 / math.sqrt(D)
    k_scale = None
    if fp8 is not None:
        k_scale = torch.rand(S, device="cuda", generator=gen) + 0.02
        g_keys = quantize(g_keys, k_scale[:, None, None], fp8)
        r_keys = quantize(r_keys, k_scale[:, None, None], fp8)
        g_vals, r_vals = (dequantize(k, k_scale[:, None, None], dtype) for k in (g_keys, r_keys))
    else:
        g_vals, r_vals = g_keys, r_keys
    want = snapkv_scores(q, q_pos, g_vals, g_len, r_vals, r_pos, scale, 5)
    got = snapkv_scores_triton(q, q_pos, g_keys, g_len, r_keys, r_pos, scale, 5, k_scale=k_scale)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-5)
