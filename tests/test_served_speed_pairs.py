"""benchmarks/served_report.py merge: a workload's runs are compared only when they ran the workload's
current server arguments and started on one machine within an hour; ``best`` is the best baseline
measured there.
The part files here are synthetic fixtures written into tmp_path, not results."""

import json
import shlex
from pathlib import Path

import pytest

from benchmarks import served_report as sr
from benchmarks import served_workloads as sw

pytestmark = pytest.mark.tools

WS = sw.load()
H200_MIB = 143771  # nvidia-smi memory.total of an H200: W4 sizes its memory in GiB


def _rec(server_args: str, date: str) -> dict:
    return {
        "server_command": shlex.join(["python", "-m", "x", "--port", "1", *shlex.split(server_args)]),
        "date_utc": date,
    }


def _group(**runs) -> dict:
    group = {"upstream": {}, "wgkv": {}}
    for key, rec in runs.items():
        server, config = key.split("__")
        group[server][config] = rec
    return group


def test_one_machine_same_arguments_pass():
    w = WS["W4L"]
    sr.check_comparable(
        {
            ("W4L", 1): _group(
                wgkv__bf16=_rec(w.server_args + " " + w.wgkv_args, "2026-12-03T22:31:00+00:00"),
                upstream__fa3=_rec(w.server_args, "2026-12-03T22:46:00+00:00"),
            )
        },
        WS,
    )


def test_a_timed_run_that_compiled_is_refused():
    w = WS["W4L"]
    compiled = {**_rec(w.server_args + " " + w.wgkv_args, "2026-12-03T22:31:00+00:00")}
    compiled["compiled_in_timed_run"] = ["_split_kernel"]
    with pytest.raises(ValueError, match=r"compiled Triton kernels \['_split_kernel'\]"):
        sr.check_comparable(
            {
                ("W4L", 1): _group(
                    wgkv__bf16=compiled, upstream__fa3=_rec(w.server_args, "2026-12-03T22:46:00+00:00")
                )
            },
            WS,
        )


def test_changed_definition_is_refused():
    old = "--context-length 8192 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --mem-fraction-static 0.19"
    with pytest.raises(ValueError, match="without the workload's arguments"):
        sr.check_comparable(
            {
                ("W4", 1): _group(
                    wgkv__bf16=_rec(WS["W4"].server_args, "2026-12-03T22:31:00+00:00"),
                    upstream__fa3=_rec(old, "2026-12-03T22:46:00+00:00"),
                )
            },
            WS,
        )


def test_runs_more_than_an_hour_apart_are_refused():
    """A baseline run more than an hour away (another machine) cannot join the WG-KV run's group (nor
    become its ``best``)."""
    w = WS["W3"]
    with pytest.raises(ValueError, match="not one machine's hour"):
        sr.check_comparable(
            {
                ("W3", 1): _group(
                    wgkv__bf16=_rec(w.server_args, "2026-12-02T07:00:00+00:00"),
                    upstream__flashinfer=_rec(w.server_args, "2026-12-02T07:10:00+00:00"),
                    upstream__fa3=_rec(w.server_args, "2026-12-02T09:00:00+00:00"),
                )
            },
            WS,
        )


def _part(
    path: Path,
    server: str,
    config: str | None,
    results: dict[str, dict],
    date: str,
    extra: str = "",
    tp: int = 1,
) -> str:
    """A synthetic part file: ``results`` maps a workload to bench_serving's result fields."""
    runs = []
    for name, result in results.items():
        cmd = sw.server_command(
            WS, server, config or sr.LEGACY[server], WS[name], Path("/m"), 1, tp, gpu_total_mib=H200_MIB
        )
        runs.append(
            {
                "workload": name,
                "server_command": shlex.join(cmd + shlex.split(extra)),
                "bench_command": f"bench {server} {config} {name}",
                "result": result,
            }
        )
    part = {"server": server, "tp": tp, "environment": {"date_utc": date}, "runs": runs}
    if config is not None:  # None: a part written before baselines were recorded
        part["baseline" if server == "upstream" else "wgkv_config"] = config
    if extra:
        part["wgkv_extra"] = extra
    path.write_text(json.dumps(part))
    return str(path)


def _w1(ttft_s: float, tpot_ms: float) -> dict:
    return {"median_ttft_ms": 1000 * ttft_s, "median_tpot_ms": tpot_ms, "output_throughput": 1000 / tpot_ms}


def _rows(out: Path) -> dict:
    rows = json.loads((out / "summary.json").read_text())["rows"]
    return {(r["workload"], r["metric"], r["baseline"], r["wgkv_config"]): r for r in rows}


def test_best_is_the_best_baseline_per_metric(tmp_path):
    """W1's TTFT is best under one baseline and its TPOT under another: each metric's ``best`` row
    takes its own winner, paired with the same WG-KV run; W0 borrows W1's upstream runs."""
    out = tmp_path / "serving"
    t = "2026-12-05T01:{:02d}:00+00:00"
    parts = [
        _part(tmp_path / "a.json", "upstream", "fa3", {"W1": _w1(20.0, 8.0)}, t.format(0)),
        _part(tmp_path / "b.json", "upstream", "fa3_fp8", {"W1": _w1(22.0, 6.5)}, t.format(10)),
        _part(tmp_path / "c.json", "upstream", "flashinfer", {"W1": _w1(24.0, 8.8)}, t.format(20)),
        _part(tmp_path / "d.json", "wgkv", "bf16", {"W1": _w1(5.0, 5.0), "W0": _w1(30.0, 8.1)}, t.format(30)),
    ]
    sr.main(["merge", *parts, "--out-dir", str(out)])
    rows = _rows(out)
    best_ttft = rows[("W1", "ttft_s", "best", "bf16")]
    assert (best_ttft["best_of"], best_ttft["upstream"], best_ttft["ratio"]) == ("fa3", 20.0, 4.0)
    best_tpot = rows[("W1", "tpot_ms", "best", "bf16")]
    assert (best_tpot["best_of"], best_tpot["upstream"]) == ("fa3_fp8", 6.5)
    assert best_tpot["ratio"] == pytest.approx(6.5 / 5.0)
    assert best_tpot["command"]["upstream"]["bench"] == "bench upstream fa3_fp8 W1"
    assert rows[("W1", "tpot_ms", "flashinfer", "bf16")]["ratio"] == pytest.approx(8.8 / 5.0)
    assert rows[("W0", "tpot_ms", "best", "bf16")]["best_of"] == "fa3_fp8"
    assert {k[2] for k in rows if k[0] == "W1"} == {"fa3", "fa3_fp8", "flashinfer", "best"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "served_summary" and "same machine" in summary["best"]
    w1 = json.loads((out / "W1.json").read_text())
    assert w1["kind"] == "served_workload"
    assert set(w1["runs"]) == {"upstream:fa3", "upstream:fa3_fp8", "upstream:flashinfer", "wgkv:bf16"}


def test_throughput_best_is_the_highest(tmp_path):
    out = tmp_path / "serving"
    t = "2026-12-05T01:{:02d}:00+00:00"
    parts = [
        _part(tmp_path / "a.json", "upstream", "fa3", {"W4": {"output_throughput": 2400.0}}, t.format(0)),
        _part(tmp_path / "b.json", "upstream", "fa3_fp8", {"W4": {"output_throughput": 4100.0}}, t.format(5)),
        _part(tmp_path / "c.json", "wgkv", "bf16", {"W4": {"output_throughput": 7400.0}}, t.format(9)),
    ]
    sr.main(["merge", *parts, "--out-dir", str(out)])
    best = _rows(out)[("W4", "output_tok_s", "best", "bf16")]
    assert (best["best_of"], best["ratio"]) == ("fa3_fp8", pytest.approx(7400 / 4100))


def test_a_refusing_baseline_is_recorded_and_never_best(tmp_path):
    """W6 (1M tokens): a baseline that refused the request keeps its message in the row; ``best``
    is the baseline that served it."""
    out = tmp_path / "serving"
    t = "2026-12-05T02:{:02d}:00+00:00"
    up = tmp_path / "a.json"
    # bench_serving's line for a run whose requests all failed: zero latencies, nothing completed
    _part(
        up,
        "upstream",
        "fa3",
        {"W6": {"completed": 0, "median_ttft_ms": 0.0, "median_tpot_ms": 0.0}},
        t.format(0),
    )
    part = json.loads(up.read_text())
    part["runs"][0]["refusal"] = (
        "Input length (1000000 tokens) exceeds the maximum allowed length (894426 tokens)"
    )
    up.write_text(json.dumps(part))
    failed = {"W6": {"completed": 0, "median_ttft_ms": 0.0, "median_tpot_ms": 0.0}}  # no message kept
    parts = [
        str(up),
        _part(tmp_path / "f.json", "upstream", "flashinfer", failed, t.format(5)),
        _part(tmp_path / "b.json", "upstream", "fa3_fp8", {"W6": _w1(300.0, 20.0)}, t.format(10)),
        _part(tmp_path / "c.json", "wgkv", "bf16", {"W6": _w1(120.0, 12.0)}, t.format(20)),
    ]
    sr.main(["merge", *parts, "--out-dir", str(out)])
    rows = _rows(out)
    refused = rows[("W6", "ttft_s", "fa3", "bf16")]
    assert refused["upstream"] is None and refused["ratio"] is None
    assert "exceeds the maximum allowed length" in refused["upstream_refusal"]
    assert rows[("W6", "ttft_s", "flashinfer", "bf16")]["upstream"] is None
    assert rows[("W6", "ttft_s", "best", "bf16")]["best_of"] == "fa3_fp8"


def test_a_merge_replaces_only_the_configs_it_measured(tmp_path):
    """Rows of another WG-KV configuration (or workload) stay; rows of the measured one are replaced
    whole, so no baseline of an older machine stays paired beside the new WG-KV run."""
    out = tmp_path / "serving"
    t = "2026-12-05T03:{:02d}:00+00:00"
    old = [
        _part(tmp_path / "a.json", "upstream", None, {"W1": _w1(24.0, 8.8)}, "2026-12-04T13:10:00+00:00"),
        _part(tmp_path / "b.json", "wgkv", None, {"W1": _w1(6.0, 5.9)}, "2026-12-04T13:20:00+00:00"),
    ]
    sr.main(["merge", *old, "--out-dir", str(out)])
    assert _rows(out)[("W1", "tpot_ms", "flashinfer", "bf16")]["wgkv"] == 5.9  # legacy parts
    fp8 = [
        _part(tmp_path / "c.json", "upstream", "fa3", {"W1": _w1(20.0, 8.0)}, t.format(0)),
        _part(tmp_path / "d.json", "wgkv", "fp8", {"W1": _w1(5.5, 4.5)}, t.format(10)),
    ]
    sr.main(["merge", *fp8, "--out-dir", str(out)])
    rows = _rows(out)
    assert ("W1", "tpot_ms", "flashinfer", "bf16") in rows and ("W1", "tpot_ms", "fa3", "fp8") in rows
    bf16 = [
        _part(tmp_path / "e.json", "upstream", "fa3", {"W1": _w1(20.0, 8.0)}, t.format(20)),
        _part(tmp_path / "f.json", "wgkv", "bf16", {"W1": _w1(5.8, 5.7)}, t.format(30)),
    ]
    sr.main(["merge", *bf16, "--out-dir", str(out)])
    rows = _rows(out)
    assert ("W1", "tpot_ms", "flashinfer", "bf16") not in rows
    assert rows[("W1", "tpot_ms", "best", "bf16")]["wgkv"] == 5.7
    assert rows[("W1", "tpot_ms", "best", "fp8")]["wgkv"] == 4.5


def test_ab_parts_compare_variants_and_never_become_rows(tmp_path):
    """``served_speed --wgkv-extra`` parts (e.g. a decode launch shape) are compared by ``ab``
    against the default part of the same machine, and ``merge`` refuses them."""
    t = "2026-12-05T01:{:02d}:00+00:00"
    default = _part(tmp_path / "a.json", "wgkv", "bf16", {"W1": _w1(6.0, 5.9)}, t.format(0))
    pdl = _part(tmp_path / "b.json", "wgkv", "bf16", {"W1": _w1(6.0, 5.5)}, t.format(10), extra="--pdl 1")
    out = tmp_path / "ab.json"
    sr.main(["ab", default, pdl, "--out", str(out), "--what", "PDL in service"])
    ab = json.loads(out.read_text())
    rows = {r["variant"]: r for r in ab["ab_rows"]}
    assert ab["kind"] == "served_ab" and rows["default"]["tpot_vs_default"] == 1.0
    assert rows["--pdl 1"]["tpot_vs_default"] == pytest.approx(5.9 / 5.5)
    with pytest.raises(ValueError, match="A/B part"):
        sr.main(["merge", pdl, "--out-dir", str(tmp_path / "m")])
    late = _part(
        tmp_path / "c.json", "wgkv", "bf16", {"W1": _w1(6.0, 5.7)}, "2026-12-05T03:00:00+00:00", "--x"
    )
    with pytest.raises(ValueError, match="not one machine's hour"):
        sr.main(["ab", default, late, "--out", str(out), "--what", "x"])
    with pytest.raises(ValueError, match="no WG-KV part"):
        sr.main(
            [
                "ab",
                _part(tmp_path / "e.json", "upstream", "fa3", {}, t.format(5)),
                "--out",
                str(out),
                "--what",
                "x",
            ]
        )


def test_ab_rates_each_variant_against_the_best_upstream_part_and_marks_compiles(tmp_path):
    """Upstream parts of the machine are references: each WG-KV row gets, per metric, its ratio against
    the best upstream value (> 1: WG-KV better); a run that compiled while timed is no result and is
    never a reference."""
    t = "2026-12-05T01:{:02d}:00+00:00"
    up = _part(tmp_path / "a.json", "upstream", "fa3", {"W1": _w1(20.0, 8.0)}, t.format(0))
    up_fp8 = _part(tmp_path / "b.json", "upstream", "fa3_fp8", {"W1": _w1(25.0, 6.0)}, t.format(5))
    wg = _part(tmp_path / "c.json", "wgkv", "bf16", {"W1": _w1(10.0, 12.0)}, t.format(10))
    data = json.loads(Path(wg).read_text())
    data["runs"][0]["compiled_in_timed_run"] = ["_split_kernel"]
    Path(wg).write_text(json.dumps(data))
    big = _part(
        tmp_path / "d.json",
        "wgkv",
        "bf16",
        {"W1": _w1(8.0, 4.0)},
        t.format(15),
        extra="--wgkv-forward-tokens 8192",
    )
    out = tmp_path / "ab.json"
    sr.main(["ab", up, up_fp8, wg, big, "--out", str(out), "--what", "forward budget"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["ab_rows"]}
    assert set(rows) == {"upstream fa3", "upstream fa3_fp8", "default", "--wgkv-forward-tokens 8192"}
    assert rows["default"]["result"] is False and rows["default"]["compiled_in_timed_run"] == [
        "_split_kernel"
    ]
    ratios = rows["--wgkv-forward-tokens 8192"]["vs_best_upstream"]
    assert ratios["ttft_s"] == pytest.approx(20.0 / 8.0) and ratios["tpot_ms"] == pytest.approx(6.0 / 4.0)
    assert ratios["output_tok_s"] == pytest.approx((1000 / 4.0) / (1000 / 6.0))
    assert "vs_best_upstream" not in rows["upstream fa3"]
    nograph = _part(tmp_path / "e.json", "upstream", "fa3", {"W1": _w1(19.0, 8.0)}, t.format(20))
    data = json.loads(Path(nograph).read_text())
    data["upstream_extra"] = "--cuda-graph-backend-prefill disabled"
    Path(nograph).write_text(json.dumps(data))
    sr.main(["ab", up, nograph, big, "--out", str(out), "--what", "prefill graphs"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["ab_rows"]}
    assert "upstream fa3 --cuda-graph-backend-prefill disabled" in rows
    with pytest.raises(ValueError, match="A/B part"):
        sr.main(["merge", nograph, big, "--out-dir", str(tmp_path / "m")])


def test_merge_keeps_older_named_runs_and_sets_the_machines_text(tmp_path):
    out = tmp_path / "serving"
    out.mkdir()
    (out / "W1.json").write_text(
        json.dumps({"runs": {"wgkv:bf16": {"old": 1}, "wgkv_profiled": {"kept": 1}}, "machines": "earlier"})
    )
    t = "2026-12-05T01:{:02d}:00+00:00"
    wg = _part(tmp_path / "a.json", "wgkv", "bf16", {"W1": _w1(6.0, 5.8)}, t.format(0))
    up = _part(tmp_path / "b.json", "upstream", "fa3", {"W1": _w1(20.0, 8.7)}, t.format(10))
    sr.main(["merge", wg, up, "--out-dir", str(out), "--machines", "one H200"])
    w1 = json.loads((out / "W1.json").read_text())
    assert w1["runs"]["wgkv_profiled"] == {"kept": 1} and "old" not in w1["runs"]["wgkv:bf16"]
    assert w1["machines"] == "one H200"
    sr.main(["merge", wg, up, "--out-dir", str(out)])
    assert "machines" not in json.loads((out / "W1.json").read_text())
