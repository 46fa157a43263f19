"""Equal per-head budget baseline: calibrated pre-RoPE query statistics, the key score they give, the
policy at equal memory, and the accuracy summary (tiny random models, CPU)."""

import pytest
import torch
from test_training_backbone import tiny_gates, tiny_lm

from evals.harness import matched_baselines, two_pass
from evals.policies import EqualBudget, cache_count
from evals.query_stats import QueryStats, as_pairs, calibrate, future_offsets, key_scores
from evals.summary import accuracy_rows
from sglang_wgkv.training.backbone import Backbone, _rotate_half, apply_rope, dense_attention

pytestmark = pytest.mark.training

W = 8


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def bb(request):
    return Backbone(tiny_lm(request.param))


def _rope(bb: Backbone, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x ``[H, T, D]`` rotated to positions ``pos [T]`` by the model's own rotary table."""
    cos, sin = bb.decoder.rotary_emb(x[None], pos[None])
    return apply_rope(x[None], cos, sin)[0]


def test_calibrated_center_is_the_mean_unrotated_query(bb):
    rows = [torch.randint(0, 97, (30,)), torch.randint(0, 97, (20,))]
    stats = calibrate(bb, rows)
    seen = {l: [] for l in range(bb.shape.num_layers)}

    def spy(layer, q, k_pre, k_post, v, scale):
        T = q.shape[2]
        cos, sin = bb.decoder.rotary_emb(q, torch.arange(T)[None])
        seen[layer].append((q * cos[:, None] - _rotate_half(q) * sin[:, None])[0])  # inverse rotation
        return dense_attention(layer, q, k_pre, k_post, v, scale)

    for ids in rows:
        bb(ids[None], spy)
    assert stats.tokens == 50
    for layer, qs in seen.items():
        pre = torch.cat(qs, dim=1)  # [Hq, 50, D]
        torch.testing.assert_close(stats.center[layer], as_pairs(pre.mean(1)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.mean_abs[layer], as_pairs(pre).abs().mean(1), atol=1e-5, rtol=1e-5)


def test_key_score_equals_rotated_dot_products(bb):
    """Trigonometric term = mean over future offsets of RoPE(center, P + d) . RoPE(k_j, j), plus the norm
    term, maximized over the query group; here recomputed with the model's own rotary table."""
    s = bb.shape
    F, Hkv, group, T, P = s.head_dim // 2, s.num_kv_heads, s.num_heads // s.num_kv_heads, 24, 30
    gen = torch.Generator().manual_seed(1)
    center = torch.randn(s.num_heads, s.head_dim, generator=gen)
    mean_abs = as_pairs(center).abs() + torch.rand(s.num_heads, F, generator=gen)
    inv_freq = bb.decoder.rotary_emb.inv_freq.float()
    stats = QueryStats(
        as_pairs(center)[None].expand(s.num_layers, -1, -1),
        mean_abs[None].expand(s.num_layers, -1, -1),
        inv_freq,
        tokens=1,
    )
    k_pre = torch.randn(Hkv, T, s.head_dim, generator=gen)
    got = key_scores(stats, 1, k_pre, P, max_offset=8)
    k_rot = _rope(bb, k_pre, torch.arange(T))
    offsets = future_offsets(8)
    assert offsets.tolist() == [0, 1, 2, 4, 8]
    q_rot = torch.stack(
        [_rope(bb, center[:, None], torch.tensor([P + int(d)]))[:, 0] for d in offsets]
    )  # [O, Hq, D]
    want = torch.empty(Hkv, T)
    for h in range(Hkv):
        per_q = []
        for qh in range(h * group, (h + 1) * group):
            trig = (q_rot[:, qh] @ k_rot[h].t()).mean(0)  # [T]
            norm = ((mean_abs[qh] - as_pairs(center[qh]).abs()) * as_pairs(k_pre[h]).abs()).sum(-1)
            per_q.append(trig + norm)
        want[h] = torch.stack(per_q).amax(0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _stats(bb: Backbone) -> QueryStats:
    return calibrate(bb, [torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(5))])


def test_equal_budget_keeps_the_same_count_per_head_and_the_best_scored_keys(bb):
    stats = _stats(bb)
    s = bb.shape
    gen = torch.Generator().manual_seed(2)
    T, P = 48, 40
    q = torch.randn(s.num_heads, T, s.head_dim, generator=gen)
    k_pre = torch.randn(s.num_kv_heads, T, s.head_dim, generator=gen)
    pol = EqualBudget(budget=14, local_window=W, stats=stats)
    vis = pol.visibility(0, q, k_pre, k_pre, P)
    assert cache_count(vis, P).tolist() == [14] * s.num_kv_heads
    assert vis.window == W and vis.full_rows == 0 and vis.kept[:, P:].all()
    score = key_scores(stats, 0, k_pre[:, : P - W], P)
    for h in range(s.num_kv_heads):
        chosen = vis.kept[h, : P - W]
        assert int(chosen.sum()) == 14 - W
        assert score[h][chosen].min() >= score[h][~chosen].max()
    # a budget beyond the prompt keeps everything; one at the window keeps only the ring
    assert (
        cache_count(EqualBudget(500, W, stats).visibility(0, q, k_pre, k_pre, P), P).tolist()
        == [P] * s.num_kv_heads
    )
    assert not EqualBudget(W, W, stats).visibility(0, q, k_pre, k_pre, P).kept[:, : P - W].any()


def test_two_pass_runs_equal_budget_at_wgkv_memory(bb):
    stats = _stats(bb)
    ids = torch.randint(0, 97, (48,))
    gate_sets = [tiny_gates(bb, seed=0, init_bias=0.0, window=W, lam=0.1)]
    recs, hidden = two_pass(bb, ids, 40, gate_sets, tau=0.5, local_window=W, stats=stats)
    assert [r["method"] for r in recs] == ["full", "wgkv", "streaming", "random", "snapkv", "equal_budget"]
    assert hidden.shape[0] == len(recs)
    assert recs[-1]["cache"] == pytest.approx(round(recs[1]["cache"]), abs=1e-6)
    assert [p.name for p in matched_baselines(20.0, 100, W, 0)] == ["streaming", "random", "snapkv"]


def test_accuracy_rows_pool_lengths_and_repeat_full():
    def s(ev, method, lam, n, kv, **m):
        return {"eval": ev, "length": None, "method": method, "lam": lam, "n": n, "kv_fraction": kv, **m}

    summary = [
        s("nll", "full", None, 2, 1.0, nll_cont=1.5),
        s("passkey", "full", None, 4, 1.0, accuracy=1.0),
        s("niah_multikey", "full", None, 4, 1.0, accuracy=0.5),
        s("nll", "wgkv", 0.1, 2, 0.3, nll_cont=1.6),
        s("passkey", "wgkv", 0.1, 4, 0.2, accuracy=0.75),
        s("niah_multikey", "wgkv", 0.1, 4, 0.4, accuracy=0.5),
        s("passkey", "equal_budget", 0.1, 4, 0.2, accuracy=0.25),
        {**s("passkey", "wgkv", 0.1, 4, 0.2, accuracy=0.0), "length": 2048},
    ]
    rows = accuracy_rows({"summary": summary})
    assert [r["method"] for r in rows] == ["wgkv", "equal_budget"]
    wg, eq = rows
    assert wg["kv_fraction"] == pytest.approx((0.3 * 2 + 0.2 * 4 + 0.4 * 4) / 10)
    assert (wg["nll"], wg["passkey"], wg["niah_mk"]) == (1.6, 0.75, 0.5)
    assert (wg["full_nll"], wg["full_passkey"], wg["full_niah_mk"]) == (1.5, 1.0, 0.5)
    assert eq["nll"] is None and eq["passkey"] == 0.25 and eq["full_passkey"] == 1.0


def test_merge_pools_shards_and_refuses_overlap():
    from evals.summary import merge

    def part(index, correct):
        rows = [
            {
                "eval": "passkey",
                "length": 64,
                "index": index,
                "method": m,
                "lam": lam,
                "kv_fraction": kv,
                "correct": c,
                "answer_nll": 0.1,
            }
            for m, lam, kv, c in (("full", None, 1.0, True), ("wgkv", 0.1, 0.3, correct))
        ]
        return {"rows": rows, "complete": True, "elapsed_s": 1.0, "config": {"command": f"shard {index}"}}

    merged = merge([part(0, True), part(4, False)])
    wg = [s for s in merged["summary"] if s["method"] == "wgkv" and s["length"] is None][0]
    assert wg["n"] == 2 and wg["accuracy"] == 0.5 and merged["shards"] == ["shard 0", "shard 4"]
    with pytest.raises(ValueError, match="share samples"):
        merge([part(0, True), part(0, False)])
