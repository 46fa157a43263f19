"""benchmarks/served_model.py: the costs fitted from SGLang's log lines, and the model's identities."""

import json

import pytest

from benchmarks import served_model as sm

pytestmark = pytest.mark.tools

A, B, G = 5.0, 0.06, 0.03  # ms: step's fixed cost, per running request, per prompt token


def decode_line(running: int, queued: int = 0, graph: bool = True, step_ms: float | None = None) -> str:
    step = A + B * running if step_ms is None else step_ms
    return (
        f"[2026-01-01 00:00:00] Decode batch, #running-req: {running}, #token: {running * 3000}, token usage: "
        f"0.50, cuda graph: {graph}, gen throughput (token/s): {1000 * running / step:.2f}, #queue-req: {queued}"
    )


def prefill_line(new_tokens: int, running: int, tok_s: float) -> str:
    return (
        f"[2026-01-01 00:00:00] Prefill batch, #new-seq: 3, #new-token: {new_tokens}, #cached-token: 0, token "
        f"usage: 0.10, #running-req: {running}, #queue-req: 10, #pending-token: 9000, cuda graph: False, "
        f"input throughput (token/s): {tok_s:.2f}"
    )


def burst_log() -> str:
    lines = [prefill_line(8192, r, 1000 / G) for r in (1, 5, 9)]
    lines += [prefill_line(8192, 300, 1000 / (2 * G))]  # many decoding beside it: not a prompt's cost
    lines += [prefill_line(3000, 2, 1000 / (3 * G))]  # a partial chunk
    lines += [decode_line(300, queued=5, step_ms=90.0)]  # prefills in its interval
    lines += [decode_line(280, step_ms=60.0)]  # first line with nothing queued: left out
    lines += [decode_line(r) for r in (240, 200, 150)]
    lines += [
        decode_line(260, graph=False, step_ms=40.0),
        decode_line(120, step_ms=30.0),
    ]  # eager, then after it
    lines += [decode_line(r) for r in (90, 40, 12, 4)]  # 4: under min_running
    return "\n".join(lines)


def test_fit_recovers_the_costs_and_skips_contaminated_lines():
    text = burst_log()
    assert [r for r, _ in sm.decode_points(text)] == [240, 200, 150, 90, 40, 12]
    f = sm.fit(text, chunk=8192, max_decoding=64)
    assert f.a_ms == pytest.approx(A, rel=1e-3) and f.b_ms == pytest.approx(B, rel=1e-3)
    assert f.g_ms == pytest.approx(G, rel=1e-4) and f.prefill_points == 3


def test_model_identities():
    f = sm.Fit(A, B, G, 0, 0)
    p, o = 3000.0, 400.0
    for running in (10, 100, 500):
        assert f.tpot_ms(running, p, o) == pytest.approx(1000 * running / f.rate(running, p, o))  # Little
        assert f.running_for_tpot(f.tpot_ms(running, p, o), p, o) == pytest.approx(running)
    assert (
        f.rate(10, p, o) < f.rate(100, p, o) < f.rate(1e9, p, o) == pytest.approx(1000 * o / (p * G + o * B))
    )


def test_g_for_goal_is_the_boundary():
    ref = sm.Fit(5.0, 0.15, 0.024, 0, 0)
    mine = sm.Fit(5.0, 0.06, 0.031, 0, 0)
    p, o = 3072.0, 384.0
    rate, tpot = ref.rate(126, p, o), ref.tpot_ms(126, p, o)
    g = sm.g_for_goal(mine, rate, tpot, p, o, 1.1)
    for trial_g, meets in ((0.99 * g, True), (1.01 * g, False)):
        t = sm.Fit(mine.a_ms, mine.b_ms, trial_g, 0, 0)
        assert (t.rate(t.running_for_tpot(tpot, p, o), p, o) >= 1.1 * rate) is meets


# a part's bench_serving result: prompts of 3,000 tokens, outputs of 400
BENCH_RESULT = {
    "completed": 10,
    "total_input_tokens": 30000,
    "total_output_tokens": 4000,
    "output_throughput": 1000.0,
    "median_tpot_ms": 50.0,
    "median_ttft_ms": 1.0,
    "median_e2e_latency_ms": 2.0,
}


def test_cli_writes_a_rendered_result(tmp_path):
    from benchmarks.summary import renderer

    log = tmp_path / "server.log"
    log.write_text(burst_log())
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"runs": [{"result": BENCH_RESULT, "max_running_seen": 120}]}))
    out = tmp_path / "model.json"
    spec = f"{log},{part}"
    sm.main(["--engine", f"up={spec}", "--engine", f"wg={spec},8192", "--reference", "up", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["kind"] == "served_model"
    assert d["against_reference"]["wg"]["rate_at_reference_running"] == pytest.approx(1.0)
    assert any("running at TPOT parity" in line for line in renderer(d)(d))


def test_knee_holds_at_the_step_the_server_timed(tmp_path):
    """The knee's target is ``(1 + K) a`` with the ``a`` its server timed: the part's knee state, else
    ``--knee-step-ms``, else the fitted ``a``."""
    log = tmp_path / "server.log"
    log.write_text(burst_log())

    def against(run_extra: dict, *args: str) -> tuple[dict, sm.Fit]:
        up, wg = tmp_path / "up.json", tmp_path / "wg.json"
        up.write_text(json.dumps({"runs": [{"result": BENCH_RESULT, "max_running_seen": 8}]}))
        wg.write_text(json.dumps({"runs": [{"result": BENCH_RESULT, "max_running_seen": 8, **run_extra}]}))
        out = tmp_path / "model.json"
        sm.main(
            [
                "--engine",
                f"up={log},{up}",
                "--engine",
                f"wg={log},{wg}",
                "--reference",
                "up",
                *args,
                "--out",
                str(out),
            ]
        )
        d = json.loads(out.read_text())
        f = sm.Fit(**d["engines"][1]["fit"])
        return d["against_reference"]["wg"], f

    got, f = against({})
    assert got["knee_step_ms"] == pytest.approx(f.a_ms)
    for extra, args, step in (
        ({}, ("--knee-step-ms", "20"), 20.0),
        ({"wgkv": {"running_knee": {"fixed_step_ms": 30.0}}}, ("--knee-step-ms", "20"), 30.0),
    ):
        got, f = against(extra, *args)
        want = max(f.running_for_tpot(9 * step, 3000, 400), 8)
        assert got["knee_step_ms"] == step and got["running_at_knee"] == pytest.approx(want)
