"""What the server compiles while it starts (``integration/backend/startup_compiles.py``) covers the
variants that served batches of any size launch, keyed as Triton keys them for sm_90
(``testing/jit_keys.py``); checked on CPU with every launch recorded instead of run."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, triton_pool
from sglang_wgkv.testing.jit_keys import launch_key
from sglang_wgkv.testing.sm90_compile import device_checks_off, launches

pytestmark = pytest.mark.core


def _keys(call) -> dict[str, set]:
    cache, out = {}, defaultdict(set)
    with device_checks_off():
        for kernel, bound, options in launches(call):
            out[kernel.fn.__name__].add(launch_key(kernel, (), {**bound, **options}, cache))
    return out


def _pool() -> DualCachePool:
    # Llama-3.1-8B's layers and KV heads: a batch of more than 4 requests runs the block scan
    return DualCachePool(
        32, 8, 128, num_pages=64, max_requests=4, max_context_len=1024,
        config=WGKVConfig(local_window=256), dtype=torch.bfloat16, triton_decode=False,
    )  # fmt: skip


@pytest.mark.parametrize("batch", [1, 4, 5, 300])
def test_startup_compiles_both_promotion_scans(batch):
    """Every scan variant a decode batch's promotion launches was compiled at start-up (the block
    scan compiled in the middle of a served run before it was; the moving kernel is compiled by the
    warm-up decode itself)."""
    pool = _pool()
    startup = _keys(lambda: triton_pool.compile_decode_promote(pool))
    req, pos = torch.arange(batch), torch.full((batch,), 300)
    served = _keys(lambda: triton_pool.decode_promote(pool, req, pos))
    scans = {k: v for k, v in served.items() if k != "_promote_move_kernel"}
    assert scans and all(v <= startup[k] for k, v in scans.items()), (sorted(scans), sorted(startup))


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_startup_compiles_sglang_cache_writes_at_either_alignment(offset):
    """SGLang's extend cache-index write specializes ``out_cache_loc``'s 16-byte alignment; a batch's
    slots start anywhere in the free list, so both variants are compiled at start-up."""
    from sglang.srt.mem_cache.allocation import write_req_to_token_pool_triton

    from sglang_wgkv.integration.backend.startup_compiles import compile_sglang_cache_writes

    pool = SimpleNamespace(req_to_token=torch.zeros(4, 1024, dtype=torch.int32))
    startup = _keys(lambda: compile_sglang_cache_writes(pool))
    index, lens = torch.arange(2), torch.full((2,), 7)
    out_cache_loc = torch.arange(20)[offset : offset + 14]

    def served():
        write_req_to_token_pool_triton[(2,)](
            pool.req_to_token,
            index,
            torch.zeros(2, dtype=torch.uint64),
            lens,
            lens,
            lens,
            out_cache_loc,
            1024,
        )

    got = _keys(served)["write_req_to_token_pool_triton"]
    assert got and got <= startup["write_req_to_token_pool_triton"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_startup_compiles_the_extend_move(dtype):
    """A prompt longer than W_local moves the tokens leaving the ring with ``extend_move``, which the
    warm-up prompt (inside the ring) never launches: its variant for the chunk's rows (k and v as views
    of the model's fused qkv projection) was compiled at start-up."""
    from sglang_wgkv.memory.triton_extend import compile_extend_move

    pool = DualCachePool(
        32, 8, 128, num_pages=16384, max_requests=4, max_context_len=1024,
        config=WGKVConfig(local_window=256), dtype=torch.bfloat16, triton_decode=False, triton_extend=True,
    )  # fmt: skip
    startup = _keys(lambda: compile_extend_move(pool, dtype))
    n = 300
    qkv = torch.randn(n, (32 + 16) * 128, dtype=dtype)
    k, v = qkv[:, 4096:5120].view(n, 8, 128), qkv[:, 5120:].view(n, 8, 128)
    pool.alloc_request(1)
    pool.begin_extend([1], [0], [n])
    served = _keys(lambda: pool.write_extend(3, k, v, torch.rand(n, 8) < 0.5))
    assert served["_extend_move_kernel"] and served["_extend_move_kernel"] <= startup["_extend_move_kernel"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_startup_compiles_the_extend_context_read(dtype):
    """A chunk after a cached prefix reads its context with ``extend_context``, which the warm-up prompt
    (no cached context: its keys are its rows) never launches: its variant for the chunk's rows (views
    of the fused qkv projection) and attention inputs in the model's dtype was compiled at start-up."""
    from sglang_wgkv.memory.triton_extend import compile_extend_context

    pool = DualCachePool(
        32, 8, 128, num_pages=16384, max_requests=4, max_context_len=1024,
        config=WGKVConfig(local_window=256), dtype=torch.bfloat16, triton_decode=False, triton_extend=True,
    )  # fmt: skip
    startup = _keys(lambda: compile_extend_context(pool, dtype))
    pool.alloc_request(1)
    pool.begin_extend([1], [0], [300])  # the first chunk (its writes recorded, not run)
    n = 200
    qkv = torch.randn(n, (32 + 16) * 128, dtype=dtype)
    k, v = qkv[:, 4096:5120].view(n, 8, 128), qkv[:, 5120:].view(n, 8, 128)
    pool.begin_extend([1], [300], [n])
    positions = torch.arange(300, 300 + n, dtype=torch.int32)  # the backend passes int32 positions
    served = _keys(lambda: pool.extend_inputs(5, k, v, torch.rand(n, 8) < 0.5, positions, dtype))
    assert (
        served["_extend_context_kernel"]
        and served["_extend_context_kernel"] <= startup["_extend_context_kernel"]
    )
