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
    return [{"task": t, "length": 2048, "index": i, "correct": c, "kv_fraction": kv}
            for i, (t, c) in enumerate(correct)]


def test_summary_rows_and_merge(tmp_path):
    full = {"method": "full", "budget": None, "command": "x", "rows": _rows([("passkey", True), ("vt", True),
                                                                             ("passkey", True), ("vt", False)], 1.0)}
    snap = {"method": "snapkv_served", "budget": 512, "command": "y",
            "rows": _rows([("passkey", True), ("vt", False), ("passkey", False), ("vt", False)], 0.25)}
    rows = summary_rows([full, snap], "cpu")
    assert rows[0]["accuracy"] == 0.75 and rows[0]["accuracy_vs_full"] == 1.0
    assert rows[1]["accuracy"] == 0.25 and rows[1]["accuracy_vs_full"] == pytest.approx(1 / 3)
    assert rows[1]["tasks"] == {"passkey": 0.5, "vt": 0.0} and rows[1]["full_tasks"] == {"passkey": 1.0, "vt": 0.5}
    assert rows[1]["kv_fraction"] == 0.25 and rows[1]["budget"] == 512 and rows[1]["n"] == 4

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"rows": [{"method": "wgkv", "lam": 0.1, "passkey": 0.9},
                                         {"method": "snapkv_served", "budget": 512, "engine": "cpu", "old": 1}]}))
    merge_summary(path, rows)
    merged = json.loads(path.read_text())["rows"]
    assert [r["method"] for r in merged] == ["wgkv", "full", "snapkv_served"]
    assert "old" not in merged[2]
