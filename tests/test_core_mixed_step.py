"""The dual pool's mixed step (prefill chunks and decode rows in one forward, ``begin_mixed``): the
stateful pool test with a mixed rule against the same plain-Python model, and the attention a mixed
forward reads against separate extend and decode forwards."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_core_pool_stateful import EXHAUSTED, MAXLEN, PoolMachine, _keys

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import paged_decode_attention, vertical_slash_attention
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, PoolExhausted
from sglang_wgkv.testing.pool_driver import run_decode, run_extend

pytestmark = pytest.mark.core
MIXED_RUNS = []  # mixed steps that ran: the test checks the rule was exercised


class MixedPoolMachine(PoolMachine):
    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data(), n=st.integers(1, 40), p=st.sampled_from([0.0, 0.5, 1.0]))
    def mixed(self, data, n, p):
        """One request extends by ``n`` while others decode, in one forward."""
        slots = sorted(self.model)
        ext = data.draw(st.sampled_from(slots))
        dec = data.draw(st.lists(st.sampled_from([r for r in slots if r != ext]), min_size=1, unique=True))
        dec = [r for r in dec if self.model[r]["len"] < MAXLEN]
        S = self.model[ext]["len"]
        if not dec or S + n > MAXLEN:
            return
        lens = [self.model[r]["len"] for r in dec]
        ext_flags, dec_flags = self._flags(n, p), self._flags(len(dec), p)
        free_before = self.pool.num_free_pages()
        try:
            self.pool.begin_mixed([ext], [S], [n], dec, lens)
        except PoolExhausted:
            assert self.pool.num_free_pages() == free_before  # nothing was taken
            EXHAUSTED.append(1)
            return
        k_ext = _keys(range(S, S + n))
        for layer in reversed(range(self.pool.num_layers)):  # any layer order: the plans are per forward
            k_dec = torch.stack([_keys([m])[layer, 0] for m in lens])
            self.pool.write_decode(layer, k_dec, -k_dec, dec_flags[layer])
            self.pool.write_extend(layer, k_ext[layer], -k_ext[layer], ext_flags[layer])
        self._model_extend(ext, n, ext_flags)
        for i, r in enumerate(dec):
            self._model_extend(r, 1, dec_flags[:, i : i + 1])
        MIXED_RUNS.append(1)


MixedPoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestMixedPoolStateful = MixedPoolMachine.TestCase


def test_stateful_run_exercised_mixed_steps():
    assert MIXED_RUNS, "no mixed step ran in the stateful test (run it in the same session)"


L, H, HQ, D, W = 3, 2, 4, 16, 32


def _pool():
    return DualCachePool(L, H, D, 200, 4, 256, WGKVConfig(local_window=W), dtype=torch.float32)


def _prefill(pool, slot, n, gen):
    pool.alloc_request(slot)
    q, k, v = (torch.randn(L, n, h, D, generator=gen) for h in (HQ, H, H))
    run_extend(pool, [slot], [0], [n], q, k, v, torch.rand(L, n, H, generator=gen) < 0.5, W)


@pytest.mark.parametrize("prefix", [0, 20, 70], ids=["new", "in_ring", "past_ring"])
def test_mixed_forward_reads_and_leaves_what_separate_forwards_do(prefix):
    """A mixed forward (one extend of 40 tokens after ``prefix``, two decode rows past and within the
    ring) gives the attention outputs and the pool contents of the extend forward then the decode
    forward run separately."""
    pools = [_pool(), _pool()]
    for pool in pools:
        gen = torch.Generator().manual_seed(1)
        _prefill(pool, 1, 50, gen)  # a decode row whose ring victim is promoted
        _prefill(pool, 2, 9, gen)  # one still inside its ring
        pool.alloc_request(3)
        if prefix:
            q, k, v = (torch.randn(L, prefix, h, D, generator=gen) for h in (HQ, H, H))
            run_extend(pool, [3], [0], [prefix], q, k, v, torch.rand(L, prefix, H, generator=gen) < 0.5, W)
    gen = torch.Generator().manual_seed(2)
    n, dec, lens = 40, [1, 2], [50, 9]
    q, k, v = (torch.randn(L, n, h, D, generator=gen) for h in (HQ, H, H))
    admit = torch.rand(L, n, H, generator=gen) < 0.5
    qd, kd, vd = (torch.randn(L, 2, h, D, generator=gen) for h in (HQ, H, H))
    admit_d = torch.rand(L, 2, H, generator=gen) < 0.5

    separate, mixed = pools
    want_ext = run_extend(separate, [3], [prefix], [n], q, k, v, admit, W)
    want_dec = run_decode(separate, dec, lens, qd, kd, vd, admit_d)

    mixed.begin_mixed([3], [prefix], [n], dec, lens)
    got_ext, got_dec = [], []
    pos = torch.arange(prefix, prefix + n)
    for layer in reversed(range(L)):  # layer order does not matter: the plans are per forward
        mixed.write_decode(layer, kd[layer], vd[layer], admit_d[layer])
        rows, num_pages, last, _ = mixed.decode_page_rows(layer)
        indptr, indices, last_len = build_folded_indices(rows, num_pages, last)
        got_dec.insert(
            0, paged_decode_attention(qd[layer], mixed.k_pages, mixed.v_pages, indptr, indices, last_len)
        )
        keys, values, k_pos, admitted = mixed.extend_inputs(
            layer, k[layer], v[layer], admit[layer], pos, torch.float32
        )
        qo, kv = torch.tensor([0, n]), torch.tensor([0, keys.shape[0]])
        got_ext.insert(0, vertical_slash_attention(q[layer], keys, values, admitted, qo, kv, pos, k_pos, W))
        mixed.write_extend(layer, k[layer], v[layer], admit[layer])
    assert torch.equal(torch.stack(got_dec), want_dec)
    assert torch.equal(torch.stack(got_ext), want_ext)
    assert mixed.mixed_forwards == 1 and mixed.mixed_prefill_tokens_max == n
    for r in (1, 2, 3):
        assert separate.cached_len[r] == mixed.cached_len[r]
        assert torch.equal(mixed.global_len[r], separate.global_len[r])
        assert torch.equal(mixed.ring_flag[r], separate.ring_flag[r])
        for layer in range(L):
            S = int(mixed.cached_len[r])
            got, want = mixed.gather_context(layer, r, S), separate.gather_context(layer, r, S)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (r, layer)
    for pool in pools:
        pool.check_integrity()


def test_refused_mixed_step_changes_nothing():
    pool = _pool()
    gen = torch.Generator().manual_seed(0)
    _prefill(pool, 1, 40, gen)
    pool.alloc_request(2)
    free, lens = pool.num_free_pages(), pool.cached_len.copy()
    with pytest.raises(ValueError, match="cached lengths"):
        pool.begin_mixed([2], [0], [30], [1], [39])  # the decode row's length is stale
    with pytest.raises(ValueError, match="both extend and decode"):
        pool.begin_mixed([1], [40], [5], [1], [40])
    tiny = DualCachePool(L, H, D, 40, 4, 256, WGKVConfig(local_window=W), dtype=torch.float32)
    _prefill(tiny, 1, 40, gen)
    tiny.alloc_request(2)
    tiny_free = tiny.num_free_pages()
    with pytest.raises(PoolExhausted):
        tiny.begin_mixed([2], [0], [200], [1], [40])
    assert tiny.num_free_pages() == tiny_free and tiny.cached_len[2] == 0
    assert pool.num_free_pages() == free and (pool.cached_len == lens).all()
    assert pool.mixed_forwards == 0
    pool.check_integrity()
    tiny.check_integrity()
