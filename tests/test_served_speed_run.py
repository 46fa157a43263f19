"""benchmarks/served_speed.py's run loop with stand-ins for the server and bench_serving (no GPU, no
SGLang process): one server per server configuration, the part file names its baseline or WG-KV
configuration, and a refused request is recorded with its message."""

import json
import shlex
from pathlib import Path

import pytest

from benchmarks import served_speed as ss

pytestmark = pytest.mark.tools


class FakeServer:
    started: list = []

    def __init__(self, cmd, log_path, port, env, cwd, stop_timeout_s):
        self.cmd, self.env, self.log_path = cmd, env, Path(log_path)
        self.log_path.write_text("Decode batch, #running-req: 1, #token: 5\n")
        self.url = f"http://127.0.0.1:{port}"
        FakeServer.started.append(self)

    def wait_healthy(self, *a, **k):
        return 1.5

    def stop(self):
        pass


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    FakeServer.started = []
    benches = []

    def run_bench(cmd, out_file, timeout):
        benches.append(cmd)
        if "--output-details" in cmd:  # the 1M-token request upstream cannot hold
            msg = "Input length (1000000 tokens) exceeds the maximum allowed length (894426 tokens)"
            return {"completed": 0, "median_ttft_ms": 0.0, "errors": ["", msg], "itls": [[]]}
        return {"completed": 1, "median_ttft_ms": 5000.0, "median_tpot_ms": 6.0, "output_throughput": 100.0}

    monkeypatch.setattr(ss, "ServerProcess", FakeServer)
    monkeypatch.setattr(ss, "run_bench", run_bench)
    monkeypatch.setattr(ss, "server_state", lambda url: {"max_total_num_tokens": 1000})
    monkeypatch.setattr(ss, "wait_gpu_idle", lambda: 0)
    monkeypatch.setattr(ss, "model_dir", lambda path: tmp_path / "model")
    monkeypatch.setattr(ss, "environment", lambda: {"date_utc": "2026-01-01T00:00:00+00:00"})
    return benches


def _part(out: Path) -> dict:
    (path,) = out.glob("part.*.json")
    return json.loads(path.read_text())


def test_one_server_per_configuration_and_the_baseline_recorded(fakes, tmp_path):
    out = tmp_path / "out"
    ss.main(["--server", "upstream", "--baseline", "fa3", "--workloads", "W1,W0,W3", "--out-dir", str(out)])
    assert len(FakeServer.started) == 2  # W1 and W0 share one; W3 has its own memory
    assert all("--attention-backend" not in s.cmd for s in FakeServer.started)  # fa3: SGLang's default
    assert all(s.env["SGLANG_PLUGINS"] == "none" for s in FakeServer.started)
    part = _part(out)
    assert (part["kind"], part["server"], part["baseline"]) == ("served_part", "upstream", "fa3")
    assert [r["workload"] for r in part["runs"]] == ["W1", "W0", "W3"]
    assert part["runs"][0]["max_running_seen"] == 1 and part["runs"][0]["result"]["completed"] == 1
    assert len(fakes) == 6  # a warm-up and a timed bench_serving per workload
    assert "custom_params" not in " ".join(fakes[3])  # upstream W0: no WG-KV body


def test_wgkv_config_and_the_long_context_environment(fakes, tmp_path):
    out = tmp_path / "out"
    ss.main(["--server", "wgkv", "--wgkv-config", "fp8", "--workloads", "W6,W6B", "--out-dir", str(out)])
    assert len(FakeServer.started) == 2  # W6B's --kv-budget 4096 is another WG-KV server
    first = FakeServer.started[0]
    assert first.env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    assert shlex.join(first.cmd).endswith("--kv-cache-dtype fp8_e4m3")
    assert _part(out)["wgkv_config"] == "fp8"


def test_a_refused_request_keeps_its_message(fakes, tmp_path):
    out = tmp_path / "out"
    ss.main(["--server", "upstream", "--baseline", "fa3", "--workloads", "W6", "--out-dir", str(out)])
    (rec,) = _part(out)["runs"]
    assert "exceeds the maximum allowed length" in rec["refusal"]
    assert "itls" not in rec["result"] and "errors" not in rec["result"]  # details stay in the bench file


def test_unknown_names_are_refused(fakes, tmp_path):
    with pytest.raises(SystemExit, match="no configuration 'fa4'"):
        ss.main(
            ["--server", "upstream", "--baseline", "fa4", "--workloads", "W1", "--out-dir", str(tmp_path)]
        )
    with pytest.raises(KeyError, match="unknown workload 'W9'"):
        ss.main(["--server", "wgkv", "--workloads", "W9", "--out-dir", str(tmp_path)])


def test_chained_runs_in_one_folder_keep_every_file(fakes, tmp_path):
    """Runs chained into one folder (one tag on two workloads, two tags on one) each keep their part,
    server log and bench file: none overwrites another's."""
    out = tmp_path / "out"
    for args in (["W3"], ["M1D"], ["M1D", "--tag", "knee8"]):
        ss.main(["--server", "wgkv", "--workloads", *args, "--out-dir", str(out)])
    parts = sorted(p.name for p in out.glob("part.*.json"))
    assert parts == ["part.wgkv.bf16.a.M1D.json", "part.wgkv.bf16.a.W3.json", "part.wgkv.bf16.knee8.M1D.json"]
    assert len(list(out.glob("server.*.log"))) == 3
    timed = [cmd[cmd.index("--output-file") + 1] for cmd in fakes if "warmup.jsonl" not in " ".join(cmd)]
    assert len(timed) == len(set(timed)) == 3


def test_an_extra_flag_alone_is_taken_as_the_value(fakes, tmp_path):
    """``--wgkv-extra --wgkv-extend-kernels`` (one flag, no value of its own): argparse alone refuses it."""
    out = tmp_path / "out"
    ss.main(
        [
            "--server",
            "wgkv",
            "--workloads",
            "M1D",
            "--out-dir",
            str(out),
            "--wgkv-extra",
            "--wgkv-extend-kernels",
        ]
    )
    (server,) = FakeServer.started
    assert server.cmd[-1] == "--wgkv-extend-kernels"
    assert ss.extra_args_joined(["--upstream-extra", "--a 1", "--tag", "x"]) == [
        "--upstream-extra=--a 1",
        "--tag",
        "x",
    ]


@pytest.mark.parametrize(
    "input_len, chunk, expected",
    [
        (126_976, 8192, (1, 16)),  # W0: one prompt, every chunk of it
        (4096, 8192, (2, 1)),  # M1D's longest prompts: two fill one pass
        (2730, 8192, (3, 1)),
        (5000, 8192, (1, 1)),  # over half a chunk: alone
        (1000, 0, (1, 1)),  # chunked prefill off: one step
    ],
)
def test_the_profiled_prefill_fills_one_pass_with_short_prompts(input_len, chunk, expected):
    from benchmarks.served_profile import prefill_batch

    assert prefill_batch(input_len, chunk) == expected


@pytest.mark.parametrize(
    "host, activities, with_stack",
    [("stack", ["CPU", "GPU"], True), ("ops", ["CPU", "GPU"], False), ("gpu", ["GPU"], None)],
)
def test_the_profile_records_the_host_events_asked_for(tmp_path, host, activities, with_stack):
    """``--profile-host`` picks ``/start_profile``'s activities and Python stacks (SGLang's profiler
    takes stacks unless told not to); the trace directory and step count pass through."""
    from types import SimpleNamespace

    from benchmarks.served_profile import start_body

    body = start_body(SimpleNamespace(profile_host=host), tmp_path / "t", 12)
    assert body["activities"] == activities and body.get("with_stack") == with_stack
    assert (body["output_dir"], body["num_steps"]) == (str(tmp_path / "t"), 12)


def test_ttft_by_length_separates_a_fixed_cost_from_a_per_token_one(tmp_path):
    """bench_serving's per-request TTFTs fitted against the prompt lengths: 20 ms a request plus
    25 ms per 1,000 prompt tokens comes back as such; failed requests (an error, or no first token)
    are left out; fewer than three requests give None. The bench file keeps TTFTs, lengths and
    errors, not the inter-token gaps or texts."""
    import json

    from benchmarks.served_speed import drop_token_details, ttft_by_length

    lens = [2048 + 64 * i for i in range(33)]
    result = {
        "input_lens": lens + [4000, 4000],
        "ttfts": [(20 + 0.025 * n) / 1000 for n in lens] + [0.0, 9.0],
        "errors": [""] * 33 + ["", "refused"],
    }
    got = ttft_by_length(result)
    assert got["requests"] == 33
    assert got["fixed_ms"] == pytest.approx(20, abs=1e-6) and got["per_1k_tokens_ms"] == pytest.approx(25)
    assert [t["input_len"] for t in got["thirds"]] == [[2048, 2688], [2752, 3392], [3456, 4096]]
    assert got["thirds"][1]["median_ttft_ms"] == pytest.approx(20 + 0.025 * 3072)
    assert ttft_by_length({"input_lens": [1, 2], "ttfts": [0.1, 0.2], "errors": ["", ""]}) is None

    bench = tmp_path / "bench.jsonl"
    bench.write_text(
        json.dumps({"warm": 1})
        + "\n"
        + json.dumps({**result, "itls": [[0.1]], "generated_texts": ["x"]})
        + "\n"
    )
    drop_token_details(bench)
    lines = [json.loads(x) for x in bench.read_text().splitlines()]
    assert lines[0] == {"warm": 1} and lines[1] == result


def test_request_times_read_sglangs_time_stats_lines():
    """The queue and forward times of SGLang's ``ReqTimeStats`` lines, other lines ignored; None
    without any (a server started without ``--enable-request-time-stats-logging``)."""
    lines = [
        f"[2026-01-01 00:00:0{i}] ReqTimeStats(rid=r{i}, input_len=3000, cached_input_len=0, output_len=9, "
        f"attempts=1, type=unified): queue_duration={q:.2f}ms, forward_duration={f:.2f}ms, entry_time=1.000"
        for i, (q, f) in enumerate([(1.0, 500.0), (3.0, 700.0), (2.0, 600.0)])
    ]
    log = "\n".join(["Prefill batch, #new-seq: 1", *lines, "Decode batch, #running-req: 1"])
    times = ss.request_times(log)
    assert times["requests"] == 3
    assert times["queue_ms"] == {"median": 2.0, "p90": 3.0, "p99": 3.0}
    assert times["forward_ms"]["median"] == 600.0
    assert ss.request_times("Decode batch, #running-req: 1") is None


def test_prefill_under_load_reads_the_full_forwards_while_requests_wait():
    """``prefill_under_load``: SGLang's ``Prefill batch`` lines logged while requests waited and at
    least 0.9 of the largest forward's new tokens (quartiles of their input throughput, medians of
    new tokens and running requests); a forward with nobody waiting, a small one (a prompt admitted
    between decode steps) and other lines are left out; None without any such line."""
    from benchmarks.prefill_log import prefill_under_load

    def line(new, running, queue, rate):
        return (
            f"[2026-01-01 00:00:00] Prefill batch, #new-seq: 3, #new-token: {new}, #cached-token: 0, token "
            f"usage: 0.10, #running-req: {running}, #queue-req: {queue}, #pending-token: 9, cuda graph: "
            f"False, input throughput (token/s): {rate:.2f}"
        )

    log = "\n".join(
        [
            line(8192, 0, 0, 1.0),  # nobody waits
            line(8192, 10, 300, 40000.0),
            line(8100, 50, 250, 38000.0),
            line(8000, 90, 200, 20000.0),  # a knee's hold counted in its rate
            line(8150, 120, 150, 42000.0),
            line(3000, 120, 100, 9000.0),  # a small forward
            "[2026-01-01 00:00:01] Decode batch, #running-req: 120, #token: 9, gen throughput (token/s): 1.0",
        ]
    )
    got = prefill_under_load(log)
    assert got["forwards"] == 4
    assert got["prompt_tok_s"]["median"] == 39000.0
    assert got["prompt_tok_s"]["p25"] < 38000.0 < got["prompt_tok_s"]["p75"] <= 42000.0
    assert got["new_tokens_median"] == 8125.0 and got["running_median"] == 70.0
    assert got["by_running"] == {
        "0-49": {"forwards": 1, "median": 40000.0},
        "50-99": {"forwards": 2, "median": 29000.0},
        "100-199": {"forwards": 1, "median": 42000.0},
    }
    assert prefill_under_load(line(8192, 1, 0, 5.0)) is None


def test_load_tables_render_the_rate_by_running_and_the_ttft_fit():
    """A workload's page shows each run's burst rate by band of running requests (bands in order, a
    band a run lacks left empty) and its TTFT fit, and nothing for runs without them."""
    from benchmarks.render_served_speed import load_tables

    runs = {
        "upstream:fa3_fp8": {
            "prefill_under_load": {
                "by_running": {
                    "200+": {"forwards": 4, "median": 36900.0},
                    "0-49": {"forwards": 19, "median": 42814.0},
                }
            },
            "ttft_by_length": {
                "fixed_ms": 20.0,
                "per_1k_tokens_ms": 24.0,
                "thirds": [{"input_len": [2048, 2700], "median_ttft_ms": 80.0}],
            },
        },
        "wgkv:fp8": {"prefill_under_load": {"by_running": {"0-49": {"forwards": 19, "median": 38217.0}}}},
        "wgkv:bf16": {"prefill_under_load": None},
    }
    text = "\n".join(load_tables(runs))
    assert "| server | 0-49 running | 200+ running |" in text
    assert "| wgkv:fp8 | 38217 (19) |  |" in text
    assert "| upstream:fa3_fp8 | 20.0 | 24.0 | 2048-2700: 80.0 |" in text
    assert "wgkv:bf16" not in text
    assert load_tables({"wgkv:bf16": {}}) == []
