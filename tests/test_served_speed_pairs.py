"""benchmarks/served_speed.py merge: a workload's runs are compared only when both ran the workload's
current server arguments and started within one lease."""

import shlex
from pathlib import Path

import pytest

from benchmarks import served_speed as ss

pytestmark = pytest.mark.tools


def _rec(server_args: str, date: str) -> dict:
    return {
        "server_command": shlex.join(["python", "-m", "x", "--port", "1", *shlex.split(server_args)]),
        "date_utc": date,
    }


def test_one_lease_same_arguments_pass():
    w = ss.WORKLOADS["W4L"]
    ss.check_comparable(
        {
            "W4L": {
                "wgkv": _rec(w.server + " " + w.wgkv, "2026-12-03T22:31:00+00:00"),
                "upstream": _rec(w.server, "2026-12-03T22:46:00+00:00"),
            }
        }
    )


def test_changed_definition_is_refused():
    old = "--context-length 8192 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --mem-fraction-static 0.19"
    with pytest.raises(ValueError, match="without the workload's arguments"):
        ss.check_comparable(
            {
                "W4": {
                    "wgkv": _rec(ss.WORKLOADS["W4"].server, "2026-12-03T22:31:00+00:00"),
                    "upstream": _rec(old, "2026-12-03T22:46:00+00:00"),
                }
            }
        )


def test_two_leases_are_refused():
    w = ss.WORKLOADS["W3"]
    with pytest.raises(ValueError, match="not one lease"):
        ss.check_comparable(
            {
                "W3": {
                    "wgkv": _rec(w.server, "2026-12-02T07:00:00+00:00"),
                    "upstream": _rec(w.server, "2026-12-02T09:00:00+00:00"),
                }
            }
        )


def _part(path: Path, extra: str, tpot: float, date: str, server: str = "wgkv") -> str:
    w = ss.WORKLOADS["W1"]
    cmd = ss.server_command(server, w, Path("/m"), 1, "flashinfer", wgkv_extra=extra)
    part = {
        "server": server,
        "tp": 1,
        "environment": {"date_utc": date},
        "runs": [
            {
                "workload": "W1",
                "server_command": shlex.join(cmd),
                "bench_command": "b",
                "result": {
                    "median_tpot_ms": tpot,
                    "median_ttft_ms": 6000.0,
                    "output_throughput": 1000 / tpot,
                },
            }
        ],
    }
    if extra:
        part["wgkv_extra"] = extra
    path.write_text(__import__("json").dumps(part))
    return str(path)


def test_ab_parts_compare_variants_and_never_become_rows(tmp_path):
    """`run --wgkv-extra` parts (e.g. a decode launch shape) are compared by `ab` against the default
    part of the same lease, and `merge` refuses them: a variant is not the workload's row."""
    import json

    default = _part(tmp_path / "a.json", "", 5.9, "2026-12-05T01:00:00+00:00")
    pdl = _part(tmp_path / "b.json", "--wgkv-decode-launch pdl=1", 5.5, "2026-12-05T01:10:00+00:00")
    assert "--wgkv-decode-launch pdl=1" in json.loads(Path(pdl).read_text())["runs"][0]["server_command"]
    out = tmp_path / "ab.json"
    ss.main(["ab", default, pdl, "--out", str(out), "--what", "PDL in service"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["ab_rows"]}
    assert rows["default"]["tpot_vs_default"] == 1.0
    assert rows["--wgkv-decode-launch pdl=1"]["tpot_vs_default"] == pytest.approx(5.9 / 5.5)
    with pytest.raises(ValueError, match="A/B part"):
        ss.main(["merge", pdl, "--out-dir", str(tmp_path / "m")])
    late = _part(tmp_path / "c.json", "--wgkv-decode-launch block_n=32", 5.7, "2026-12-05T03:00:00+00:00")
    with pytest.raises(ValueError, match="not one lease"):
        ss.main(["ab", default, late, "--out", str(out), "--what", "x"])
    up = _part(tmp_path / "d.json", "", 8.8, "2026-12-05T01:05:00+00:00", server="upstream")
    with pytest.raises(ValueError, match="WG-KV variants"):
        ss.main(["ab", default, up, "--out", str(out), "--what", "x"])


def test_merge_replaces_the_servers_runs_and_keeps_older_named_runs(tmp_path):
    """A merge writes this lease's `wgkv`/`upstream` runs into W<n>.json and keeps runs an earlier lease
    left there under other names (a profiled run the README cites); `--leases` sets the lease text."""
    import json

    out = tmp_path / "serving"
    out.mkdir()
    (out / "W1.json").write_text(
        json.dumps(
            {
                "runs": {"wgkv": {"old": 1}, "upstream": {"old": 1}, "wgkv_2026-12-01_profiled": {"kept": 1}},
                "leases": "an earlier lease",
            }
        )
    )
    wg = _part(tmp_path / "a.json", "", 5.8, "2026-12-05T01:00:00+00:00")
    up = _part(tmp_path / "b.json", "", 8.7, "2026-12-05T01:10:00+00:00", server="upstream")
    ss.main(["merge", wg, up, "--out-dir", str(out), "--leases", "one lease of 2026-12-05"])
    w1 = json.loads((out / "W1.json").read_text())
    assert w1["runs"]["wgkv_2026-12-01_profiled"] == {"kept": 1}
    assert "old" not in w1["runs"]["wgkv"] and "old" not in w1["runs"]["upstream"]
    assert w1["leases"] == "one lease of 2026-12-05"
    row = next(r for r in json.loads((out / "summary.json").read_text())["rows"] if r["metric"] == "tpot_ms")
    assert row["ratio"] == pytest.approx(8.7 / 5.8)
    ss.main(["merge", wg, up, "--out-dir", str(out)])
    assert "leases" not in json.loads((out / "W1.json").read_text())
