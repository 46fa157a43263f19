"""Eval policies, harness, RULER generator and the eval runner on a tiny random Llama (CPU)."""

import json

import pytest
import torch
from test_training_backbone import tiny_gates, tiny_lm
from test_training_trainer import CharTokenizer

from evals.harness import matched_baselines, policy_forward, two_pass
from evals.policies import (
    FullCache,
    RandomAdmission,
    SnapKV,
    StreamingLLM,
    Visibility,
    WGKVAdmission,
    cache_count,
)
from evals.ruler import TASKS, generate
from evals.run import evaluate, summarize
from sglang_wgkv.training.backbone import Backbone, dense_attention

pytestmark = pytest.mark.training

W = 8


@pytest.fixture(scope="module")
def bb():
    return Backbone(tiny_lm())


def qkv(T=40, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(Hq, T, D, generator=g),
        torch.randn(Hkv, T, D, generator=g),
        torch.randn(Hkv, T, D, generator=g),
    )


def test_cache_count_matches_each_budget():
    q, k, _ = qkv()
    P = 32
    assert cache_count(StreamingLLM(budget=12).visibility(0, q, k, k, P), P).tolist() == [12, 12]
    assert cache_count(SnapKV(budget=12, obs_window=4).visibility(0, q, k, k, P), P).tolist() == [12, 12]
    assert cache_count(FullCache().visibility(0, q, k, k, P), P).tolist() == [P, P]
    vis = RandomAdmission(p=1.0, local_window=W).visibility(0, q, k, k, P)
    assert cache_count(vis, P).tolist() == [P, P]
    vis = Visibility(kept=torch.zeros(2, 40, dtype=torch.bool), window=W)
    assert cache_count(vis, P).tolist() == [W, W]


def test_snapkv_keeps_observation_window_and_answers():
    q, k, _ = qkv()
    vis = SnapKV(budget=10, obs_window=4).visibility(0, q, k, k, 32)
    assert vis.kept[:, 28:].all()  # observation window and the answer tokens after the prompt
    assert vis.full_rows == 32 and vis.window == 1


def test_matched_baselines_hold_the_budget():
    stream, rnd, snap = matched_baselines(budget=20.4, prompt_len=100, local_window=W, seed=0)
    assert stream.sinks + stream.window == 20
    assert snap.budget == 20
    assert rnd.p == pytest.approx((20.4 - W) / (100 - W))


def test_full_policy_is_dense_and_wgkv_counts(bb):
    ids = torch.randint(0, 97, (40,))
    dense, _ = bb(ids[None], dense_attention)
    gates = tiny_gates(bb, init_bias=30.0, window=W)  # admits everything
    h, counts = policy_forward(bb, ids, [FullCache(), WGKVAdmission(gates, 0.1, W)], prompt_len=36)
    torch.testing.assert_close(h[0], dense[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[1], dense[0], atol=1e-5, rtol=1e-5)
    assert counts.shape == (2, 2, 2) and (counts == 36).all()


def test_two_pass_aligns_records(bb):
    ids = torch.randint(0, 97, (48,))
    gate_sets = [
        tiny_gates(bb, seed=s, init_bias=b, window=W, lam=lam)
        for s, b, lam in ((0, 0.0, 0.1), (1, -1.0, 0.2))
    ]
    recs, hidden = two_pass(bb, ids, 40, gate_sets, tau=0.5, local_window=W)
    assert [r["method"] for r in recs] == ["full", "wgkv", "wgkv"] + ["streaming", "random", "snapkv"] * 2
    assert hidden.shape[0] == len(recs)
    wg = {r["lam"]: r["cache"] for r in recs if r["method"] == "wgkv"}
    for r in recs[3:]:
        if r["method"] != "random":  # random matches in expectation only
            assert r["cache"] == pytest.approx(round(wg[r["lam"]]), abs=0.5)


def test_ruler_samples_fit_and_end_with_answer():
    tok = CharTokenizer()
    samples = generate(tok, [[5] * 3000], tasks=TASKS, lengths=(600, 900), samples=2)
    assert len(samples) == len(TASKS) * 2 * 2
    for s in samples:
        assert len(s["prompt"]) + len(s["answer"]) <= s["length"]
        assert len(s["prompt"]) > 0.8 * s["length"]
    pk = [s for s in samples if s["task"] == "passkey"][0]
    key = bytes(pk["answer"]).decode()
    assert key.isdigit() and len(key) == 5
    assert bytes(b + 0 for b in pk["prompt"]).decode(errors="ignore").count(key) == 2
    assert generate(tok, [[5] * 3000], lengths=(600,), samples=2) == generate(
        tok, [[5] * 3000], lengths=(600,), samples=2
    )


def test_evaluate_end_to_end(bb, tmp_path):
    gate_sets = [tiny_gates(bb, seed=0, init_bias=0.0, window=W)]
    samples = [
        {"task": "passkey", "length": 64, "index": 0, "prompt": list(range(1, 58)), "answer": [7, 8, 9]}
    ]

    class Rows:
        bins = (64,)

        def rows(self, split, L):
            return torch.randint(0, 97, (2, L)).numpy()

    res = evaluate(
        bb,
        gate_sets,
        tau=0.5,
        local_window=W,
        corpus=Rows(),
        nll_lengths=[64],
        nll_rows=1,
        cont=16,
        ruler=samples,
        time_budget_s=None,
        log=lambda *_: None,
    )
    assert res["complete"]
    methods = {(r["eval"], r["method"]) for r in res["rows"]}
    assert ("nll", "snapkv") in methods and ("passkey", "wgkv") in methods
    assert all(r["nll_all"] is None for r in res["rows"] if r["method"] == "snapkv" and r["eval"] == "nll")
    full = [r for r in res["rows"] if r["method"] == "full" and r["eval"] == "nll"][0]
    assert full["kv_fraction"] == 1.0 and full["mse"] == 0.0
    summary = summarize(res["rows"])
    assert any(s["length"] is None and s["method"] == "wgkv" and "accuracy" in s for s in summary)
    json.dumps(res)
