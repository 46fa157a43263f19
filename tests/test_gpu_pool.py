"""Triton pool writes leave the dual-cache pool exactly as its torch ops do."""

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device)")]


def _pool(L, H, D, W, dtype, dev):
    return DualCachePool(L, H, D, num_pages=6000, max_requests=3, max_context_len=3000,
                         config=WGKVConfig(local_window=W), dtype=dtype, device=dev)


def assert_same_pool(a, b):
    """Equal state; page contents compared on every page but the dump page."""
    for name in ("page_table", "global_len", "ring_flag", "left_ring", "promoted"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.k_pages[:-1], b.k_pages[:-1]) and torch.equal(a.v_pages[:-1], b.v_pages[:-1])
    assert (a.cached_len == b.cached_len).all()
    assert torch.equal(a.allocator.num_free, b.allocator.num_free)
    assert torch.equal(a.allocator.free_stack, b.allocator.free_stack)
    assert torch.equal(a.allocator.ref, b.allocator.ref)


def check_prefill_then_decode(n, W, p, dtype, dev, steps=40, L=3, H=4, D=128):
    """Torch path vs Triton path on twin pools: a from-scratch prefill, then decode steps."""
    from sglang_wgkv.memory.triton_pool import begin_prefill, decode_write, prefill_write

    torch.manual_seed(n + W)
    torch_pool, triton_pool = _pool(L, H, D, W, dtype, dev), _pool(L, H, D, W, dtype, dev)
    slot = 1
    other = [torch.randn(37, H, D, device=dev) for _ in range(L)]
    for pool in (torch_pool, triton_pool):
        pool.alloc_request(0)          # an unrelated request holding pages first
        pool.begin_extend([0], [0], [37])
        for layer in range(L):
            pool.write_extend(layer, other[layer], other[layer], torch.ones(37, H, dtype=torch.bool, device=dev))
        pool.alloc_request(slot)
    torch_pool.begin_extend([slot], [0], [n])
    begin_prefill(triton_pool, slot, n)
    for layer in range(L):
        k, v = torch.randn(n, H, D, device=dev), torch.randn(n, H, D, device=dev)
        admit = torch.rand(n, H, device=dev) < p
        torch_pool.write_extend(layer, k, v, admit)
        prefill_write(triton_pool, slot, layer, k, v, admit)
    assert_same_pool(torch_pool, triton_pool)
    req = torch.tensor([slot], device=dev)
    for step in range(steps):
        pos = torch.tensor([n + step], device=dev)
        for pool in (torch_pool, triton_pool):
            pool.begin_decode([slot], [n + step])
        for layer in range(L):
            k, v = torch.randn(1, H, D, device=dev), torch.randn(1, H, D, device=dev)
            admit = torch.rand(1, H, device=dev) < p
            torch_pool.write_decode(layer, k, v, admit)
            decode_write(triton_pool, layer, req, pos, k, v, admit)
        assert_same_pool(torch_pool, triton_pool)
    torch_pool.check_integrity()
    triton_pool.check_integrity()


@pytest.mark.parametrize("n,W,p", [(1000, 64, 0.25), (700, 256, 0.5), (100, 256, 0.3), (2000, 16, 0.0),
                                   (513, 32, 1.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_pool_writes_match_torch(n, W, p, dtype):
    check_prefill_then_decode(n, W, p, dtype, "cuda")
