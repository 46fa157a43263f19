"""An extend forward's pool writes staged and written for groups of layers (``ExtendWrites``,
``DualCachePool.write_extend_layers``) leave the pool as per-layer ``write_extend`` calls do."""

import pytest
import torch

from sglang_wgkv.config import FAR_POSITION, WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.extend_writes import ExtendWrites

pytestmark = pytest.mark.core

L, H, D, W = 3, 2, 16, 32
# (slot, prefix, extend): past the ring (ring rows and new rows leave it), inside it, new
ROWS = [(1, 70, 40), (2, 20, 30), (3, 0, 50)]


def _pool(dtype):
    pool = DualCachePool(L, H, D, 300, 4, 256, WGKVConfig(local_window=W), dtype=dtype)
    if dtype != torch.float32:
        pool.set_kv_scales([0.5, 1.0, 2.0], [0.25, 1.0, 4.0])
    return pool


def _prefix(pool, gen):
    """Each request's prefix, written per layer."""
    for r, S, _ in ROWS:
        pool.alloc_request(r)
        if S:
            pool.begin_extend([r], [0], [S])
            for layer in range(L):
                k, v = torch.randn(2, S, H, D, generator=gen)
                pool.write_extend(layer, k, v, torch.rand(S, H, generator=gen) < 0.5)


def _state(pool, r):
    S = int(pool.cached_len[r])
    ctx = [pool.gather_context(layer, r, S) for layer in range(L)]
    return S, pool.global_len[r].clone(), pool.ring_flag[r].clone(), ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "e4m3"])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_grouped_writes_equal_per_layer_writes(dtype, group):
    per_layer, grouped = _pool(dtype), _pool(dtype)
    for pool in (per_layer, grouped):
        _prefix(pool, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    N = sum(n for *_, n in ROWS)
    k, v = torch.randn(2, L, N, H, D, generator=gen)
    admit = torch.rand(L, N, H, generator=gen) < 0.5
    slots, prefix, extend = map(list, zip(*ROWS))

    per_layer.begin_extend(slots, prefix, extend)
    for layer in range(L):
        per_layer.write_extend(layer, k[layer], v[layer], admit[layer])

    grouped.begin_extend(slots, prefix, extend)
    layer_bytes = 2 * N * H * D * k.element_size()
    writes = ExtendWrites(grouped, budget_bytes=group * layer_bytes)
    assert writes.group_layers(k[0], v[0]) == group
    for layer in range(L):
        writes.stage(layer, k[layer], v[layer], admit[layer])
    assert writes.pending == 0 and writes.groups_written == -(-L // group)

    for r, *_ in ROWS:
        want, got = _state(per_layer, r), _state(grouped, r)
        assert want[0] == got[0]
        assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2])
        for layer in range(L):
            assert all(torch.equal(a, b) for a, b in zip(want[3][layer], got[3][layer])), (r, layer)
    assert torch.equal(per_layer.left_ring, grouped.left_ring)
    assert torch.equal(per_layer.promoted, grouped.promoted)
    assert per_layer.num_free_pages() == grouped.num_free_pages()
    for pool in (per_layer, grouped):
        pool.check_integrity()


def test_layers_staged_out_of_order_raise():
    pool = _pool(torch.float32)
    pool.alloc_request(1)
    pool.begin_extend([1], [0], [8])
    k = torch.randn(8, H, D)
    writes = ExtendWrites(pool)
    writes.stage(0, k, k, torch.ones(8, H, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="out of order"):
        writes.stage(2, k, k, torch.ones(8, H, dtype=torch.bool))


def test_group_never_spans_past_the_last_layer_and_budget_is_positive():
    pool = _pool(torch.float32)
    pool.alloc_request(1)
    pool.begin_extend([1], [0], [8])
    k = torch.randn(8, H, D)
    writes = ExtendWrites(pool, budget_bytes=1 << 30)
    assert writes.group_layers(k, k) == L  # never more than the model's layers
    for layer in range(L):
        writes.stage(layer, k, k, torch.zeros(8, H, dtype=torch.bool))
    assert writes.groups_written == 1 and writes.pending == 0
    with pytest.raises(ValueError, match="positive"):
        ExtendWrites(pool, budget_bytes=0)


def test_packed_copy_returns_each_array_in_its_dtype():
    """``to_device_many``: one staging buffer, each part a view with its values, dtype and length,
    whatever the parts' byte sizes (a bool part of odd length before int64 ones) and empty parts."""
    import numpy as np

    from sglang_wgkv.memory.host_copy import to_device, to_device_many

    parts = [
        ([np.array([3, 1]), np.array([4])], np.int64),
        (np.array([True, False, True]), np.bool_),
        ([], np.int64),
        (np.arange(5), np.int32),
        (np.array([[1, -2], [3, 2**40]]), np.int64),
    ]
    got = to_device_many(torch.device("cpu"), parts)
    want = [
        torch.tensor([3, 1, 4]),
        torch.tensor([True, False, True]),
        torch.zeros(0, dtype=torch.int64),
        torch.arange(5, dtype=torch.int32),
        torch.tensor([1, -2, 3, 2**40]),
    ]
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), got
    # 16-byte aligned as tensors of their own (Triton specializes kernels on it)
    assert all((t.data_ptr() - got[0].data_ptr()) % 16 == 0 for t in got)
    assert torch.equal(to_device("cpu", [np.array([7]), np.array([8, 9])]), torch.tensor([7, 8, 9]))
    assert to_device_many("cpu", []) == []


def test_kept_staging_writes_forward_after_forward_as_per_layer_writes():
    """Staging kept between forwards (as on CUDA) and reused by forwards of other sizes and groups
    leaves the pool as per-layer writes do."""
    per_layer, kept = _pool(torch.float32), _pool(torch.float32)
    for pool in (per_layer, kept):
        _prefix(pool, torch.Generator().manual_seed(5))
    writes = ExtendWrites(kept, budget_bytes=2 * 2 * 40 * H * D * 4, keep=True)
    gen = torch.Generator().manual_seed(7)
    cached = {r: S for r, S, _ in ROWS}
    for extend in ([40, 30, 50], [9, 3, 17], [33, 40, 2]):  # the first sets the buffers' size
        slots, N = [r for r, *_ in ROWS], sum(extend)
        prefix = [cached[r] for r in slots]
        k, v = torch.randn(2, L, N, H, D, generator=gen)
        admit = torch.rand(L, N, H, generator=gen) < 0.5
        per_layer.begin_extend(slots, prefix, extend)
        kept.begin_extend(slots, prefix, extend)
        for layer in range(L):
            per_layer.write_extend(layer, k[layer], v[layer], admit[layer])
            writes.stage(layer, k[layer], v[layer], admit[layer])
        for r, n in zip(slots, extend):
            cached[r] += n
            want, got = _state(per_layer, r), _state(kept, r)
            assert want[0] == got[0] and torch.equal(want[1], got[1]) and torch.equal(want[2], got[2])
            for layer in range(L):
                (wk, wv, wpos, wadm), (gk, gv, gpos, gadm) = want[3][layer], got[3][layer]
                assert torch.equal(wpos, gpos) and torch.equal(wadm, gadm), (r, layer)
                # a head's rows past its global length pad its pages: their bytes are never read
                read = (wpos != FAR_POSITION)[:, None] | wadm
                assert torch.equal(wk[read], gk[read]) and torch.equal(wv[read], gv[read]), (r, layer)
    assert set(writes._kept) == {"k", "v", "admit"}
    kept.check_integrity()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_wide_copy_equals_the_plain_copy(dtype):
    """:func:`wide_copy_` of the views a layer's rows come in (a key of the fused QKV rows, heads
    split or not), of rows it cannot move as 8-byte words (an odd last dim, an odd offset), and
    :func:`wide_clone`: bit for bit the plain copy, into ``dst`` itself."""
    from sglang_wgkv.memory.wide_copy import as_words, wide_clone, wide_copy_

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(37, 8 * 16, generator=gen).to(dtype)
    cases = [
        qkv[:, 64:96],  # the key of 2 heads x 16 behind 4 query heads
        qkv[:, 64:96].view(37, 2, 16),
        qkv[:, 1:33],  # an odd offset
        qkv[:, 64:67],  # an odd last dim
        qkv[::2, 32:64],  # every other row
    ]
    # the served layouts move as words, the others take the plain copy
    assert [as_words(src) is not None for src in cases] == [True, True, False, False, True]
    for src in cases:
        dst = torch.empty(src.shape, dtype=dtype)
        assert wide_copy_(dst, src) is dst
        assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8)), src.stride()
        clone = wide_clone(src)
        assert clone.is_contiguous() and torch.equal(
            clone.view(torch.uint8), src.contiguous().view(torch.uint8)
        )


def test_a_chunk_after_a_context_past_the_ring_reads_its_columns_once():
    """``context_reads_synced`` (served in the pool's stats): an extend plan whose requests hold global
    entries (a prefix past the ring) reads their page columns from the device once, however often it
    is asked; one whose prefixes sit inside the ring reads nothing."""
    pool = _pool(torch.float32)
    _prefix(pool, torch.Generator().manual_seed(0))
    inside = pool.begin_extend([2], [20], [5])
    assert inside.context_gcols == [[0] * L] and pool.context_reads_synced == 0
    past = pool.begin_extend([1, 3], [70, 0], [5, 5])
    past.context_gcols, past.context_gcols  # noqa: B018
    assert pool.context_reads_synced == 1 and pool.stats()["context_reads_synced"] == 1
