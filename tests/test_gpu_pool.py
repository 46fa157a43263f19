"""Triton pool writes leave the dual-cache pool exactly as its torch ops do."""

import numpy as np
import pytest
import torch

from sglang_wgkv.config import FAR_POSITION, WGKVConfig
from sglang_wgkv.memory import DualCachePool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)"),
]


def _pool(L, H, D, W, dtype, dev, triton_decode=None, triton_extend=False):
    return DualCachePool(
        L,
        H,
        D,
        num_pages=6000,
        max_requests=3,
        max_context_len=3000,
        config=WGKVConfig(local_window=W),
        dtype=dtype,
        device=dev,
        triton_decode=triton_decode,
        triton_extend=triton_extend,
    )


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
    torch_pool, triton_pool = _pool(L, H, D, W, dtype, dev, False), _pool(L, H, D, W, dtype, dev, True)
    slot = 1
    other = [torch.randn(37, H, D, device=dev) for _ in range(L)]
    for pool in (torch_pool, triton_pool):
        pool.alloc_request(0)  # an unrelated request holding pages first
        pool.begin_extend([0], [0], [37])
        for layer in range(L):
            pool.write_extend(
                layer, other[layer], other[layer], torch.ones(37, H, dtype=torch.bool, device=dev)
            )
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
            if (step + layer) % 2:  # in two halves (the served decode: flags from the gate's stream)
                decode_write(triton_pool, layer, req, pos, k, v, None)
                decode_write(triton_pool, layer, req, pos, None, None, admit)
            else:
                decode_write(triton_pool, layer, req, pos, k, v, admit)
        assert_same_pool(torch_pool, triton_pool)
    torch_pool.check_integrity()
    triton_pool.check_integrity()


@pytest.mark.parametrize(
    "n,W,p", [(1000, 64, 0.25), (700, 256, 0.5), (100, 256, 0.3), (2000, 16, 0.0), (513, 32, 1.0)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_pool_writes_match_torch(n, W, p, dtype):
    check_prefill_then_decode(n, W, p, dtype, "cuda")


def _twin_decode_run(seed, dev, L=4, H=8, D=128, W=64, steps=48):
    """Torch-promotion and Triton-promotion pools (CUDA) through one schedule: four requests of
    mixed lengths and admission rates (some inside their ring), batched decode steps."""
    torch.manual_seed(seed)
    pools = [
        DualCachePool(
            L,
            H,
            D,
            num_pages=3000,
            max_requests=6,
            max_context_len=1200,
            config=WGKVConfig(local_window=W),
            device=dev,
            triton_decode=t,
        )
        for t in (False, True)
    ]
    reqs = {1: (700, 0.5), 3: (40, 0.9), 4: (333, 0.1), 5: (64, 1.0)}
    for r, (n, p) in reqs.items():
        k, v, admit = (
            torch.randn(L, n, H, D, device=dev),
            torch.randn(L, n, H, D, device=dev),
            torch.rand(L, n, H, device=dev) < p,
        )
        for pool in pools:
            pool.alloc_request(r)
            pool.begin_extend([r], [0], [n])
            for layer in range(L):
                pool.write_extend(layer, k[layer], v[layer], admit[layer])
    batch = [4, 1, 5, 3]
    for step in range(steps):
        seq = [int(pools[0].cached_len[r]) for r in batch]
        req, pos = torch.tensor(batch, device=dev), torch.tensor(seq, device=dev)
        plans = [pool.begin_decode(batch, seq, req, pos) for pool in pools]
        assert_same_pool(*pools)
        assert pools[0].allocator.free_floor == pools[1].allocator.free_floor
        for name in ("ring_tokens", "ring_page", "ring_off"):
            assert torch.equal(getattr(plans[0], name), getattr(plans[1], name)), name
        k, v = torch.randn(L, 4, H, D, device=dev), torch.randn(L, 4, H, D, device=dev)
        admit = torch.rand(L, 4, H, device=dev) < 0.5
        for pool in pools:
            for layer in range(L):
                pool.write_decode(layer, k[layer], v[layer], admit[layer])
    for pool in pools:
        pool.check_integrity()


@pytest.mark.parametrize("seed,scan_block", [(0, None), (1, None), (1, 32)])
def test_triton_decode_promote_matches_torch(seed, scan_block, monkeypatch):
    """Scan block 32: the 4 x 32 items of a step run as four parallel blocks (counts, allocation,
    num_free) instead of the single-program scan."""
    from sglang_wgkv.memory import triton_pool

    if scan_block:
        monkeypatch.setattr(triton_pool, "PROMOTE_SCAN_BLOCK", scan_block)
    assert DualCachePool(1, 1, 16, 4, 1, 64, config=WGKVConfig(local_window=16), device="cuda").triton_decode
    _twin_decode_run(seed, "cuda")


def test_triton_decode_promote_graph_replay():
    """decode_promote captured in a CUDA graph: replays (req/pos updated in place, free_floor
    lowered by hand as its docstring says) match eager torch promotion step by step."""
    from sglang_wgkv.memory.triton_pool import decode_promote

    dev, L, H, D, W = "cuda", 3, 8, 128, 64
    torch.manual_seed(3)
    pools = [
        DualCachePool(
            L,
            H,
            D,
            num_pages=2000,
            max_requests=2,
            max_context_len=1000,
            config=WGKVConfig(local_window=W),
            device=dev,
            triton_decode=False,
        )
        for _ in range(2)
    ]
    n = 300
    k, v, admit = (
        torch.randn(L, n, H, D, device=dev),
        torch.randn(L, n, H, D, device=dev),
        torch.rand(L, n, H, device=dev) < 0.4,
    )
    for pool in pools:
        pool.alloc_request(1)
        pool.begin_extend([1], [0], [n])
        for layer in range(L):
            pool.write_extend(layer, k[layer], v[layer], admit[layer])
    ref, tri = pools
    req, pos = torch.tensor([1], device=dev), torch.tensor([n], device=dev)
    graph = None
    for step in range(40):
        seq = n + step
        pos.fill_(seq)
        ref.begin_decode([1], [seq])
        tri.allocator.ensure(L * H)
        if graph is None:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up (Triton compile) on a twin, then capture
                scratch = DualCachePool(
                    L,
                    H,
                    D,
                    num_pages=64,
                    max_requests=2,
                    max_context_len=1000,
                    config=WGKVConfig(local_window=W),
                    device=dev,
                )
                decode_promote(scratch, req, pos)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode_promote(tri, req, pos, lower_floor=False)
        graph.replay()
        tri.allocator.free_floor -= L * H
        tri.cached_len[1] = seq + 1
        assert_same_pool(ref, tri)
        kk, vv = torch.randn(L, 1, H, D, device=dev), torch.randn(L, 1, H, D, device=dev)
        aa = torch.rand(L, 1, H, device=dev) < 0.4
        for layer in range(L):
            ref.write_decode(layer, kk[layer], vv[layer], aa[layer])
        tri._decode = ref._decode  # write_decode reads the plan: same slots and positions
        for layer in range(L):
            tri.write_decode(layer, kk[layer], vv[layer], aa[layer])
    assert ref.allocator.free_floor == tri.allocator.free_floor
    tri.check_integrity()


@pytest.mark.parametrize("triton_extend", [False, True], ids=["torch_moves", "triton_moves"])
def test_served_extend_layers_never_wait_for_the_host(triton_extend):
    """The per-layer work of a served prefill (context gather with the plan's page columns, gate
    check, Triton plan + compaction + attention, the pool writes staged and written for the layers at
    once) and the request's end issue no host sync: under
    ``set_sync_debug_mode("error")`` any synchronising op raises. (A sync per layer leaves the GPU idle
    while the host catches up, a large share of each long prefill.)"""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
    from sglang_wgkv.gate.admission import DeferredGateCheck
    from sglang_wgkv.memory.extend_writes import ExtendWrites
    from sglang_wgkv.memory.host_copy import to_device

    dev, L, H, Hq, D, W = "cuda", 2, 4, 8, 128, 64
    pool = _pool(L, H, D, W, torch.bfloat16, dev, triton_extend=triton_extend)
    pool.alloc_request(1)
    gen = torch.Generator(device=dev).manual_seed(0)
    check = DeferredGateCheck(L, dev)
    writes = ExtendWrites(pool)
    for S, n in ((0, 300), (300, 200), (500, 40)):
        plan = pool.begin_extend([1], [S], [n])  # once per forward; may sync
        nk = [n + (plan.context_gcols[0][layer] * 16 + min(S, W) if S else 0) for layer in range(L)]
        kv_indptr = [to_device(dev, np.array([0, m])) for m in nk]
        qo_indptr = to_device(dev, np.array([0, n]))
        q = torch.randn(n, Hq, D, device=dev, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        admit = torch.rand(n, H, device=dev, generator=gen) < 0.5
        pos = torch.arange(S, S + n, device=dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for layer in range(L):
                check.record(torch.rand(n, H, device=dev, generator=gen), layer)
                keys, values, kpos, adm = k, v, pos, admit
                if triton_extend:  # the served read: one launch, its segment rows copied once a forward
                    keys, values, kpos, adm = pool.extend_inputs(layer, k, v, admit, pos, torch.bfloat16)
                elif S:
                    ck, cv, cpos, cadm = pool.gather_context(layer, 1, S, plan.context_gcols[0][layer])
                    keys, values = torch.cat([ck, k]), torch.cat([cv, v])
                    kpos, adm = torch.cat([cpos, pos]), torch.cat([cadm, admit])
                vertical_slash_attention(q, keys, values, adm, qo_indptr, kv_indptr[layer], pos, kpos, W)
                writes.stage(layer, k, v, admit)
            check.end_forward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert keys.shape[0] == nk[-1]
    torch.cuda.synchronize()
    check.poll()  # every gate value was in [0, 1]
    torch.cuda.set_sync_debug_mode("error")
    try:  # the request's end: its pages back on the free stack without waiting for the GPU
        pool.free_request(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pool.num_free_pages() == pool.allocator.num_pages


def test_deferred_gate_check_raises_once_the_counts_land():
    from sglang_wgkv.gate import GateOutputError
    from sglang_wgkv.gate.admission import DeferredGateCheck

    check = DeferredGateCheck(3, "cuda")
    check.record(torch.full((5, 2), 0.5, device="cuda"), 0)
    check.end_forward()
    torch.cuda.synchronize()
    check.poll()
    g = torch.full((5, 2), 0.5, device="cuda")
    g[2, 1] = float("nan")
    check.record(g, 2)
    check.end_forward()
    torch.cuda.synchronize()
    with pytest.raises(GateOutputError, match="1 NaN/out-of-range values \\(first in layer 2\\)"):
        check.poll()


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["cast", "same"])
def test_triton_extend_chunks_match_torch(in_dtype):
    """Chunked prefill on twin pools, torch vs Triton row movement (``triton_extend.extend_context``,
    ``extend_move`` and ``extend_ring_write``): the attention inputs and the pool after each chunk;
    batches of requests extended after cached prefixes inside and past the ring, chunks shorter and
    longer than the ring, mixed admission, rows cast to the pool's dtype (float32 in) or not (bf16 in,
    as served); every other chunk's writes in one group of layers (the moves a layer each from one
    index pass)."""
    dev, L, H, D, W = "cuda", 3, 8, 128, 64
    torch.manual_seed(7)
    pools = [
        DualCachePool(
            L,
            H,
            D,
            num_pages=6000,
            max_requests=4,
            max_context_len=3000,
            config=WGKVConfig(local_window=W),
            device=dev,
            triton_decode=t,
            triton_extend=t,
        )
        for t in (False, True)
    ]
    for pool in pools:
        for r in (0, 2, 3):
            pool.alloc_request(r)
    chunks = [([0, 2], [100, 7]), ([0, 2, 3], [1, 64, 200]), ([3], [63]), ([0, 3], [300, 5]), ([2], [1000])]
    for i, (batch, lens) in enumerate(chunks):
        grouped = i % 2 == 1  # every layer's writes in one group (ExtendWrites), after all reads
        prefix = [int(pools[0].cached_len[r]) for r in batch]
        N = sum(lens)
        k, v = (
            torch.randn(L, N, H, D, device=dev).to(in_dtype),
            torch.randn(L, N, H, D, device=dev).to(in_dtype),
        )
        admit = torch.rand(L, N, H, device=dev) < 0.4
        positions = torch.cat([torch.arange(S, S + n, device=dev) for S, n in zip(prefix, lens)])
        for pool in pools:
            pool.begin_extend(batch, prefix, lens)
        for layer in range(L):
            (k0, v0, p0, a0), (k1, v1, p1, a1) = [
                pool.extend_inputs(layer, k[layer], v[layer], admit[layer], positions, torch.bfloat16)
                for pool in pools
            ]
            read = ~((p0 == FAR_POSITION)[:, None] & ~a0)  # global padding rows are never read
            assert torch.equal(p0, p1) and torch.equal(a0, a1)
            assert torch.equal(k0[read], k1[read]) and torch.equal(v0[read], v1[read])
            for pool in pools if not grouped else ():
                pool.write_extend(layer, k[layer], v[layer], admit[layer])
        for pool in pools if grouped else ():
            pool.write_extend_layers(0, k, v, admit)
        assert_same_pool(*pools)
    for pool in pools:
        pool.check_integrity()


def test_batched_context_reads_without_sync_equal_the_reference():
    """Two requests continuing after cached prefixes (one past the ring) and a new one, in one extend:
    after the forward's one read of its context sizes (``ExtendPlan.context_gcols``, the only sync of
    a forward whose requests hold global entries) each layer's inputs through the plan's ContextIndex
    are issued with no host sync and equal the request-by-request reads."""
    dev, L, H, D, W = "cuda", 2, 4, 128, 64
    pool = _pool(L, H, D, W, torch.bfloat16, dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    for r in (0, 1, 2):
        pool.alloc_request(r)
    pool.begin_extend([0, 1], [0, 0], [300, 40])
    for layer in range(L):
        k, v = (torch.randn(340, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        pool.write_extend(layer, k, v, torch.rand(340, H, device=dev, generator=gen) < 0.5)
    pool.begin_extend([0, 1, 2], [300, 40, 0], [70, 20, 90])
    positions = torch.cat([torch.arange(300, 370), torch.arange(40, 60), torch.arange(90)]).to(dev)
    assert pool._extend.context_gcols[0][0] > 0  # request 0's prefix reaches past the ring
    for layer in range(L):
        k, v = (torch.randn(180, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        admit = torch.rand(180, H, device=dev, generator=gen) < 0.5
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = pool.extend_inputs(layer, k, v, admit, positions, torch.bfloat16)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = pool.extend_inputs_reference(layer, k, v, admit, positions, torch.bfloat16)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        pool.write_extend(layer, k, v, admit)


def test_usage_ledger_copy_is_queued_behind_the_forward_before():
    """The ledger's copy on a forward stream sees that stream's earlier writes and none of its later
    ones, and reading it waits for the copy only (a long later launch is still running)."""
    from sglang_wgkv.integration.requests.usage_ledger import UsageLedger

    dual = DualCachePool(4, 8, 64, 256, 4, 512, WGKVConfig(local_window=32), device="cuda")
    dual.alloc_request(1)
    forward, ledger = torch.cuda.Stream(), UsageLedger()
    forward.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward):
        torch.cuda._sleep(50_000_000)  # forward k, still running when the copy is queued
        dual.global_len[1].fill_(3)
    ledger.record(dual, None, torch.cuda, forward)
    with torch.cuda.stream(forward):
        dual.global_len[1].fill_(9)  # forward k + 1
        torch.cuda._sleep(500_000_000)
    counts = ledger.counts(1)
    assert (counts.kept, counts.max_global) == (3 * 4 * 8, 3)
    assert not forward.query()  # only the copy was waited for, not forward k + 1
    forward.synchronize()


def test_forward_plans_copy_their_index_lists_without_a_sync():
    """The host plans of a forward hand their index lists to the GPU without waiting for it: an
    extend's plan (its new ring pages and candidate lists), the observation window's first record of
    that forward (new requests' window rows reset), and a decode step whose rings cross a page
    boundary, all under ``set_sync_debug_mode("error")`` (a pageable copy waits for the stream, and
    the GPU then idles while the host launches what follows)."""
    from sglang_wgkv.memory.evictor import SnapKVEvictor

    dev, L, H, G, D, W = "cuda", 2, 4, 2, 128, 64
    pool = _pool(L, H, D, W, torch.bfloat16, dev)
    ev = SnapKVEvictor(pool, budget=None, num_q_heads=H * G, window=16)
    gen = torch.Generator(device=dev).manual_seed(5)
    for r in (0, 1):
        pool.alloc_request(r)
    q = torch.randn(132, H * G, D, device=dev, dtype=torch.bfloat16, generator=gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.begin_extend([0, 1], [0, 0], [100, 32])
        for layer in range(L):
            ev.observe_extend(layer, q)
        for layer in range(L):
            kv = torch.randn(2, 132, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
            pool.write_extend(layer, kv[0], kv[1], torch.rand(132, H, device=dev, generator=gen) < 0.5)
        pool.begin_decode([0, 1], [100, 32])  # request 1's ring takes a new page at 32
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    pool.check_integrity()
    for r, first, n in ((0, 0, 100), (1, 100, 32)):  # each request's last 16 queries, by position
        row = int(ev.row[r])
        assert sorted(ev.q_pos[row].tolist()) == list(range(n - 16, n))
        for p in range(n - 16, n):
            assert torch.equal(ev.q_buf[row, 1, p % 16], q[first + p].to(ev.q_buf.dtype))


def test_queued_free_count_and_snapshot_release_need_no_sync():
    """The allocator's queued free count (behind a long kernel) and a snapshot's release raise the
    host's floor with no host sync; once the count lands the floor is the device's count less what
    was allocated after it was queued."""
    from sglang_wgkv.memory.page_allocator import PageAllocator

    alloc = PageAllocator(1000, device="cuda")
    alloc.free(alloc.alloc(300))  # the floor still at 700
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):  # the count lands after these
            busy = busy @ busy / 64
        alloc.queue_refresh()
        alloc.alloc_where(torch.ones(50, dtype=torch.bool, device="cuda"))
        alloc.take_queued()  # landed or not, it waits for nothing
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    alloc.take_queued()
    assert alloc.free_floor == 950 == int(alloc.num_free)

    pool = _pool(1, 2, 64, 16, torch.bfloat16, "cuda")
    pool.alloc_request(1)
    n = 40
    k = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16)
    pool.begin_extend([1], [0], [n])
    pool.write_extend(0, k, k, torch.ones(n, 2, dtype=torch.bool, device="cuda"))
    snap = pool.take_snapshot(1)
    pool.free_request(1)
    floor = pool.allocator.free_floor
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.release_snapshot(snap)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pool.allocator.free_floor == floor + snap.private_pages
    expected = pool.allocator.expected_free  # the held count landed by now (the release came after it)
    exact = pool.num_free_pages()  # (syncs)
    # every page is back; the floor and what is expected to return are lower bounds (the floor fell by
    # the extend's worst case, not by the pages it took)
    assert exact == pool.allocator.num_pages
    assert floor + snap.private_pages <= expected <= exact


def test_request_pool_alloc_waits_for_nothing():
    """The request pool's ``alloc`` (the overlap scheduler runs it while a forward is in flight) and a
    bounded slot's window row make no host sync (``tests/test_serving_units.py`` counts the same on
    CPU)."""
    from types import SimpleNamespace

    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime
    from sglang_wgkv.integration.plugin.settings import ServingSettings
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool
    from sglang_wgkv.memory import SnapKVEvictor

    dual = _pool(2, 2, 64, 16, torch.bfloat16, "cuda")
    runtime = WGKVRuntime(ServingSettings(config=dual.config), dual=dual)
    pool = WGKVReqToTokenPool(
        size=2, max_context_len=128, device="cuda", enable_memory_saver=False, runtime=runtime
    )
    evictor = SnapKVEvictor(dual, budget=None, num_q_heads=4, window=8, rows=1)
    reqs = [
        SimpleNamespace(req_pool_idx=None, sampling_params=SimpleNamespace(custom_params=p), output_ids=[])
        for p in ({"wgkv": {"tau": 0.5}}, None)
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.alloc(reqs)
        evictor.bound_request(reqs[0].req_pool_idx, budget=48)
        evictor.release_request(reqs[0].req_pool_idx)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pool.slot_tau[[r.req_pool_idx for r in reqs]].tolist() == pytest.approx([0.5, dual.config.tau])
