"""evals.served without a server: configurations' launcher options, summary rows against the full
cache, and the merge into the shared summary file (other methods' rows kept)."""

import json

import pytest

from evals.served import Configuration, merge_summary, summary_rows

pytestmark = pytest.mark.training


def test_configuration_options():
    assert Configuration("full", None).args() == ["--disable-wgkv"]
    assert Configuration("snapkv_served", 512).args() == ["--disable-wgkv", "--kv-budget", "512"]
    assert Configuration("wgkv_snapkv_served", 1024).args() == ["--kv-budget", "1024"]
    for bad in (("full", 512), ("snapkv_served", None), ("dense", None)):
        with pytest.raises(ValueError):
            Configuration(*bad)


def _rows(correct, kv):
    return [
        {"task": t, "length": 2048, "index": i, "correct": c, "kv_fraction": kv}
        for i, (t, c) in enumerate(correct)
    ]


def test_summary_rows_and_merge(tmp_path):
    full = {
        "method": "full",
        "budget": None,
        "command": "x",
        "rows": _rows([("passkey", True), ("vt", True), ("passkey", True), ("vt", False)], 1.0),
    }
    snap = {
        "method": "snapkv_served",
        "budget": 512,
        "command": "y",
        "rows": _rows([("passkey", True), ("vt", False), ("passkey", False), ("vt", False)], 0.25),
    }
    rows = summary_rows([full, snap], "cpu")
    assert rows[0]["accuracy"] == 0.75 and rows[0]["accuracy_vs_full"] == 1.0
    assert rows[1]["accuracy"] == 0.25 and rows[1]["accuracy_vs_full"] == pytest.approx(1 / 3)
    assert rows[1]["tasks"] == {"passkey": 0.5, "vt": 0.0} and rows[1]["full_tasks"] == {
        "passkey": 1.0,
        "vt": 0.5,
    }
    assert rows[1]["kv_fraction"] == 0.25 and rows[1]["budget"] == 512 and rows[1]["n"] == 4

    path = tmp_path / "summary.json"
    path.write_text(
        json.dumps(
            {
                "rows": [
                    {"method": "wgkv", "lam": 0.1, "passkey": 0.9},
                    {"method": "snapkv_served", "budget": 512, "engine": "cpu", "old": 1},
                ]
            }
        )
    )
    merge_summary(path, rows)
    merged = json.loads(path.read_text())["rows"]
    assert [r["method"] for r in merged] == ["wgkv", "full", "snapkv_served"]
    assert "old" not in merged[2]


def test_offline_rows_merge_beside_served_rows(tmp_path):
    """evals.summary --into: offline rows (one per λ) join the served rows in one file; a re-run
    replaces only its own engine's rows, and rows differing only in λ are all kept."""
    from evals.summary import main as summary_main

    def s(ev, method, lam, n, kv, **m):
        return {"eval": ev, "method": method, "lam": lam, "length": None, "n": n, "kv_fraction": kv, **m}

    results = {
        "summary": [
            s("nll", "full", None, 2, 1.0, nll_cont=1.5),
            s("passkey", "full", None, 4, 1.0, accuracy=1.0),
            *(
                s("passkey", "wgkv", lam, 4, kv, accuracy=acc)
                for lam, kv, acc in ((0.01, 0.8, 1.0), (0.1, 0.3, 0.75))
            ),
        ],
        "config": {"command": "python -m evals.run X", "device": "cpu"},
    }
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    into = tmp_path / "summary.json"
    into.write_text(
        json.dumps(
            {
                "rows": [
                    {"method": "snapkv_served", "budget": 512, "engine": "cpu", "accuracy": 0.5},
                    {"method": "wgkv", "budget": None, "engine": "offline_cpu", "lam": 0.1, "passkey": 0.0},
                ]
            }
        )
    )
    for _ in range(2):  # idempotent
        summary_main([str(tmp_path / "offline.json"), str(src), "--into", str(into)])
    rows = json.loads(into.read_text())["rows"]
    assert [(r["method"], r.get("engine"), r.get("lam")) for r in rows] == [
        ("snapkv_served", "cpu", None),
        ("wgkv", "offline_cpu", 0.01),
        ("wgkv", "offline_cpu", 0.1),
    ]
    assert (
        rows[2]["passkey"] == 0.75
        and rows[2]["command"] == "python -m evals.run X"
        and rows[2]["budget"] is None
    )
    # a later run of λ 0.1 alone replaces that row and keeps λ 0.01's
    results["summary"] = [r for r in results["summary"] if r["lam"] != 0.01]
    results["summary"][-1]["accuracy"] = 0.5
    src.write_text(json.dumps(results))
    summary_main([str(tmp_path / "offline.json"), str(src), "--into", str(into)])
    rows = json.loads(into.read_text())["rows"]
    assert [(r["method"], r.get("lam"), r.get("passkey")) for r in rows[1:]] == [
        ("wgkv", 0.01, 1.0),
        ("wgkv", 0.1, 0.5),
    ]


def test_agreement_of_served_and_offline(tmp_path):
    """evals.agreement: matched by sample; a disagreement within the near-tie margin is told apart
    from a hard one; the served prompt share discounts the generated tokens (all in the ring)."""
    from evals.agreement import main as agreement_main
    from evals.agreement import served_prompt_share

    usage = lambda kv: {"mean_kv_tokens_per_head": kv, "cached_tokens": 1005}
    served_rows = [
        {
            "task": "passkey",
            "length": 2048,
            "index": i,
            "correct": c,
            "prompt_tokens": 1000,
            "usage": usage(kv),
        }
        for i, (c, kv) in enumerate([(True, 305.0), (False, 405.0), (True, 305.0)])
    ]
    assert served_prompt_share(served_rows[0]) == (0.3, 0.005)
    served = {
        "command": "s",
        "results": [
            {"method": "wgkv_served", "budget": None, "rows": served_rows},
            {"method": "wgkv_snapkv_served", "budget": 512, "rows": served_rows},
        ],
    }
    off = lambda i, c, m, kv: {
        "eval": "passkey",
        "length": 2048,
        "index": i,
        "method": "wgkv",
        "lam": 0.1,
        "correct": c,
        "answer_margin": m,
        "kv_fraction": kv,
    }
    offline = {
        "config": {"command": "o"},
        "rows": [
            off(0, True, 3.0, 0.302),
            off(1, True, 0.4, 0.4),
            off(2, False, -2.5, 0.31),
            {**off(0, True, 1, 1), "eval": "nll"},
        ],
    }
    (tmp_path / "s.json").write_text(json.dumps(served))
    (tmp_path / "o.json").write_text(json.dumps(offline))
    agreement_main(
        [
            "--served",
            str(tmp_path / "s.json"),
            "--offline",
            str(tmp_path / "o.json"),
            "--pairs",
            "wgkv_served=wgkv@0.1",
            "--out",
            str(tmp_path / "a.json"),
        ]
    )
    pair = json.loads((tmp_path / "a.json").read_text())["pairs"][0]
    assert (pair["n"], pair["agree"], pair["near_tie"], pair["hard"]) == (3, 1, 1, 1)
    assert [x["verdict"] for x in pair["samples"]] == ["agree", "near_tie", "hard"]
    assert [x["kv_within_tolerance"] for x in pair["samples"]] == [True, True, False]
    assert not pair["kv_within_tolerance"] and pair["max_kv_gap"] == pytest.approx(0.01)


def test_answer_margin_is_the_closest_greedy_call():
    """evals.run's answer scores: margin = min over answer positions of target - best other logit."""
    import torch

    from evals.run import answer_scores

    class Identity:  # hidden states are the logits
        def logits(self, h):
            return h

    # prompt of 2 tokens, answer [1, 2]: the logits predicting them sit at positions 1 and 2
    hidden = torch.tensor(
        [
            [[0, 0, 0], [0, 5, 1], [0, 2, 3], [0, 0, 0]],  # right: margins 4 and 1
            [[0, 0, 0], [0, 5, 1], [0, 3.5, 3], [0, 0, 0]],
        ]
    )  # wrong at the 2nd: -0.5
    correct, nll, margin = answer_scores(Identity(), hidden, 2, [1, 2])
    assert correct == [True, False] and margin == pytest.approx([1.0, -0.5]) and nll[0] < nll[1]


def test_load_samples_filters_like_every_consumer(tmp_path):
    """evals.ruler.load_samples: .json and .json.gz, first N per (task, length), lengths, tasks."""
    import gzip

    from evals.ruler import load_samples

    samples = [
        {"task": t, "length": L, "index": i, "prompt": [1], "answer": [2]}
        for t in ("passkey", "vt")
        for L in (2048, 4096)
        for i in range(3)
    ]
    plain, packed = tmp_path / "s.json", tmp_path / "s.json.gz"
    plain.write_text(json.dumps({"samples": samples}))
    packed.write_bytes(gzip.compress(json.dumps({"samples": samples}).encode()))
    assert load_samples(plain) == load_samples(packed) == samples
    got = load_samples(packed, samples=2, lengths="2048", tasks="passkey")
    assert [(s["task"], s["length"], s["index"]) for s in got] == [("passkey", 2048, 0), ("passkey", 2048, 1)]
    assert len(load_samples(plain, lengths="2048,4096", tasks="passkey,vt")) == 12
