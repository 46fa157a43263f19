"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_triton_pool_interp.py``: the Triton pool kernels (decode promotion, the extend write's row
movement) vs the torch reference on CPU.

``python tests/triton_pool_interp_check.py CASE [CASE ...]`` (``SEED`` or ``SEED/SCAN_BLOCK``) prints a line
per case and exits non-zero if any differs.
"""

import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sglang_wgkv.config import FAR_POSITION as FAR  # noqa: E402
from sglang_wgkv.config import WGKVConfig  # noqa: E402
from sglang_wgkv.memory import DualCachePool, triton_pool  # noqa: E402
from sglang_wgkv.memory.page_allocator import PoolExhausted  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402

L, H, D, W, R, CTX = 2, 3, 16, 32, 5, 200


def bf16(x):
    """Extend rows in the pool's dtype, as served (the model's dtype): Triton 3.6's interpreter rounds
    float32 -> bfloat16 toward zero where CUDA and torch round to nearest, so a cast inside a kernel is
    compared on the GPU (tests/test_gpu_pool.py), not here."""
    return x.to(torch.bfloat16)


def make_pool(num_pages, triton):
    """A pool on the torch ops (False) or on every Triton pool launch (True: promotion and extend)."""
    return DualCachePool(
        L,
        H,
        D,
        num_pages=num_pages,
        max_requests=R,
        max_context_len=CTX,
        config=WGKVConfig(local_window=W),
        dtype=torch.bfloat16,
        triton_decode=triton,
        triton_extend=triton,
    )


def assert_same(a, b, where, plans=None):
    """Equal pool state (page contents on every page but the dump page) and decode plans."""

    def check(ok, what):
        if not ok:
            raise AssertionError(f"{where}: {what} differs")

    for name in ("page_table", "global_len", "ring_flag", "left_ring", "promoted"):
        check(torch.equal(getattr(a, name), getattr(b, name)), name)
    check(torch.equal(a.k_pages[:-1], b.k_pages[:-1]), "k_pages")
    check(torch.equal(a.v_pages[:-1], b.v_pages[:-1]), "v_pages")
    check(np.array_equal(a.cached_len, b.cached_len), "cached_len")
    for name in ("num_free", "free_stack", "ref"):
        check(torch.equal(getattr(a.allocator, name), getattr(b.allocator, name)), f"allocator.{name}")
    check(a.allocator.free_floor == b.allocator.free_floor, "allocator.free_floor")
    if plans is not None:
        pa, pb = plans
        for name in ("req", "pos", "ring_tokens", "ring_page", "ring_off"):
            x, y = getattr(pa, name), getattr(pb, name)
            check(x.dtype == y.dtype and torch.equal(x, y), f"plan.{name}")


def write_layers(pool, k, v, admit, grouped):
    """An extend's writes of every layer: one ``write_extend`` a layer, or one group of them all
    (``write_extend_layers``: the index work once, the moves a layer each)."""
    if grouped:
        pool.write_extend_layers(0, k, v, admit)
        return
    for layer in range(L):
        pool.write_extend(layer, k[layer], v[layer], admit[layer])


def scenario(seed):
    """Twin pools driven by one random schedule: extends with mixed admission, decode batches
    mixing requests inside and past the ring (ring page crossings, promotions at global page
    boundaries), frees and re-allocations (a shuffled free stack), a pool run close to empty; the
    extends write one layer at a time or all in one group (both pools alike: a group allocates its
    pages in another order), at random."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_pages = rng.choice([90, 120, 160])
    ref, tri = make_pool(num_pages, False), make_pool(num_pages, True)
    pools = (ref, tri)
    live = {}
    min_free, promoted_any, chunked_any = num_pages, False, False
    for step in range(60):
        free_slots = [r for r in range(R) if r not in live]
        if free_slots and (len(live) < 2 or rng.random() < 0.15):
            r = rng.choice(free_slots)
            n = rng.choice([1, 15, 16, 17, W - 1, W, W + 1, rng.randrange(1, 90)])
            p = rng.choice([0.0, 0.3, 0.7, 1.0])
            k, v = bf16(torch.randn(L, n, H, D)), bf16(torch.randn(L, n, H, D))
            admit = torch.rand(L, n, H) < p
            grouped = rng.random() < 0.5  # every layer in one group
            try:
                for pool in pools:
                    pool.alloc_request(r)
                    pool.begin_extend([r], [0], [n])
                    write_layers(pool, k, v, admit, grouped)
                live[r] = p
            except PoolExhausted:
                for pool in pools:
                    if pool.active[r]:
                        pool.free_request(r)
        elif live and rng.random() < 0.08:
            r = rng.choice(sorted(live))
            for pool in pools:
                pool.free_request(r)
            del live[r]
        elif live and rng.random() < 0.2:
            # a chunk after a cached prefix (chunked prefill): ring tokens leave, some of the chunk
            # passes through the ring, its last tokens land in it (write_extend's three movements)
            batch = [r for r in sorted(live) if rng.random() < 0.6 and ref.cached_len[r] < CTX - 45]
            if not batch:
                continue
            prefix = [int(ref.cached_len[r]) for r in batch]
            lens = [rng.choice([1, 7, 16, W - 3, W + 5, 40]) for _ in batch]
            N = sum(lens)
            k, v = bf16(torch.randn(L, N, H, D)), bf16(torch.randn(L, N, H, D))
            admit = torch.rand(L, N, H) < rng.choice([0.0, 0.4, 1.0])
            refused = []
            for pool in pools:
                try:
                    pool.begin_extend(batch, prefix, lens)
                except PoolExhausted:
                    refused.append(pool)
            if refused:  # both pools must refuse, unchanged
                assert len(refused) == 2, f"seed {seed} step {step}: one pool refused the extend"
                assert_same(ref, tri, f"seed {seed} step {step} (extend refused)")
                break
            positions = torch.cat([torch.arange(S, S + n) for S, n in zip(prefix, lens)])
            grouped = rng.random() < 0.5
            for layer in range(L):
                got = [
                    pool.extend_inputs(layer, k[layer], v[layer], admit[layer], positions, torch.bfloat16)
                    for pool in pools
                ]
                (k0, v0, p0, a0), (k1, v1, p1, a1) = got
                # a global row past its head's length (padding to the longest head) is never read: it
                # may point at the dump page, whose contents the two pools need not share
                read = ~((p0 == FAR)[:, None] & ~a0)
                for name, x, y, rows in (
                    ("keys", k0, k1, read),
                    ("values", v0, v1, read),
                    ("k_pos", p0, p1, None),
                    ("admitted", a0, a1, None),
                ):
                    same = (
                        x.dtype == y.dtype
                        and x.shape == y.shape
                        and (torch.equal(x, y) if rows is None else torch.equal(x[rows], y[rows]))
                    )
                    if not same:
                        raise AssertionError(
                            f"seed {seed} step {step} layer {layer}: extend_inputs {name} differs"
                        )
                if not grouped:
                    for pool in pools:
                        pool.write_extend(layer, k[layer], v[layer], admit[layer])
            if grouped:  # after every layer read its context, as ExtendWrites flushes a group
                for pool in pools:
                    pool.write_extend_layers(0, k, v, admit)
            chunked_any = True
            assert_same(ref, tri, f"seed {seed} step {step} extend {batch} after {prefix} by {lens}")
        else:
            batch = [r for r in sorted(live) if rng.random() < 0.8 and ref.cached_len[r] < CTX - 1]
            rng.shuffle(batch)
            if not batch:
                continue
            seq = [int(ref.cached_len[r]) for r in batch]
            req_dev, pos_dev = torch.tensor(batch), torch.tensor(seq)
            plans = []
            for pool in pools:
                try:
                    plans.append(pool.begin_decode(batch, seq, req_dev, pos_dev))
                except PoolExhausted:
                    plans.append(None)
            if None in plans:  # both pools must refuse, unchanged
                assert plans == [None, None], f"seed {seed} step {step}: one pool exhausted"
                assert_same(ref, tri, f"seed {seed} step {step} (exhausted)")
                break
            promoted_any |= any(s >= W for s in seq)
            assert_same(ref, tri, f"seed {seed} step {step} begin_decode {batch} at {seq}", plans)
            k, v = torch.randn(L, len(batch), H, D), torch.randn(L, len(batch), H, D)
            admit = torch.rand(L, len(batch), H) < torch.tensor([live[r] for r in batch])[:, None]
            for pool in pools:
                for layer in range(L):
                    pool.write_decode(layer, k[layer], v[layer], admit[layer])
        min_free = min(min_free, int(ref.allocator.num_free))
    assert_same(ref, tri, f"seed {seed} end")
    ref.check_integrity()
    tri.check_integrity()
    return min_free, num_pages, promoted_any, chunked_any


def direct(seed):
    """``decode_promote`` itself against ``_promote`` on one batch (every request past its ring)."""
    torch.manual_seed(seed)
    ref, tri = make_pool(400, False), make_pool(400, False)
    for pool in (ref, tri):
        for r, n in ((0, 40), (2, 47), (3, 64), (4, 100)):
            pool.alloc_request(r)
    for r, n in ((0, 40), (2, 47), (3, 64), (4, 100)):
        k, v, admit = bf16(torch.randn(n, H, D)), bf16(torch.randn(n, H, D)), torch.rand(n, H) < 0.6
        for pool in (ref, tri):
            pool.begin_extend([r], [0], [n])
            for layer in range(L):
                pool.write_extend(layer, k, v, admit)
    req, pos = torch.tensor([4, 0, 3, 2]), torch.tensor([100, 40, 64, 47])
    ref._promote(req, pos)
    triton_pool.decode_promote(tri, req, pos)
    assert_same(ref, tri, f"direct seed {seed}")


def dense_chunks(seed):
    """Requests that keep every token, chunk after chunk, on plans marked ``exact_global`` (the dense
    prefill's): each layer's keys, values and positions on both pools are every row of the request so
    far in position order, all admitted, no page padding."""
    gen = torch.Generator().manual_seed(seed)
    pools = (make_pool(400, False), make_pool(400, True))
    slots, total = [1, 3], [0, 0]
    rows = {r: ([], []) for r in slots}  # per slot, per layer-stacked chunks of k and v
    for pool in pools:
        for r in slots:
            pool.alloc_request(r)
    for lens in ([40, 9], [30, 50], [1, 17]):
        N = sum(lens)
        k, v = bf16(torch.randn(L, N, H, D, generator=gen)), bf16(torch.randn(L, N, H, D, generator=gen))
        admit = torch.ones(L, N, H, dtype=torch.bool)
        positions = torch.cat([torch.arange(S, S + n) for S, n in zip(total, lens)])
        for pool in pools:
            pool.begin_extend(slots, list(total), lens).exact_global = True
        start = 0
        for r, n in zip(slots, lens):
            rows[r][0].append(k[:, start : start + n])
            rows[r][1].append(v[:, start : start + n])
            start += n
        for layer in range(L):
            got = [
                pool.extend_inputs(layer, k[layer], v[layer], admit[layer], positions, torch.bfloat16)
                for pool in pools
            ]
            want_k = torch.cat([torch.cat(rows[r][0], 1)[layer] for r in slots])
            want_v = torch.cat([torch.cat(rows[r][1], 1)[layer] for r in slots])
            want_pos = torch.cat([torch.arange(S + n) for S, n in zip(total, lens)])
            for name, (keys, values, k_pos, adm) in zip(("torch", "triton"), got):
                ctx = torch.cat([torch.full((S + n,), S > 0 and S > W) for S, n in zip(total, lens)])
                if not (torch.equal(keys, want_k) and torch.equal(values, want_v) and bool(adm.all())):
                    raise AssertionError(
                        f"dense seed {seed} layer {layer}: {name} keys differ from the rows so far"
                    )
                # global entries sit at FAR, the ring and new rows at their positions
                far = k_pos == FAR
                if not torch.equal(torch.where(far, want_pos, k_pos), want_pos) or bool((far & ~ctx).any()):
                    raise AssertionError(f"dense seed {seed} layer {layer}: {name} key positions differ")
        for pool in pools:
            pool.write_extend_layers(0, k, v, admit)
        total = [S + n for S, n in zip(total, lens)]
    assert_same(*pools, f"dense seed {seed}")


def run(case: str) -> str:
    """``SEED`` or ``SEED/SCAN_BLOCK`` (the promotion scan's block for this case only)."""
    seed, _, scan_block = case.partition("/")
    seed, default_block = int(seed), triton_pool.PROMOTE_SCAN_BLOCK
    triton_pool.PROMOTE_SCAN_BLOCK = int(scan_block) if scan_block else default_block
    try:
        direct(seed)
        dense_chunks(seed)
        min_free, num_pages, promoted_any, chunked_any = scenario(seed)
    finally:
        triton_pool.PROMOTE_SCAN_BLOCK = default_block
    return f"min free pages {min_free}/{num_pages}, promoted {promoted_any}, chunked {chunked_any}"


if __name__ == "__main__":
    sys.exit(check_seeds(run, sys.argv[1:]))
