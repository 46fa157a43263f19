"""An extend forward's attention inputs read through the plan's ``ContextIndex`` (a fixed handful of
launches a layer, whatever the batch) equal the request-by-request reads through ``gather_context``
(``extend_inputs_reference``), over chunked prefills on bf16, float32 and FP8 pools; and their
launch count does not grow with the requests."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.context_index import ragged_arange
from sglang_wgkv.testing.op_count import counting_ops, totals

pytestmark = pytest.mark.core

L, H, D, W = 3, 2, 16, 32


def _pool(dtype, slots=6):
    pool = DualCachePool(L, H, D, 900, slots + 1, 400, WGKVConfig(local_window=W), dtype=dtype)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        pool.set_kv_scales([0.5, 1.0, 2.0], [0.25, 1.0, 4.0])
    return pool


def _forward(pool, rows, gen, check):
    """One extend forward of ``rows`` = [(slot, extend)] after each slot's cached tokens: every layer's
    inputs checked (``check(layer, *inputs)``) before that layer's write."""
    slots = [r for r, _ in rows]
    prefix = [int(pool.cached_len[r]) for r in slots]
    extend = [n for _, n in rows]
    pool.begin_extend(slots, prefix, extend)
    N = sum(extend)
    positions = torch.cat([torch.arange(S, S + n) for S, n in zip(prefix, extend)])
    for layer in range(L):
        k, v = (torch.randn(N, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
        admit = torch.rand(N, H, generator=gen) < 0.4
        check(layer, k, v, admit, positions)
        pool.write_extend(layer, k, v, admit)


def _same(pool):
    def check(layer, k, v, admit, positions):
        got = pool.extend_inputs(layer, k, v, admit, positions, torch.bfloat16)
        want = pool.extend_inputs_reference(layer, k, v, admit, positions, torch.bfloat16)
        for name, a, b in zip(("keys", "values", "k_pos", "admitted"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
            assert torch.equal(a, b), f"layer {layer}: {name} differs"

    return check


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=["bf16", "f32", "e4m3"]
)
def test_batched_context_equals_request_by_request(dtype):
    pool = _pool(dtype)
    gen = torch.Generator().manual_seed(1)
    for r in range(1, 6):
        pool.alloc_request(r)
    check = _same(pool)
    # chunks of several requests at once: new ones, inside the ring, past it, long past it
    for rows in (
        [(1, 50), (2, 20), (3, 5)],
        [(1, 40), (2, 20), (3, 1), (4, 70)],
        [(3, 64), (1, 1), (5, 3), (2, 100)],
        [(4, 7), (2, 33), (1, 90), (3, 16), (5, 40)],
    ):
        _forward(pool, rows, gen, check)
    pool.check_integrity()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(1, 4), st.integers(1, 60)), min_size=1, max_size=4, unique_by=lambda t: t[0]
        ),
        min_size=1,
        max_size=4,
    )
)
def test_batched_context_equals_request_by_request_drawn(forwards):
    pool = _pool(torch.bfloat16)
    for r in range(1, 5):
        pool.alloc_request(r)
    gen = torch.Generator().manual_seed(len(forwards))
    check = _same(pool)
    for rows in forwards:
        rows = [(r, n) for r, n in rows if pool.cached_len[r] + n <= pool.max_context_len]
        if rows:
            _forward(pool, rows, gen, check)


def test_launches_a_layer_do_not_grow_with_the_requests():
    """A layer's context reads: eight launches for one request continuing and for four (the reference
    reads make about twenty per request)."""
    per_layer = {}
    for B in (1, 4):
        pool = _pool(torch.bfloat16)
        gen = torch.Generator().manual_seed(2)
        for r in range(1, B + 1):
            pool.alloc_request(r)
        _forward(pool, [(r, 80) for r in range(1, B + 1)], gen, lambda *a: None)
        counts = {}

        def count(layer, k, v, admit, positions):
            with counting_ops() as c:
                pool.extend_inputs(layer, k, v, admit, positions, torch.bfloat16)
            counts[layer] = totals(c)

        _forward(pool, [(r, 30) for r in range(1, B + 1)], gen, count)
        per_layer[B] = counts[1]
    assert per_layer[1] == per_layer[4] == {"torch": 8}, per_layer


def test_ragged_arange():
    assert ragged_arange(np.array([3, 0, 2, 1])).tolist() == [0, 1, 2, 0, 1, 0]
    assert ragged_arange(np.array([], dtype=np.int64)).tolist() == []
