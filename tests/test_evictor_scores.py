"""SnapKV scores against an independent per-query loop; evictor argument validation."""

import math
import os

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor
from sglang_wgkv.memory.snapkv_score import snapkv_scores
from sglang_wgkv.testing.interp import InterpCheck

pytestmark = pytest.mark.evictor


def naive_scores(q, q_pos, g_keys, g_len, r_keys, r_pos, scale, kernel):
    """One stream: q [Wq, G, D], g_keys [>=g_len, D], r_keys [Nr, D] -> list of g_len floats."""
    g = int(g_len)
    raw = [0.0] * g
    for i in range(q.shape[0]):
        if q_pos[i] < 0:
            continue
        ring = [r_keys[k] for k in range(r_keys.shape[0]) if 0 <= r_pos[k] <= q_pos[i]]
        keys = torch.stack([g_keys[j] for j in range(g)] + ring).double()
        best = [0.0] * g
        for head in range(q.shape[1]):
            logits = ((keys @ q[i, head].double()) * scale).tolist()
            top = max(logits)
            z = sum(math.exp(x - top) for x in logits)
            for j in range(g):
                best[j] = max(best[j], math.exp(logits[j] - top) / z)
        raw = [a + b for a, b in zip(raw, best)]
    half = kernel // 2
    return [max(raw[max(0, j - half) : j + half + 1]) for j in range(g)]


@pytest.mark.parametrize(
    "S,Wq,G,D,Nr,kernel",
    [(3, 8, 1, 16, 8, 5), (4, 16, 4, 32, 16, 5), (2, 5, 2, 8, 12, 3), (3, 8, 3, 16, 8, 1)],
)
def test_scores_match_naive_loop(S, Wq, G, D, Nr, kernel):
    torch.manual_seed(S * 1000 + Wq * 10 + G)
    Ng = 23
    q = torch.randn(S, Wq, G, D) * 2
    g_keys = torch.randn(S, Ng, D)
    r_keys = torch.randn(S, Nr, D)
    g_len = torch.tensor([Ng, 1, 11, 17][:S])
    # ring: positions 100.. with some empty slots; queries interleaved with the ring, some empty
    r_pos = torch.arange(100, 100 + Nr).repeat(S, 1)
    r_pos[0, -2:] = -1
    q_pos = torch.randint(99, 100 + Nr, (S, Wq))
    q_pos[:, 0] = -1
    scale = 1 / math.sqrt(D)
    got = snapkv_scores(q, q_pos, g_keys, g_len, r_keys, r_pos, scale, kernel)
    assert got.shape == (S, Ng)
    for s in range(S):
        want = naive_scores(
            q[s], q_pos[s].tolist(), g_keys[s], g_len[s], r_keys[s], r_pos[s].tolist(), scale, kernel
        )
        torch.testing.assert_close(
            got[s, : g_len[s]].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        assert torch.isneginf(got[s, g_len[s] :]).all()


def test_ring_mass_lowers_global_scores():
    # The softmax normalizes over ring keys too: a ring key the query matches strongly takes mass
    # from the global entries; a ring key at a later position than every query takes none.
    torch.manual_seed(0)
    D = 8
    q = torch.randn(1, 4, 1, D)
    g_keys = torch.randn(1, 6, D)
    r_keys = q[:, :1, 0, :].clone() * 5  # aligned with the first query
    g_len = torch.tensor([6])
    q_pos = torch.tensor([[10, 11, 12, 13]])
    seen = snapkv_scores(q, q_pos, g_keys, g_len, r_keys, torch.tensor([[10]]), 0.35, 1)
    unseen = snapkv_scores(q, q_pos, g_keys, g_len, r_keys, torch.tensor([[99]]), 0.35, 1)
    alone = snapkv_scores(
        q, q_pos, g_keys, g_len, r_keys[:, :0], torch.zeros(1, 0, dtype=torch.long), 0.35, 1
    )
    torch.testing.assert_close(unseen, alone)
    assert (seen < alone).all()


def _pool(W=16, H=2):
    return DualCachePool(2, H, 8, 64, 2, 200, WGKVConfig(local_window=W), dtype=torch.float32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(budget=0, num_q_heads=4), "budget"),
        (dict(budget=32, num_q_heads=3), "multiple"),
        (dict(budget=32, num_q_heads=4, window=32), "W_local"),
        (dict(budget=32, num_q_heads=4, window=16, kernel_size=4), "kernel_size"),
        (dict(budget=32, num_q_heads=4, window=16, ratio=1.0), "ratio"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SnapKVEvictor(_pool(), **kwargs)


def test_observe_before_plan_is_refused():
    ev = SnapKVEvictor(_pool(), budget=32, num_q_heads=4, window=16)
    with pytest.raises(RuntimeError, match="begin_extend"):
        ev.observe_extend(0, torch.zeros(1, 4, 8))
    with pytest.raises(RuntimeError, match="begin_decode"):
        ev.observe_decode(0, torch.zeros(1, 4, 8))


SNAPKV_SEEDS = tuple(str(s) for s in range(16))
SNAPKV_RUN = InterpCheck(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_snapkv_interp_check.py"), SNAPKV_SEEDS
)


def test_triton_scores_match_the_reference_under_the_interpreter(interp_runner):
    """memory/triton_snapkv.py against snapkv_scores on CPU under the Triton interpreter (one
    subprocess: TRITON_INTERPRET=1 must precede the import of Triton): GQA 1-4 (3 padded), empty
    query and ring slots, 0-150 global entries, bf16 and float32, FP8 keys with per-stream scales. On a GPU the compiled kernel runs in
    the evictor of test_evictor_gpu (the kernels path scores with it)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter is the CPU stand-in; the GPU runs the compiled kernel")
    res = interp_runner.result(SNAPKV_RUN)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.splitlines() == [f"ok seed {s}" for s in SNAPKV_SEEDS], res.stdout


def test_a_score_kernel_that_cannot_build_falls_back_to_torch_once(monkeypatch, caplog):
    """If the Triton kernel fails on its first launch (a build failure), the evictor logs it and
    scores with the torch reference from then on; the eviction is the reference's."""
    import sglang_wgkv.memory.triton_snapkv as tk

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(tk, "snapkv_scores_triton", broken)
    results = []
    for triton_scores in (True, False):
        pool = DualCachePool(
            1,
            2,
            8,
            num_pages=64,
            max_requests=1,
            max_context_len=200,
            config=WGKVConfig(local_window=16),
            dtype=torch.float32,
        )
        ev = SnapKVEvictor(pool, budget=8, num_q_heads=4, window=16, triton_scores=triton_scores)
        torch.manual_seed(0)
        pool.alloc_request(0)
        pool.begin_extend([0], [0], [60])
        ev.observe_extend(0, torch.randn(60, 4, 8))
        kv = torch.randn(2, 60, 2, 8)
        pool.write_extend(0, kv[0], kv[1], torch.ones(60, 2, dtype=torch.bool))
        with caplog.at_level("WARNING"):
            ev.maybe_evict()
        assert ev.triton_scores is False and int(pool.global_len.max()) <= 8
        R = pool.ring_cols
        kept = [
            pool.k_pages[pool.page_table[0, 0, h, R : R + 1].long()].reshape(-1, 8)[
                : int(pool.global_len[0, 0, h])
            ]
            for h in range(2)
        ]
        results.append(torch.cat(kept))
    assert torch.equal(results[0], results[1]) and results[0].shape[0] == 2 * 8  # the same keys kept
    assert sum("Triton score kernel failed" in r.message for r in caplog.records) == 1
