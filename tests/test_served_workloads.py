"""benchmarks/workloads.json: the served workloads as data, validated on load, and the commands
they make (the shipped file, then broken copies of it)."""

import copy
import json
import shlex
from pathlib import Path

import pytest

from benchmarks import served_workloads as sw

pytestmark = pytest.mark.tools

DOC = json.loads(sw.WORKLOADS_JSON.read_text())


def test_the_shipped_file_holds_every_workload_and_baseline():
    ws = sw.parse(DOC)
    assert list(ws.workloads) == [
        "W1",
        "W0",
        "W2",
        "W3",
        "W4",
        "W4L",
        "W5",
        "W6",
        "W6B",
        "W7",
        "M1",
        "M1P",
        "M1D",
    ]
    assert set(ws.baselines) == {"fa3", "fa3_fp8", "flashinfer", "flashinfer_fp8"}
    assert set(ws.wgkv_configs) == {"bf16", "fp8"}
    assert ws["W7"].client.input_len == 2_000_000 and ws["W6B"].upstream_from == "W6"
    assert "--kv-budget 4096" in ws["W6B"].wgkv_args and ws["W6"].upstream_may_refuse
    m1, m1p = ws["M1"], ws["M1P"]
    assert m1.client.request_rate == "inf" and m1p.client.request_rate > 0 and m1.client.range_ratio < 1
    assert "--mem-fraction-static" not in m1.server_args  # each engine on its own default memory
    assert {"p99_tpot_ms", "p99_ttft_s", "e2e_s", "p99_e2e_s"} <= set(m1.metrics)


def test_commands_of_each_baseline_and_config():
    ws = sw.parse(DOC)
    w = ws["W5"]
    fa3 = sw.server_command(ws, "upstream", "fa3", w, Path("/m"), 1)
    launcher = "launch_server"  # (the module names below, not a server started here)
    assert "--attention-backend" not in fa3 and fa3[1:3] == ["-m", f"sglang.{launcher}"]
    fp8 = shlex.join(sw.server_command(ws, "upstream", "flashinfer_fp8", w, Path("/m"), 1))
    assert "--attention-backend flashinfer --kv-cache-dtype fp8_e4m3" in fp8
    wg = shlex.join(sw.server_command(ws, "wgkv", "fp8", w, Path("/m"), 1, tp=2))
    assert f"sglang_wgkv.{launcher}" in wg and wg.endswith("--kv-cache-dtype fp8_e4m3")
    assert "--tp-size 2" in wg and w.server_args in wg and w.wgkv_args in wg
    bench = sw.bench_command(ws["M1P"], "http://h", Path("o"), 1, None)
    assert bench[bench.index("--request-rate") + 1] == "4.0"
    assert bench[bench.index("--random-range-ratio") + 1] == "0.5"
    with pytest.raises(ValueError, match="random output lengths"):
        sw.bench_command(ws["M1"], "http://h", Path("o"), 1, {"admission": False})


def test_a_workload_on_sglangs_defaults_leaves_the_common_switches_out():
    """M1D is M1 with the radix cache and upstream's prefill CUDA graphs on: both engines start without
    those two switches, with every other common argument, and on servers of their own."""
    ws = sw.parse(DOC)
    m1, m1d = ws["M1"], ws["M1D"]
    assert (m1d.client, m1d.server_args, m1d.wgkv_args) == (m1.client, m1.server_args, m1.wgkv_args)
    for server, config in (("upstream", "fa3"), ("wgkv", "bf16")):
        full = sw.server_command(ws, server, config, m1, Path("/m"), 1)
        kept = sw.server_command(ws, server, config, m1d, Path("/m"), 1)
        assert [a for a in full if a not in m1d.keep_defaults] == kept
        assert {"--disable-radix-cache", "--disable-prefill-cuda-graph"} <= set(full) - set(kept)
        assert m1.server_key(server) != m1d.server_key(server)


def test_memory_in_gib_is_a_fraction_of_each_card():
    """W4 holds 26.7 GiB on any card: 0.19 of an H200, a third of an 80 GB H100 (where 0.19 left no room
    for the KV pool beside the 8B model's weights)."""
    ws = sw.parse(DOC)
    w = ws["W4"]

    def fraction(total_mib):
        cmd = sw.server_command(ws, "upstream", "fa3", w, Path("/m"), 1, gpu_total_mib=total_mib)
        return float(cmd[cmd.index("--mem-fraction-static") + 1])

    assert w.static_memory_gib == 26.7 and "--mem-fraction-static" not in w.server_args
    assert fraction(143771) == pytest.approx(0.19, abs=1e-3)  # H200
    assert fraction(81559) == pytest.approx(26.7 * 1024 / 81559, abs=1e-4)  # H100
    with pytest.raises(ValueError, match="the GPU's total is needed"):
        sw.server_command(ws, "wgkv", "bf16", w, Path("/m"), 1)
    with pytest.raises(ValueError, match="of this card's 24576 MiB"):
        sw.server_command(ws, "wgkv", "bf16", w, Path("/m"), 1, gpu_total_mib=24576)
    # a workload in fractions ignores the card's size
    assert sw.server_command(ws, "upstream", "fa3", ws["W5"], Path("/m"), 1) == sw.server_command(
        ws, "upstream", "fa3", ws["W5"], Path("/m"), 1, gpu_total_mib=81559
    )


def test_workloads_sharing_a_server():
    ws = sw.parse(DOC)
    assert ws["W1"].server_key("wgkv") == ws["W2"].server_key("wgkv")
    assert ws["W6"].server_key("upstream") == ws["W6B"].server_key("upstream")
    assert ws["W6"].server_key("wgkv") != ws["W6B"].server_key("wgkv")  # --kv-budget 4096


def _broken(edit) -> dict:
    doc = copy.deepcopy(DOC)
    edit(doc)
    return doc


def _workload(doc: dict, name: str) -> dict:
    return next(w for w in doc["workloads"] if w["name"] == name)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: _workload(d, "W1").update(metrics=["ttft_p50"]), "unknown: \\['ttft_p50'\\]"),
        (lambda d: _workload(d, "W1").update(metric="x"), "unknown fields \\['metric'\\]"),
        (lambda d: _workload(d, "W1").pop("goal"), "missing \\['goal'\\]"),
        (lambda d: _workload(d, "W1")["client"].update(prompts=0), "must be positive"),
        (lambda d: _workload(d, "M1")["client"].update(range_ratio=1.5), "range_ratio"),
        (lambda d: _workload(d, "M1P")["client"].update(request_rate=-1), "request_rate"),
        (lambda d: _workload(d, "W0").update(upstream_from="W9"), "not a measured workload"),
        (lambda d: _workload(d, "W6B").update(upstream_from="W5"), "other requests"),
        (lambda d: d["workloads"].append(_workload(d, "W2")), "listed twice"),
        (lambda d: d["metrics"]["tpot_ms"].update(better="less"), "lower or higher"),
        (lambda d: d["baselines"].update(best={"server_args": ""}), "'best' is the summary's pick"),
        (lambda d: d.update(kind="other"), "not 'served_workloads'"),
        (lambda d: _workload(d, "W4").update(static_memory_gib=0), "must be a positive number"),
        (lambda d: _workload(d, "M1D").update(keep_defaults=["--log-level"]), "must be switches"),
        (lambda d: _workload(d, "M1D").update(keep_defaults=["--enable-mixed-chunk"]), "must be switches"),
        (
            lambda d: _workload(d, "W4").update(server_args="--mem-fraction-static 0.19"),
            "static_memory_gib and --mem-fraction-static",
        ),
    ],
)
def test_a_broken_file_is_refused(edit, message):
    with pytest.raises(ValueError, match=message):
        sw.parse(_broken(edit))


def test_unknown_names_are_clear():
    ws = sw.parse(DOC)
    with pytest.raises(KeyError, match="unknown workload 'W9'"):
        ws["W9"]
