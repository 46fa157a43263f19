"""The evictor over long random runs: budget, integrity, order, lowest-scored selection, no leaks.

A plain-Python model tracks, per stream, the positions in its global cache. Every value vector carries
its (position, layer, head) in channels 0..2, so the pool's global pages can be read back and
compared with the model. Before each eviction the model scores the over-budget streams with the
independent loop of ``test_evictor_scores`` from its own record of queries and keys, and checks
that exactly the lowest-scored entries left and that the survivors kept their order.
"""

import math

import numpy as np
import pytest
import torch
from test_evictor_scores import naive_scores

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import padded_decode_attention, paged_decode_attention
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor
from sglang_wgkv.memory.prefix_snapshot import SnapshotStore

pytestmark = pytest.mark.evictor


@pytest.fixture(autouse=True)
def _one_thread():
    # These tensors are tiny: OpenMP threads only contend (milliseconds per op on a loaded 2-core box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


L, H, G, D = 2, 2, 2, 8


class Req:
    """One request's full record (queries, keys, values, admission flags) and its model cache."""

    def __init__(self, slot, total, p_admit, gen):
        self.slot, self.n = slot, 0
        self.q = torch.randn(L, total, H * G, D, generator=gen)
        self.k = torch.randn(L, total, H, D, generator=gen)
        self.v = torch.randn(L, total, H, D, generator=gen)
        self.v[..., 0] = torch.arange(total, dtype=torch.float32)[None, :, None]
        self.v[..., 1] = torch.arange(L, dtype=torch.float32)[:, None, None]
        self.v[..., 2] = torch.arange(H, dtype=torch.float32)[None, None, :]
        self.admit = torch.rand(L, total, H, generator=gen) < p_admit
        self.glob = [[[] for _ in range(H)] for _ in range(L)]

    def advance(self, m, W):
        """Model of the pool: tokens n..n+m-1 are written; those leaving the ring are promoted."""
        for p in range(self.n, self.n + m):
            victim = p - W
            if victim >= 0:
                for layer in range(L):
                    for h in range(H):
                        if self.admit[layer, victim, h]:
                            self.glob[layer][h].append(victim)
        self.n += m


class Run:
    def __init__(
        self, W, window, budget, pages, slots, maxlen, seed, device="cpu", lead=0, prompt_window=None
    ):
        self.W, self.window, self.budget, self.maxlen, self.lead = W, window, budget, maxlen, lead
        self.dev = torch.device(device)
        self.pool = DualCachePool(
            L, H, D, pages, slots, maxlen, WGKVConfig(local_window=W), dtype=torch.float32, device=device
        )
        self.ev = SnapKVEvictor(
            self.pool, budget=budget, num_q_heads=H * G, window=window, lead=lead, prompt_window=prompt_window
        )
        self.gen = torch.Generator().manual_seed(seed)
        self.reqs = {}
        self.evictions_checked = 0
        self.check_attention = True

    def new(self, slot, p_admit):
        self.pool.alloc_request(slot)
        self.reqs[slot] = Req(slot, self.maxlen, p_admit, self.gen)

    def extend(self, lens):
        reqs = [self.reqs[s] for s in lens]
        ns = list(lens.values())
        self.pool.begin_extend(list(lens), [r.n for r in reqs], ns)
        pack = lambda x: torch.cat([getattr(r, x)[:, r.n : r.n + m] for r, m in zip(reqs, ns)], 1).to(
            self.dev
        )
        q, k, v, a = pack("q"), pack("k"), pack("v"), pack("admit")
        for layer in range(L):
            self.ev.observe_extend(layer, q[layer])
            self.pool.write_extend(layer, k[layer], v[layer], a[layer])
        for r, m in zip(reqs, ns):
            r.advance(m, self.W)

    def decode(self, slots):
        reqs = [self.reqs[s] for s in slots]
        pos = [r.n for r in reqs]
        self.pool.begin_decode(slots, pos)
        for r in reqs:
            r.advance(1, self.W)
        at = lambda x: torch.stack([getattr(r, x)[:, p] for r, p in zip(reqs, pos)], 1).to(self.dev)
        q, k, v, a = at("q"), at("k"), at("v"), at("admit")
        for layer in range(L):
            self.pool.write_decode(layer, k[layer], v[layer], a[layer])
            self.ev.observe_decode(layer, q[layer])
            if not self.check_attention:
                continue
            rows, num_pages, last, _ = self.pool.decode_page_rows(layer)
            indptr, indices, last_len = build_folded_indices(rows, num_pages, last)
            got = paged_decode_attention(
                q[layer], self.pool.k_pages, self.pool.v_pages, indptr, indices, last_len
            )
            want = self._oracle_decode(reqs, layer, q[layer].cpu())
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)

    def _oracle_decode(self, reqs, layer, q):
        """Attention over the model's cache: surviving global positions + the ring."""
        lens = torch.tensor([[len(r.glob[layer][h]) + min(r.n, self.W) for h in range(H)] for r in reqs])
        Lmax = int(lens.max())
        k = torch.zeros(len(reqs), H, Lmax, D)
        v = torch.zeros(len(reqs), H, Lmax, D)
        for b, r in enumerate(reqs):
            for h in range(H):
                idx = r.glob[layer][h] + list(range(max(0, r.n - self.W), r.n))
                k[b, h, : len(idx)] = r.k[layer, idx, h]
                v[b, h, : len(idx)] = r.v[layer, idx, h]
        return padded_decode_attention(q, k, v, lens)

    # -- checks -------------------------------------------------------------------------------
    def pool_global(self, r, layer, h):
        """Positions in the pool's global cache of a stream, read through its page table."""
        pool = self.pool
        g = int(pool.global_len[r, layer, h])
        pages = pool.page_table[r, layer, h, pool.ring_cols :].long()
        vals = pool.v_pages[pages].reshape(-1, D)[:g].cpu()
        assert torch.all(vals[:, 1] == layer) and torch.all(vals[:, 2] == h)
        return [int(x) for x in vals[:, 0].tolist()]

    def check_matches_model(self):
        for s, r in self.reqs.items():
            for layer in range(L):
                for h in range(H):
                    assert self.pool_global(s, layer, h) == r.glob[layer][h], (s, layer, h)

    def naive_stream_scores(self, r, layer, h, prompt=False):
        """The independent scores of a stream by the decode window or, with ``prompt``, by the
        prompt-end window and kernel."""
        W, n = self.W, r.n
        window = self.ev.prompt_window if prompt else self.window
        qpos = list(range(max(0, n - window), n))
        q = r.q[layer, qpos].view(len(qpos), H, G, D)[:, h]
        gpos = r.glob[layer][h]
        rpos = list(range(max(0, n - W), n))
        return naive_scores(
            q,
            qpos,
            r.k[layer, gpos, h],
            len(gpos),
            r.k[layer, rpos, h],
            rpos,
            1 / math.sqrt(D),
            self.ev.prompt_kernel if prompt else self.ev.kernel_size,
        )

    def evict_and_check(self):
        """maybe_evict, checked against the model; then the model follows the pool.

        A look must happen when a stream is over the budget; when one happens (it may also on a loose
        host bound), every stream over ``T = budget - lead`` loses its lowest-scored entries."""
        target = self.budget - self.lead
        lengths = {
            (s, layer, h): len(r.glob[layer][h])
            for s, r in self.reqs.items()
            for layer in range(L)
            for h in range(H)
        }
        must_look = max(lengths.values(), default=0) > self.budget
        checks, triggers_before = self.ev.checks, self.ev.triggers.copy()
        expected = {}
        for (s, layer, h), g in lengths.items():
            if g > target:
                expected[s, layer, h] = (
                    self.naive_stream_scores(self.reqs[s], layer, h),
                    max(int(g * self.ev.ratio), 1, g - target),
                )
        n = self.ev.maybe_evict()
        looked = self.ev.checks > checks
        assert looked or not must_look
        if not looked:
            expected = {}
        assert n == len(expected)
        for s, r in self.reqs.items():
            hit = any(key[0] == s for key in expected)
            assert self.ev.triggers[s] == triggers_before[s] + hit
            for layer in range(L):
                for h in range(H):
                    before, after = r.glob[layer][h], self.pool_global(s, layer, h)
                    if (s, layer, h) not in expected:
                        assert after == before
                        continue
                    scores, n_evict = expected[s, layer, h]
                    kept = set(after)
                    assert after == [p for p in before if p in kept]  # order kept
                    assert len(after) == len(before) - n_evict <= self.budget
                    gone = [sc for p, sc in zip(before, scores) if p not in kept]
                    stay = [sc for p, sc in zip(before, scores) if p in kept]
                    assert max(gone) <= min(stay) + 1e-6  # lowest scored left
                    r.glob[layer][h] = after
                    self.evictions_checked += 1
        assert int(self.pool.global_len.max()) <= self.budget
        self.pool.check_integrity()

    def finish(self, slot):
        self.pool.free_request(slot)
        del self.reqs[slot]


RUNS = [  # W_local, observation window, budget, admission probability per request, seed, lead
    (16, 16, 24, [1.0, 1.0, 1.0], 0, 0),  # SnapKV alone (all-admit gates)
    (16, 16, 24, [0.6, 0.3, 1.0], 1, 0),  # admission + eviction
    (32, 8, 40, [0.8, 1.0, 0.5], 2, 0),  # observation window shorter than W_local
    (16, 16, 16, [1.0, 0.7, 0.9], 3, 0),  # budget of one page
    (16, 16, 24, [0.6, 0.3, 1.0], 4, 5),  # looks amortized: streams cut 5 under the budget
    (32, 8, 40, [1.0, 0.2, 0.5], 5, 4),
]


@pytest.mark.parametrize("W,window,budget,p_admit,seed,lead", RUNS)
def test_long_random_run_keeps_budget_order_and_pages(W, window, budget, p_admit, seed, lead):
    long_random_run(W, window, budget, p_admit, seed, "cpu", lead)


def long_random_run(W, window, budget, p_admit, seed, device, lead=0):
    rng = np.random.default_rng(seed)
    run = Run(W, window, budget, pages=600, slots=4, maxlen=260, seed=seed, device=device, lead=lead)
    slots = [3, 0, 2]
    for s, p in zip(slots, p_admit):
        run.new(s, p)
    run.extend({3: 70, 0: 5})  # a prefill, a short one
    run.evict_and_check()
    run.extend({2: 37, 0: 20})  # chunked prefill continues (old ring leaves)
    run.evict_and_check()
    replaced = False
    for step in range(150):
        live = sorted(run.reqs)
        batch = [s for s in live if rng.random() < 0.85 and run.reqs[s].n < run.maxlen - 1] or live[:1]
        run.decode(batch)
        run.check_matches_model()
        run.evict_and_check()
        if step == 90 and not replaced:  # slot 0 finishes; a new request takes it
            stats = run.ev.request_stats(0)
            assert stats["max_global_tokens_per_head"] <= budget
            run.finish(0)
            run.new(0, 1.0)
            assert run.ev.request_stats(0)["eviction_triggers"] == 0
            run.extend({0: 50})
            run.evict_and_check()
            replaced = True
    assert run.evictions_checked > 20
    assert run.ev.triggers[[3, 2]].min() > 0
    for s in list(run.reqs):
        run.finish(s)
    run.pool.check_integrity()
    assert run.pool.num_free_pages() == 600


def test_query_window_holds_last_queries_per_request_and_layer():
    run = Run(W=32, window=16, budget=1000, pages=400, slots=3, maxlen=120, seed=5)
    run.new(1, 1.0)
    run.new(2, 1.0)
    run.extend({1: 40, 2: 7})
    run.extend({2: 30})
    for _ in range(5):
        run.decode([1, 2])
    ev = run.ev
    for s, r in run.reqs.items():
        for layer in range(L):
            want = {p % 16: p for p in range(max(0, r.n - 16), r.n)}
            assert {i: int(p) for i, p in enumerate(ev.q_pos[s]) if p >= 0} == want
            for slot, p in want.items():
                assert torch.equal(ev.q_buf[s, layer, slot], r.q[layer, p])


def test_overshooting_extend_is_cut_to_budget_in_one_trigger():
    run = Run(W=16, window=16, budget=20, pages=300, slots=2, maxlen=260, seed=7)
    run.new(1, 1.0)
    run.extend({1: 200})  # 184 admitted per stream at once
    run.evict_and_check()
    assert run.ev.triggers[1] == 1
    assert int(run.ev.stream_triggers[1].min()) == 1
    assert run.ev.evicted_tokens[1] == L * H * (184 - 20)
    assert (run.pool.global_len[1] == 20).all()


def test_no_device_look_while_the_host_bound_is_within_budget():
    run = Run(W=16, window=16, budget=24, pages=300, slots=2, maxlen=260, seed=9)
    run.new(0, 0.0)  # nothing admitted: global stays empty
    run.extend({0: 16})
    steps = 120
    for _ in range(steps):
        run.decode([0])
        run.evict_and_check()
    # The bound grows one token per step past the ring and is reset to the exact 0 at each look:
    # one look per budget + 1 steps, never an eviction.
    assert run.ev.checks == steps // (24 + 1)
    assert run.ev.triggers[0] == 0

    big = Run(W=16, window=16, budget=10_000, pages=300, slots=2, maxlen=260, seed=9)
    big.new(0, 1.0)
    big.extend({0: 100})
    for _ in range(100):
        big.decode([0])
        big.evict_and_check()
    assert big.ev.checks == 0


def test_lead_spaces_the_looks_and_keeps_the_cap():
    """With every token admitted the streams sit at the budget: lead 0 looks at the device nearly
    every step; lead 6 at most once per 7 steps (the bound grows one token per step), for both
    requests at once, and the cap holds after every step."""
    # (lead 0 looks every other step here: the bottom 10% of 24 entries is 2 tokens)
    looks = {}
    for lead in (0, 6):
        run = Run(W=16, window=16, budget=24, pages=400, slots=2, maxlen=260, seed=11, lead=lead)
        run.check_attention = False
        run.new(0, 1.0)
        run.new(1, 1.0)
        run.extend({0: 30, 1: 45})
        run.ev.maybe_evict()
        start = run.ev.checks
        for _ in range(140):
            run.decode([0, 1])
            run.ev.maybe_evict()
            assert int(run.pool.global_len.max()) <= 24
        looks[lead] = run.ev.checks - start
        run.pool.check_integrity()
    assert looks[0] >= 60
    assert looks[6] <= 140 // 7 + 1
    with pytest.raises(ValueError, match="lead"):
        Run(W=16, window=16, budget=24, pages=40, slots=1, maxlen=60, seed=0, lead=24)


def test_admission_reduces_eviction_triggers():
    triggers = {}
    for p in (1.0, 0.3):
        run = Run(W=16, window=16, budget=24, pages=400, slots=2, maxlen=260, seed=11)
        run.check_attention = False  # the model does not follow evictions here
        run.new(1, p)
        run.extend({1: 30})
        for _ in range(200):
            run.decode([1])
            run.ev.maybe_evict()
        triggers[p] = int(run.ev.stream_triggers[1].sum())
        run.pool.check_integrity()
    assert triggers[0.3] < triggers[1.0] / 2


def test_pages_shared_with_a_prefix_snapshot_are_copied_not_rewritten():
    run = Run(W=16, window=16, budget=24, pages=300, slots=2, maxlen=260, seed=13)
    run.new(1, 1.0)
    run.extend({1: 60})  # 44 global entries per stream: 3 pages
    pool = run.pool
    store = SnapshotStore(pool)
    snap = store.take(1)  # shares the global pages by refcount
    before = [[run.pool_global(1, layer, h) for h in range(H)] for layer in range(L)]
    shared = snap.rows[:, :, pool.ring_cols :].long()
    shared = shared[shared != pool.dump_page]
    contents = (pool.k_pages[shared].clone(), pool.v_pages[shared].clone())
    run.evict_and_check()  # checks integrity with the snapshot's refs
    assert torch.equal(pool.k_pages[shared], contents[0]) and torch.equal(pool.v_pages[shared], contents[1])
    pool.alloc_request(0)
    store.restore(0, snap)  # the snapshot still holds the pre-eviction cache
    assert [[run.pool_global(0, layer, h) for h in range(H)] for layer in range(L)] == before
    pool.free_request(0)
    store.release(snap)
    run.finish(1)
    pool.check_integrity()
    assert pool.num_free_pages() == 300


def test_stats_report_budgeted_cache_sizes():
    run = Run(W=16, window=16, budget=32, pages=300, slots=2, maxlen=260, seed=17)
    run.new(1, 1.0)
    run.extend({1: 100})
    run.evict_and_check()
    stats = run.ev.request_stats(1)
    assert stats["eviction_triggers"] == 1
    assert stats["max_global_tokens_per_head"] == 32
    assert stats["mean_global_tokens_per_head"] == 32.0
    assert stats["mean_kv_tokens_per_head"] == 32.0 + 16
    assert stats["evicted_tokens"] == L * H * (84 - 32)
    assert stats["max_stream_eviction_triggers"] == 1
    assert stats["stream_eviction_triggers"] == L * H
