"""A prefill whose keys are all visible to every later query runs as one dense causal attention
(``attention/fa3_dense.py``): the torch statement of the FA3 call equals the vertical-slash reference
on every-key-admitted batches (cached global entries at the far position, a ring, new rows), and the
backend takes that call only for forwards whose requests all keep every token and hold only their own
rows (``slot_dense``), or all hold at most W_local tokens, with the same outputs and pool as the
vertical-slash path, chunk after chunk."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_wgkv.attention import reference
from sglang_wgkv.attention.fa3_dense import dense_attention, dense_reference
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.integration.requests.control import RequestAdmission
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.backend_harness import bare_backend, extend_batch, layer_of
from sglang_wgkv.testing.prefill_cases import packed_case

pytestmark = pytest.mark.core

L, H, HQ, D, W = 2, 2, 4, 16, 16


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 50)), min_size=1, max_size=3),
    st.integers(0, 24),
)
def test_dense_call_is_the_vertical_slash_attention_with_every_key_admitted(seqs, far):
    torch.manual_seed(len(seqs) * 100 + far)
    lens_q = [n for n, _ in seqs]
    lens_k = [n + before for n, before in seqs]  # the queries are each sequence's last rows
    q, k, v, admitted, qo, kv, q_pos, k_pos = packed_case(lens_q, lens_k, HQ, H, D, 1.0, torch.float32, far)
    want = reference.vertical_slash_attention(q, k, v, admitted, qo, kv, q_pos, k_pos, W)
    args = (qo.int(), kv.int(), max(lens_q), max(lens_k) + far, D**-0.5)
    got = dense_attention(dense_reference, q, k, v, *args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    buf = torch.full((q.shape[0] + 2, HQ, D), 7.0)  # a mixed forward's output: its first rows written
    assert (
        dense_attention(dense_reference, q, k, v, *args, out=buf[: q.shape[0]]).data_ptr() == buf.data_ptr()
    )
    assert torch.equal(buf[: q.shape[0]], got) and bool((buf[q.shape[0] :] == 7.0).all())


def _backend(dense_call, dense_slots, admission=False):
    pool = DualCachePool(L, H, D, 300, 4, 256, WGKVConfig(local_window=W, tau=0.5))
    gates = WriteGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=2 * D)).eval()
    gates.requires_grad_(False)
    tau = torch.full((4,), 0.5 if admission else float("-inf"))
    backend = bare_backend(pool, gates, use_kernels=False, slot_tau=tau, num_q_heads=HQ)
    backend.req_pool = SimpleNamespace(
        slot_tau=tau,
        slot_admission=[RequestAdmission(admission=admission)] * 4,
        slot_dense=[s in dense_slots for s in range(4)],
    )
    backend._fa3_dense = dense_call
    return backend, pool


def _prefill(backend, pool, slots, chunks, calls):
    """``chunks``: per forward, each slot's new rows; returns every forward's layer outputs."""
    for r in slots:
        pool.alloc_request(r)
    gen = torch.Generator().manual_seed(0)
    outs, dense_forwards = [], 0
    for lens in chunks:
        prefix = [int(pool.cached_len[r]) for r in slots]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
        fb = extend_batch("extend", slots, prefix, lens, positions)
        backend.batch_slots = list(slots)
        backend.init_forward_metadata(fb)
        dense_forwards += backend._dense is not None
        for i in range(L):
            q, k, v = (torch.randn(sum(lens), c * D, generator=gen) for c in (HQ, H, H))
            outs.append(backend.forward_extend(q, k, v, layer_of(i, HQ, H, D), fb))
    return outs, dense_forwards


def _counting(calls):
    def call(*args, **kwargs):
        calls.append(1)
        return dense_reference(*args, **kwargs)

    return call


CHUNKS = [[40, 9], [30, 50], [1, 3]]  # past the ring, then chunks after a cached prefix


def _counting_gcols(pool):
    """Count the plan's reads of the pool's global lengths (a host sync on a GPU)."""
    reads, read = [], pool._context_gcols

    def counted(*args):
        reads.append(1)
        return read(*args)

    pool._context_gcols = counted
    return reads


def test_backend_runs_all_kept_prefills_dense_with_the_same_outputs_and_pool():
    """Requests keeping every token, chunk after chunk: every forward dense, the vertical-slash path's
    outputs and pool; and a dense forward never reads the global lengths back (its context sizes are
    S - W_local): no host sync waiting for the forward before it."""
    calls = []
    dense, dense_pool = _backend(_counting(calls), dense_slots={1, 2})
    plain, plain_pool = _backend(None, dense_slots={1, 2})
    dense_reads, plain_reads = _counting_gcols(dense_pool), _counting_gcols(plain_pool)
    got, n_dense = _prefill(dense, dense_pool, [1, 2], CHUNKS, calls)
    want, n_plain = _prefill(plain, plain_pool, [1, 2], CHUNKS, [])
    assert (n_dense, n_plain, len(calls)) == (len(CHUNKS), 0, len(CHUNKS) * L)
    assert not dense_reads and len(plain_reads) == len(CHUNKS)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for name in ("page_table", "global_len", "ring_flag", "k_pages", "v_pages"):
        assert torch.equal(getattr(dense_pool, name), getattr(plain_pool, name)), name


def test_a_request_not_dense_keeps_the_vertical_slash_path():
    """One request of the batch restored a prefix or is bounded (``slot_dense`` False): no dense call
    once a request is past its ring."""
    calls = []
    backend, pool = _backend(_counting(calls), dense_slots={1})
    _, n_dense = _prefill(backend, pool, [1, 2], CHUNKS, calls)
    assert n_dense == 0 and not calls


def test_admitting_requests_inside_their_ring_run_dense():
    """Requests that admit (the gate runs) but hold at most W_local tokens with the chunk: every key is
    in every later query's local window, so the forward is dense; the first chunk past the ring is not.
    Same outputs and pool as the vertical-slash path."""
    chunks = [[10, 6], [5, 4], [2, 1], [20, 1]]  # 15 and 10 tokens, then 17: one past W = 16
    calls = []
    dense, dense_pool = _backend(_counting(calls), dense_slots=set(), admission=True)
    plain, plain_pool = _backend(None, dense_slots=set(), admission=True)
    got, n_dense = _prefill(dense, dense_pool, [1, 2], chunks, calls)
    want, _ = _prefill(plain, plain_pool, [1, 2], chunks, [])
    assert n_dense == 2 and len(calls) == 2 * L
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for name in ("page_table", "global_len", "ring_flag", "k_pages", "v_pages"):
        assert torch.equal(getattr(dense_pool, name), getattr(plain_pool, name)), name
