"""Hypothesis stateful test of the dual-cache pool against a plain-Python model.

Each key's first three channels encode (position, layer, head), so the pool's contents can be read
back and compared with the model's ring and global lists exactly.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_wgkv.config import PAGE_SIZE, WGKVConfig
from sglang_wgkv.memory import DualCachePool, PoolExhausted

pytestmark = pytest.mark.core
EXHAUSTED = []  # PoolExhausted occurrences: the test checks the path was exercised

L, H, D, W, SLOTS, PAGES, MAXLEN = 2, 2, 8, 32, 4, 40, 120


def _keys(positions, salt=0.0):
    """k [N, H, D] encoding (pos, layer-agnostic head) -> per layer we add the layer id."""
    pos = torch.as_tensor(positions, dtype=torch.float32)
    k = torch.zeros(L, len(positions), H, D)
    k[..., 0] = pos[None, :, None]
    k[..., 1] = torch.arange(L, dtype=torch.float32)[:, None, None]
    k[..., 2] = torch.arange(H, dtype=torch.float32)[None, None, :]
    k[..., 3] = salt
    return k


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = DualCachePool(
            L, H, D, PAGES, SLOTS, MAXLEN, WGKVConfig(local_window=W), dtype=torch.float32
        )
        self.model = {}  # slot -> {"len": n, "flags": {pos: [L][H] bool}, "global": [[list]]}
        self.rng = torch.Generator().manual_seed(0)

    def _flags(self, n, p):
        return torch.rand(L, n, H, generator=self.rng) < p

    # -- model helpers ----------------------------------------------------------------------------
    def _model_extend(self, r, n, flags):
        m = self.model[r]
        S = m["len"]
        for t in range(n):
            p = S + t
            m["flags"][p] = flags[:, t]
            victim = p - W
            if victim >= 0:
                for layer in range(L):
                    for h in range(H):
                        if m["flags"][victim][layer, h]:
                            m["global"][layer][h].append(victim)
        m["len"] = S + n

    def _free_slots(self):
        return [r for r in range(SLOTS) if r not in self.model]

    # -- rules ------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.model) < SLOTS)
    @rule(n=st.integers(1, 80), chunk=st.integers(1, 80), p=st.sampled_from([0.0, 0.3, 1.0]))
    def new_request(self, n, chunk, p):
        r = self._free_slots()[0]
        self.pool.alloc_request(r)
        self.model[r] = {"len": 0, "flags": {}, "global": [[[] for _ in range(H)] for _ in range(L)]}
        done = 0
        while done < n:
            m = min(chunk, n - done)
            if not self._extend(r, m, p):
                break
            done += m

    def _extend(self, r, n, p):
        S = self.model[r]["len"]
        if S + n > MAXLEN:
            return False
        flags = self._flags(n, p)
        k = _keys(range(S, S + n))
        free_before = self.pool.num_free_pages()
        try:
            self.pool.begin_extend([r], [S], [n])
        except PoolExhausted:
            assert self.pool.num_free_pages() == free_before  # nothing was taken
            EXHAUSTED.append(1)
            return False
        for layer in range(L):
            self.pool.write_extend(layer, k[layer], -k[layer], flags[layer])
        self._model_extend(r, n, flags)
        return True

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data(), p=st.sampled_from([0.0, 0.5, 1.0]))
    def decode(self, data, p):
        slots = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        slots = [r for r in slots if self.model[r]["len"] < MAXLEN]
        if not slots:
            return
        lens = [self.model[r]["len"] for r in slots]
        flags = self._flags(len(slots), p)
        try:
            self.pool.begin_decode(slots, lens)
        except PoolExhausted:
            EXHAUSTED.append(1)
            return
        for layer in range(L):
            k = torch.stack([_keys([n])[layer, 0] for n in lens])
            self.pool.write_decode(layer, k, -k, flags[layer])
        for i, r in enumerate(slots):
            self._model_extend(r, 1, flags[:, i : i + 1])

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(sorted(self.model)))
        self.pool.free_request(r)
        del self.model[r]

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.pool.check_integrity()

    @invariant()
    def contents_match_model(self):
        pool = self.pool
        for r, m in self.model.items():
            n = m["len"]
            for layer in range(L):
                for h in range(H):
                    want = m["global"][layer][h]
                    assert int(pool.global_len[r, layer, h]) == len(want)
                    if want:
                        pages = pool.page_table[r, layer, h, pool.ring_cols :].long()
                        ks = pool.k_pages[pages].reshape(-1, D)[: len(want)]
                        vs = pool.v_pages[pages].reshape(-1, D)[: len(want)]
                        assert ks[:, 0].tolist() == [float(x) for x in want]
                        assert torch.all(ks[:, 1] == layer) and torch.all(ks[:, 2] == h)
                        assert torch.equal(vs, -ks)
                    for pos in range(max(0, n - W), n):
                        s = pos % W
                        page = int(pool.page_table[r, layer, h, s // PAGE_SIZE])
                        assert pool.k_pages[page, s % PAGE_SIZE, 0].item() == pos
                        assert bool(pool.ring_flag[r, layer, h, s]) == bool(m["flags"][pos][layer, h])

    def teardown(self):
        for r in list(self.model):
            self.pool.free_request(r)
        self.pool.check_integrity()
        assert self.pool.num_free_pages() == PAGES


PoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestPoolStateful = PoolMachine.TestCase


def test_stateful_run_exercised_exhaustion():
    # runs after TestPoolStateful in file order; the small pool must have hit PoolExhausted
    assert EXHAUSTED, "the stateful run never exhausted the pool; shrink PAGES"


@pytest.mark.parametrize("halves", [False, True])
def test_write_decode_rows_matches_write_decode(halves):
    """The explicit-rows ring write (the graph path's, torch ops on a non-Triton pool) leaves the pool
    exactly as :meth:`write_decode` after the same :meth:`begin_decode`; also in two halves, keys and
    values first (``admit=None``), flags after (:meth:`write_decode_flags`: the served decode's side
    stream)."""
    import copy

    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.memory import DualCachePool

    gen = torch.Generator().manual_seed(3)
    L, H, D = 2, 3, 8
    a = DualCachePool(
        L,
        H,
        D,
        num_pages=300,
        max_requests=4,
        max_context_len=200,
        config=WGKVConfig(local_window=32),
        dtype=torch.float32,
    )
    for r, n in ((1, 40), (2, 7), (3, 31)):
        a.alloc_request(r)
        a.begin_extend([r], [0], [n])
        for layer in range(L):
            a.write_extend(
                layer,
                torch.randn(n, H, D, generator=gen),
                torch.randn(n, H, D, generator=gen),
                torch.rand(n, H, generator=gen) < 0.5,
            )
    b = copy.deepcopy(a)
    slots, lens = [3, 1, 2], [31, 40, 7]
    a.begin_decode(slots, lens)
    plan_b = b.begin_decode(slots, lens)
    for layer in range(L):
        k, v = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
        admit = torch.rand(3, H, generator=gen) < 0.5
        a.write_decode(layer, k, v, admit)
        if halves:
            b.write_decode_rows(layer, plan_b.req, plan_b.pos, k, v, None)
            b.write_decode_flags(layer, plan_b.req, plan_b.pos, admit)
        else:
            b.write_decode_rows(layer, plan_b.req, plan_b.pos, k, v, admit)
    for name in ("k_pages", "v_pages", "ring_flag", "page_table", "global_len"):
        assert torch.equal(
            getattr(a, name)[:-1] if name.endswith("pages") else getattr(a, name),
            getattr(b, name)[:-1] if name.endswith("pages") else getattr(b, name),
        ), name
    b.check_integrity()
