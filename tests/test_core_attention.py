"""Pool + reference attention equal attention under the paper's mask semantics."""

import pytest
import torch

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import (
    dense_causal_attention,
    paged_decode_attention,
    soft_gated_attention,
    vertical_slash_attention,
)
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.pool_driver import run_decode, run_extend

pytestmark = pytest.mark.core


def _oracle(q, k, v, admit, window):
    """Full-sequence vertical-slash attention for one request: q [T,Hq,D], k/v [T,H,D], admit [T,H]."""
    T = q.shape[0]
    pos = torch.arange(T)
    ind = torch.tensor([0, T])
    return vertical_slash_attention(q, k, v, admit, ind, ind, pos, pos, window)


CASES = [
    # B, H_kv, group, D, W, tau, prefill lens, decode steps, chunk
    (1, 1, 1, 64, 16, 0.5, [40], 20, None),
    (3, 2, 4, 64, 32, 0.3, [5, 33, 70], 40, None),
    (2, 3, 3, 128, 16, 0.7, [17, 64], 35, 24),
    (2, 2, 2, 64, 48, 0.1, [10, 100], 30, 37),
    (4, 1, 8, 128, 16, 0.5, [1, 16, 15, 31], 25, None),
]


@pytest.mark.parametrize("B,H,G,D,W,tau,plens,steps,chunk", CASES)
@pytest.mark.parametrize("all_admit", [False, True])
def test_prefill_then_decode_matches_mask_semantics(B, H, G, D, W, tau, plens, steps, chunk, all_admit):
    torch.manual_seed(B * 100 + H * 10 + D + W)
    L = 2
    total = [p + steps for p in plens]
    T = max(total)
    q = torch.randn(L, B, T, H * G, D)
    k = torch.randn(L, B, T, H, D)
    v = torch.randn(L, B, T, H, D)
    g = torch.rand(L, B, T, H)
    admit = torch.ones_like(g, dtype=torch.bool) if all_admit else g >= tau
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=4096,
        max_requests=8,
        max_context_len=T + 1,
        config=WGKVConfig(local_window=W, tau=tau),
        dtype=torch.float32,
    )
    slots = [5, 0, 3, 7][:B]
    for r in slots:
        pool.alloc_request(r)
    got = torch.zeros(L, B, T, H * G, D)

    # prefill, optionally in chunks (exercises promotion from the old ring during an extend)
    done = [0] * B
    while any(d < p for d, p in zip(done, plens)):
        idx = [b for b in range(B) if done[b] < plens[b]]
        n = [min(plens[b] - done[b], chunk or plens[b]) for b in idx]
        pack = lambda x: torch.cat([x[:, b, done[b] : done[b] + m] for b, m in zip(idx, n)], 1)
        out = run_extend(
            pool,
            [slots[b] for b in idx],
            [done[b] for b in idx],
            n,
            pack(q),
            pack(k),
            pack(v),
            pack(admit),
            W,
        )
        off = 0
        for b, m in zip(idx, n):
            got[:, b, done[b] : done[b] + m] = out[:, off : off + m]
            off += m
            done[b] += m
        pool.check_integrity()

    for step in range(steps):
        pos = [p + step for p in plens]
        sel = lambda x: torch.stack([x[:, b, pos[b]] for b in range(B)], 1)
        out = run_decode(pool, slots, pos, sel(q), sel(k), sel(v), sel(admit))
        for b in range(B):
            got[:, b, pos[b]] = out[:, b]
    pool.check_integrity()

    for b in range(B):
        t = total[b]
        for layer in range(L):
            want = _oracle(q[layer, b, :t], k[layer, b, :t], v[layer, b, :t], admit[layer, b, :t], W)
            torch.testing.assert_close(got[layer, b, :t], want, atol=2e-5, rtol=2e-5)
            if all_admit:
                dense = dense_causal_attention(q[layer, b, :t], k[layer, b, :t], v[layer, b, :t])
                torch.testing.assert_close(got[layer, b, :t], dense, atol=2e-5, rtol=2e-5)
        # global length = admitted tokens among those that left the ring
        left = max(0, total[b] - W)
        want_len = admit[:, b, :left].sum(1).to(torch.int32)
        assert torch.equal(pool.global_len[slots[b]], want_len)

    for r in slots:
        pool.free_request(r)
    pool.check_integrity()
    assert pool.num_free_pages() == 4096


def test_soft_attention_with_binary_gates_equals_hard_mask():
    torch.manual_seed(0)
    T, H, G, D, W = 50, 2, 2, 64, 8
    q, k, v = torch.randn(1, H * G, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    admit = torch.rand(1, H, T) > 0.5
    soft = soft_gated_attention(q, k, v, admit.float(), W, eps=1e-30)
    hard = _oracle(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), admit[0].t(), W)
    torch.testing.assert_close(soft[0].transpose(0, 1), hard, atol=1e-5, rtol=1e-5)


def test_soft_attention_is_differentiable_in_g():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
    g = torch.rand(1, 1, 20, requires_grad=True)
    soft_gated_attention(q, k, v, g, 4).sum().backward()
    assert g.grad is not None and g.grad[0, 0, :15].abs().sum() > 0
    # tokens within W_local of every query never matter through g: the last 4 have zero gradient
    assert torch.all(g.grad[0, 0, -4:] == 0)


def test_folded_indices_layout():
    rows = torch.tensor([[[7, 8, 9, 0]], [[3, 0, 0, 0]]], dtype=torch.int32)  # B=2, H=1, C=4
    num_pages = torch.tensor([[3], [1]])
    last = torch.tensor([[5], [16]])
    indptr, indices, last_len = build_folded_indices(rows, num_pages, last)
    assert indptr.tolist() == [0, 3, 4]
    assert indices[:4].tolist() == [7, 8, 9, 3]
    assert last_len.tolist() == [5, 16]


def test_paged_decode_matches_padded_dense():
    torch.manual_seed(2)
    pages_k, pages_v = torch.randn(10, 16, 32), torch.randn(10, 16, 32)
    q = torch.randn(1, 4, 32)  # B=1, Hq=4, H_kv=2 -> group 2
    indptr = torch.tensor([0, 2, 3])
    indices = torch.tensor([4, 1, 6])
    last = torch.tensor([3, 16])
    out = paged_decode_attention(q, pages_k, pages_v, indptr, indices, last)
    for h, (pages, n) in enumerate((([4, 1], 19), ([6], 16))):
        kk = pages_k[pages].reshape(-1, 32)[:n]
        vv = pages_v[pages].reshape(-1, 32)[:n]
        s = q[0, 2 * h : 2 * h + 2] @ kk.t() / 32**0.5
        torch.testing.assert_close(out[0, 2 * h : 2 * h + 2], torch.softmax(s, -1) @ vv)


@pytest.mark.parametrize("block", [1, 20, 10**9])
def test_vertical_slash_in_query_blocks_equals_the_dense_mask(monkeypatch, block):
    """The CPU path computes queries in blocks, each over the keys it may see (admitted far keys,
    near keys up to its last query); any block size gives the dense masked softmax over
    :func:`vertical_slash_mask` (fp32 rounding aside), across a cached prefix and two sequences."""
    import sglang_wgkv.attention.reference as reference

    gen = torch.Generator().manual_seed(0)
    lens, prefix, Hq, Hkv, D, W = [37, 90], [0, 25], 6, 3, 8, 16
    q = torch.randn(sum(lens), Hq, D, generator=gen)
    nk = [n + p for n, p in zip(lens, prefix)]
    k, v = torch.randn(sum(nk), Hkv, D, generator=gen), torch.randn(sum(nk), Hkv, D, generator=gen)
    admitted = torch.rand(sum(nk), Hkv, generator=gen) < 0.4
    q_pos = torch.cat([torch.arange(p, p + n) for n, p in zip(lens, prefix)])
    k_pos = torch.cat([torch.arange(n) for n in nk])
    qo, kv = [0, 37, 127], [0, 37, 152]
    dense = torch.empty_like(q)
    for b in range(2):
        qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
        mask = reference.vertical_slash_mask(q_pos[qs:qe], k_pos[ks:ke], admitted[ks:ke], W)
        for h in range(Hq):
            s = q[qs:qe, h] @ k[ks:ke, h // 2].t() / D**0.5
            p = torch.softmax(s.masked_fill(~mask[h // 2], float("-inf")), -1)
            dense[qs:qe, h] = p @ v[ks:ke, h // 2]
    monkeypatch.setattr(reference, "QUERY_BLOCK", block)
    args = (q, k, v, admitted, torch.tensor(qo), torch.tensor(kv), q_pos, k_pos, W)
    torch.testing.assert_close(reference.vertical_slash_attention(*args), dense, rtol=1e-5, atol=1e-6)


def test_vertical_slash_query_that_sees_no_key_gets_zeros():
    """A query positioned before every key (none visible) outputs zeros, not NaN; the others of its
    block are unaffected (torch's fused attention gives an all-masked row zeros)."""
    from sglang_wgkv.attention.reference import vertical_slash_attention

    gen = torch.Generator().manual_seed(1)
    Hq, Hkv, D, n = 4, 2, 8, 6
    q = torch.randn(3, Hq, D, generator=gen)
    k, v = torch.randn(n, Hkv, D, generator=gen), torch.randn(n, Hkv, D, generator=gen)
    k_pos = torch.arange(10, 10 + n)
    q_pos = torch.tensor([2, 12, 15])  # the first sees nothing; the second the keys at 10-12
    out = vertical_slash_attention(
        q,
        k,
        v,
        torch.zeros(n, Hkv, dtype=torch.bool),
        torch.tensor([0, 3]),
        torch.tensor([0, n]),
        q_pos,
        k_pos,
        local_window=4,
    )
    assert torch.isfinite(out).all() and not out[0].any()
    alone = vertical_slash_attention(  # a block of that query alone: no key kept at all
        q[:1],
        k,
        v,
        torch.ones(n, Hkv, dtype=torch.bool),
        torch.tensor([0, 1]),
        torch.tensor([0, n]),
        q_pos[:1],
        k_pos,
        local_window=4,
    )
    assert not alone.any()
    for h in range(Hq):  # query 1 attends to keys 0..2 of its KV head (positions 10-12, all in the band)
        kk, vv = k[:3, h // 2], v[:3, h // 2]
        torch.testing.assert_close(out[1, h], torch.softmax(q[1, h] @ kk.t() / D**0.5, -1) @ vv)
