"""The prefix cache frees pages without stopping the host: a reclaim drops snapshots on the host's
floor of free pages and what the drops are expected to return, with one exact count (a host sync)
where a count after every drop kept the host from running ahead of the GPU; after a launch the cache
keeps a headroom of free pages with no count at all (``overlap.refresh_free_pages``)."""

from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.pool_driver import run_extend
from sglang_wgkv.testing.snapshot_cache import snapshot_cache, snapshot_prompt

pytestmark = [pytest.mark.radix]

W, P, SLOTS, PAGES = 16, 40, 10, 64  # each prompt: one ring page and two global pages


def _cache_with_snapshots():
    """A pool whose finished requests left SLOTS prompt snapshots (3 pages each), the floor exact."""
    dual = DualCachePool(1, 1, 8, PAGES, SLOTS, 128, WGKVConfig(local_window=W), dtype=torch.float32)
    cache = snapshot_cache(dual)
    torch.manual_seed(0)
    for r in range(SLOTS):
        k, v, q = (torch.randn(1, P, 1, 8) for _ in range(3))
        dual.alloc_request(r)
        run_extend(dual, [r], [0], [P], q, k, v, torch.ones(1, P, 1, dtype=torch.bool), W)
        snapshot_prompt(cache, r, [1000 * (r + 1) + i for i in range(P)])
        dual.free_request(r)
    dual.allocator.sync_free()
    return cache, dual


def _count_syncs(dual, monkeypatch) -> list:
    calls, exact = [], dual.allocator.sync_free

    def counted():
        calls.append(1)
        return exact()

    monkeypatch.setattr(dual.allocator, "sync_free", counted)
    return calls


def test_reclaim_drops_with_one_exact_count(monkeypatch):
    cache, dual = _cache_with_snapshots()
    assert cache.snapshots_taken == SLOTS and dual.allocator.free_floor == PAGES - 3 * SLOTS
    syncs = _count_syncs(dual, monkeypatch)
    need = PAGES - 3 * SLOTS + 3 * 4  # four snapshots' pages
    cache.reclaim(need)
    assert len(syncs) <= 1 and dual.allocator.can_allocate(need)
    assert cache.snapshots_dropped == 4  # the four least recently used, no more
    assert sorted(n.snapshot.length for n in cache._snap_nodes) == [P] * (SLOTS - 4)
    cache.check_integrity()


def test_keep_headroom_drops_without_a_host_sync(monkeypatch):
    cache, dual = _cache_with_snapshots()

    def no_sync():
        raise AssertionError("keep_headroom synced")

    monkeypatch.setattr(dual.allocator, "sync_free", no_sync)
    headroom = PAGES - 3 * SLOTS + 3 * 2
    cache.keep_headroom(headroom)
    assert cache.snapshots_dropped == 2
    cache.keep_headroom(headroom)  # the floor already counts the drops' ring copies: none more
    assert cache.snapshots_dropped == 2
    dual.allocator.queue_refresh()  # what the next launch queues shows what they returned
    dual.allocator.take_queued()
    assert dual.allocator.free_floor == headroom == int(dual.allocator.num_free)
    cache.check_integrity()


def test_a_release_raises_the_floor_by_its_ring_copies():
    cache, dual = _cache_with_snapshots()
    floor = dual.allocator.free_floor
    (node, *_) = sorted(cache._snap_nodes, key=lambda n: n.last_access_time)
    assert node.snapshot.private_pages == 1 and node.snapshot.held_pages(0) == 3
    cache._drop(node)
    assert dual.allocator.free_floor == floor + 1 and dual.num_free_pages() == floor + 3


def test_each_launch_queues_a_count_and_keeps_the_headroom(monkeypatch):
    """``refresh_free_pages`` (after ``run_batch``): a count queued, then snapshots dropped down to
    ``admission_headroom`` (an eighth of this small pool), no host sync."""
    from sglang_wgkv.integration.plugin.overlap import admission_headroom, refresh_free_pages
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    cache, dual = _cache_with_snapshots()
    taken = dual.allocator.alloc(PAGES - 3 * SLOTS - 2)  # a running request's pages: 2 left free
    runtime = SimpleNamespace(dual=dual, prefix_cache=cache, chunk_tokens=16, has_pool=lambda: True)
    pool = WGKVReqToTokenPool.__new__(WGKVReqToTokenPool)
    pool.runtime = runtime
    scheduler = SimpleNamespace(req_to_token_pool=pool, enable_overlap=True)
    monkeypatch.setattr(dual.allocator, "sync_free", lambda: pytest.fail("a host sync"))
    assert admission_headroom(dual, 16) == PAGES // 8
    refresh_free_pages(None, scheduler)
    assert cache.snapshots_dropped == 2 and dual.allocator.expected_free == 2 + 3 * 2
    refresh_free_pages(None, scheduler)  # its count, queued after the drops, has what they returned
    assert cache.snapshots_dropped == 2 and dual.allocator.free_floor == 2 + 3 * 2
    dual.allocator.free(taken, returned=taken.numel())


def test_keep_headroom_keeps_the_snapshots_taken_ahead_of_a_launch():
    """A prompt's end snapshotted ahead of its next launch (its cache call has not run) is never a
    headroom victim; an on-demand reclaim may still take it, last."""
    cache, dual = _cache_with_snapshots()
    k = torch.randn(1, P, 1, 8)
    dual.alloc_request(0)
    cache.before_forward([0], [(0, P)])  # the prefill's launch owes the slot a cache call
    run_extend(dual, [0], [0], [P], k, k, k, torch.ones(1, P, 1, dtype=torch.bool), W)
    cache.before_forward([0], [])  # the next launch: the prompt's end is snapshotted ahead
    assert list(cache._ahead) == [0]
    cache.keep_headroom(PAGES)
    assert not cache._snap_nodes and list(cache._ahead) == [0]
    cache.reclaim(PAGES)
    assert not cache._ahead


def test_a_pool_full_of_snapshots_admits_without_host_syncs():
    """``benchmarks.reclaim_syncs``' rounds (admissions checked, a forward, prompt-end snapshots, the
    oldest requests finishing) on a pool kept full of snapshots: the reclaim as it was synced more than
    once an admission; with the count queued and the headroom kept after each launch, none, for the
    same admissions."""
    from benchmarks.reclaim_syncs import run

    was = run("reclaim_as_was", rounds=150, per_round=3, pages=2400)
    now = run("reclaim_and_headroom", rounds=150, per_round=3, pages=2400)
    assert was["admissions"] == now["admissions"] == 450 and was["snapshots_dropped"] > 200
    assert was["syncs_per_admission"] > 1 and now["host_syncs"] == 0


@pytest.mark.parametrize("prompt", [10, P])  # inside the ring, past it
def test_a_request_free_raises_the_floor_by_its_ring_pages(prompt):
    dual = DualCachePool(1, 2, 8, PAGES, 2, 128, WGKVConfig(local_window=W), dtype=torch.float32)
    k = torch.randn(1, prompt, 2, 8)
    dual.alloc_request(0)
    run_extend(dual, [0], [0], [prompt], k, k, k, torch.ones(1, prompt, 2, dtype=torch.bool), W)
    floor = dual.allocator.free_floor
    dual.free_request(0)
    ring_pages = 2 * -(-min(prompt, W) // 16)
    assert dual.allocator.free_floor == floor + ring_pages <= dual.num_free_pages() == PAGES
