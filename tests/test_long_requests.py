"""Per-request bounds (``integration/scheduling/long_requests.py``): ``custom_params.wgkv.kv_budget`` parsing and
range checks, the bound a request longer than the dense pool gets, the pages a bounded request holds
(never more than the prefill guard reserves for it), and the evictor's per-slot bounds with window
rows (a bounded slot is cut to its budget, an unbounded one beside it is untouched; the scores read
through a row equal those of the one-row-per-slot evictor)."""

import numpy as np
import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.requests.control import RequestAdmission
from sglang_wgkv.integration.scheduling.long_requests import (
    length_error,
    pool_bound,
    requested_bound,
)
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor

pytestmark = pytest.mark.scale

L, H, G, D = 2, 2, 2, 8


@pytest.mark.parametrize("bad", ["256", 1.5, True, 0, -16, [256]])
def test_kv_budget_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="kv_budget must be a positive integer"):
        RequestAdmission.parse({"kv_budget": bad})


def test_kv_budget_range():
    ok = RequestAdmission.parse({"kv_budget": 512, "tau": 0.2})
    assert (ok.kv_budget, ok.tau, ok.cache_key()) == (512, 0.2, "wgkv:tau=0.2")
    ok.check_budget(local_window=256, context_len=8192, server_budget=None)
    RequestAdmission.parse({"kv_budget": 256}).check_budget(256, 8192, None)  # the ring itself
    RequestAdmission.parse({"kv_budget": 8192}).check_budget(256, 8192, None)  # the context
    with pytest.raises(ValueError, match="below the ring"):
        RequestAdmission.parse({"kv_budget": 255}).check_budget(256, 8192, None)
    with pytest.raises(ValueError, match="above the context length"):
        RequestAdmission.parse({"kv_budget": 8193}).check_budget(256, 8192, None)
    with pytest.raises(ValueError, match="above the server's --kv-budget"):
        RequestAdmission.parse({"kv_budget": 1024}).check_budget(256, 8192, 512)


def test_pool_bound_fills_the_room_and_keeps_a_requested_budget_that_fits():
    streams, room = 90, 90 * 256  # 4096 tokens of page space per stream on average
    fixed = streams * (256 // 16 + 512 // 16 + 1 + 3)  # ring, chunk, partial page, reserve
    fit = pool_bound(kv_budget=None, local_window=256, chunk_tokens=512, room_pages=room, streams=streams)
    total_cap = 16 * (room - fixed)
    assert (fit.source, fit.budget, fit.total_cap) == ("pool", None, total_cap)
    assert fit.total_budget == 16 * ((total_cap - max(streams * 512, total_cap // 8)) // 16)
    assert fit.pages(streams, 256, 512) == room
    own = pool_bound(kv_budget=256, local_window=256, chunk_tokens=512, room_pages=room, streams=streams)
    assert own == requested_bound(256, 512) and (own.budget, own.cap, own.total_cap) == (256, 768, None)
    squeezed = pool_bound(
        kv_budget=4000, local_window=256, chunk_tokens=512, room_pages=room, streams=streams
    )
    assert (squeezed.budget, squeezed.total_cap) == (4000, total_cap)  # its own and what fits
    tight = dict(local_window=256, chunk_tokens=512, streams=streams)
    assert pool_bound(kv_budget=None, room_pages=fixed + streams * 16 * 2, **tight) is None


def test_length_errors_say_why():
    common = dict(dense_limit=3000, local_window=256, chunk_tokens=512, room_pages=90 * 256, streams=90)
    assert length_error(length=3000, admission=False, **common) is None
    assert "admission off" in length_error(length=3001, admission=False, **common)
    assert length_error(length=100_000, admission=True, **common) is None
    tight = {**common, "chunk_tokens": 4096}
    assert "cannot fit even compressed" in length_error(length=5000, admission=True, **tight)


def _pool(pages=4000, slots=3, maxlen=2000, W=16):
    return DualCachePool(
        L,
        H,
        D,
        num_pages=pages,
        max_requests=slots,
        max_context_len=maxlen,
        config=WGKVConfig(local_window=W),
        dtype=torch.float32,
    )


def _extend(pool, ev, gen, chunks: dict, ends: dict):
    """One extend of ``chunks[slot]`` admitted-all tokens per slot; each layer observed, then written."""
    slots = list(chunks)
    prefix = [int(pool.cached_len[s]) for s in slots]
    plan = pool.begin_extend(slots, prefix, [chunks[s] for s in slots])
    ev.mark_extend(slots, [ends[s] for s in slots])
    n = sum(chunks.values())
    for layer in range(L):
        k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
        ev.observe_extend(layer, torch.randn(n, H * G, D, generator=gen))
        pool.write_extend(layer, k, v, torch.ones(n, H, dtype=torch.bool))
    return plan


def test_a_bounded_slot_is_cut_to_its_budget_and_an_unbounded_one_beside_it_is_untouched():
    pool = _pool()
    ev = SnapKVEvictor(pool, budget=None, num_q_heads=H * G, window=8, rows=1)
    gen = torch.Generator().manual_seed(0)
    for s in (0, 1, 2):
        pool.alloc_request(s)
    ev.bound_request(1, budget=48, cap=96, lead=4)
    assert ev.free_rows() == 0 and ev.request_bound(1) == 48 and ev.request_bound(0) is None
    with pytest.raises(RuntimeError, match="no free query-window row"):
        ev.bound_request(2, budget=48)
    for i in range(4):  # four chunks of 100: the bounded one passes its cap and is compressed early
        ev.open_prompts([0, 1])
        ev.maybe_evict()
        _extend(pool, ev, gen, {0: 100, 1: 100}, {0: i == 3, 1: i == 3})
        assert int(pool.global_len[1].max()) <= 96 + 100
    ev.maybe_evict()  # the prompts' end
    assert int(pool.global_len[1].max()) <= 48 and ev.early_compressions[1] >= 1
    assert int(pool.global_len[0].min()) == 400 - 16 and ev.triggers[0] == 0  # untouched
    pool.free_request(1)
    ev.release_request(1)
    assert ev.free_rows() == 1 and ev.request_bound(1) is None
    ev.bound_request(2, budget=48)  # the row is free again
    pool.check_integrity()


def test_scores_through_a_window_row_equal_the_one_row_per_slot_evictor():
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    pools = [_pool(), _pool()]
    evs = [
        SnapKVEvictor(pools[0], budget=32, num_q_heads=H * G, window=8),
        SnapKVEvictor(pools[1], budget=None, num_q_heads=H * G, window=8, rows=2),
    ]
    for pool in pools:
        pool.alloc_request(2)
    evs[1].bound_request(2, budget=32, cap=32)
    assert int(evs[1].row[2]) != 2  # read through a row other than the slot
    for pool, ev, gen in zip(pools, evs, (gen_a, gen_b)):
        _extend(pool, ev, gen, {2: 120}, {2: True})
    r = torch.tensor([2, 2]), torch.tensor([0, 1]), torch.tensor([1, 0])
    (sa, *_), (sb, *_) = (ev.stream_scores(*r, prompt=True) for ev in evs)
    assert torch.equal(sa, sb)
    for ev in evs:
        ev.maybe_evict()
    assert torch.equal(pools[0].global_len, pools[1].global_len)
    assert int(pools[1].global_len[2].max()) <= 32


@pytest.mark.parametrize("seed", range(6))
def test_a_bounded_request_never_holds_more_pages_than_its_reserve(seed):
    """What the overcommit guard reserves for a bounded request (``RequestBound.pages``) covers every
    page it holds at any point of a chunked prompt (each chunk's begin_extend reserve included) and
    of its decode steps, whatever it admits."""
    rng = np.random.default_rng(seed)
    W, chunk = 16, int(rng.choice([16, 40, 64]))
    pool = _pool(pages=6000, slots=2, maxlen=1400, W=W)
    ev = SnapKVEvictor(pool, budget=None, num_q_heads=H * G, window=8, rows=1)
    gen = torch.Generator().manual_seed(seed)
    streams = L * H
    fixed = streams * (W // 16 + chunk // 16 + 4)
    room = fixed + streams * int(rng.integers(3 * W + 2 * chunk, 3 * W + 2 * chunk + 400)) // 16
    bound = pool_bound(kv_budget=None, local_window=W, chunk_tokens=chunk, room_pages=room, streams=streams)
    reserve = bound.pages(streams, W, chunk)
    assert reserve <= room
    pool.alloc_request(1)
    ev.bound_request(1, bound.budget, bound.cap, bound.lead, bound.total_budget, bound.total_cap)
    total, start = int(rng.integers(600, 1200)), pool.num_free_pages()
    reserves = []
    ensure = pool.allocator.ensure
    pool.allocator.ensure = lambda worst: (reserves.append(worst), ensure(worst))[1]
    done = 0
    while done < total:
        n = min(chunk, total - done)
        ev.open_prompts([1])
        ev.maybe_evict()
        held = start - pool.num_free_pages()
        _extend(pool, ev, gen, {1: n}, {1: done + n == total})
        assert held + reserves[-1] <= reserve
        done += n
    for _ in range(40):
        ev.maybe_evict()
        held = start - pool.num_free_pages()
        pos = int(pool.cached_len[1])
        pool.begin_decode([1], [pos])
        assert held + reserves[-1] <= reserve
        ev.observe_decode(0, torch.randn(1, H * G, D, generator=gen))
        ev.observe_decode(1, torch.randn(1, H * G, D, generator=gen))
        for layer in range(L):
            pool.write_decode(layer, torch.randn(1, H, D), torch.randn(1, H, D), torch.ones(1, H, dtype=bool))
    assert int(pool.global_len[1].sum()) <= bound.total_budget and ev.triggers[1] > 0
    pool.free_request(1)
    pool.check_integrity()


def test_a_summed_bound_cuts_only_the_heads_that_hold_the_most():
    """A pool bound caps the request's global tokens summed over its streams: a head that admits
    every token is cut to the common level, heads that admit few keep all they admitted."""
    pool = _pool(pages=3000, slots=2, maxlen=1000)
    ev = SnapKVEvictor(pool, budget=None, num_q_heads=H * G, window=8, rows=1)
    gen = torch.Generator().manual_seed(5)
    pool.alloc_request(1)
    ev.bound_request(1, None, None, lead=2, total_budget=400, total_cap=600)
    n = 400
    pool.begin_extend([1], [0], [n])
    ev.mark_extend([1], [True])
    admit = torch.zeros(n, H, dtype=torch.bool)
    admit[:, 0] = True  # head 0 keeps everything, head 1 one token in ten
    admit[::10, 1] = True
    for layer in range(L):
        ev.observe_extend(layer, torch.randn(n, H * G, D, generator=gen))
        pool.write_extend(layer, torch.randn(n, H, D, generator=gen), torch.randn(n, H, D), admit)
    light = pool.global_len[1, :, 1].clone()
    assert int(pool.global_len[1].sum()) > 600
    ev.maybe_evict()
    glen = pool.global_len[1]
    assert torch.equal(glen[:, 1], light)  # untouched
    assert int(glen.sum()) <= 400 - 2 * L * H and int(glen[:, 0].min()) > int(light.max())
    pool.check_integrity()
