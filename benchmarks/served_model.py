"""What a served burst costs each engine, fitted from its server log, and what the running batch
does to throughput and TPOT.

The model (one engine, one workload, first come first served, ``B`` requests running):

=====================  ==============================  ===============================================
quantity               formula                         fitted from
=====================  ==============================  ===============================================
decode step            ``a + b * B``                   decode lines with nothing queued, under CUDA
                                                       graphs (the drain at the end of a burst)
prompt token           ``g``                           prefill lines carrying a full chunk with few
                                                       requests decoding beside it
one request            ``P * g + O * (a / B + b)``     its prompt, and ``O`` steps shared by ``B``
output rate            ``X(B) = O / (P g + O (a/B + b))``
TPOT                   ``B / X(B) = a + B (b + P g / O)``  Little's law: ``B`` requests share ``X``
=====================  ==============================  ===============================================

``P`` and ``O`` are the mean prompt and output of the run (``bench_serving``'s totals). The rate
saturates at ``O / (P g + O b)`` (the prefill and each request's own decode share), TPOT grows
linearly in ``B``, so past the knee more running requests buy little throughput and cost TPOT in
proportion: on a prefill-heavy burst, the running batch is what sets TPOT.

    python -m benchmarks.served_model --engine upstream=DIR/server.upstream.log.gz,DIR/part.upstream.json \\
        --engine wgkv=DIR/server.t8192.log.gz,DIR/part.t8192.json --reference upstream \\
        --out benchmarks/results/serving/M1D_model.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

DECODE = re.compile(
    r"Decode batch, #running-req: (\d+), #token: (\d+),.*cuda graph: (\w+), "
    r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+)"
)
PREFILL = re.compile(
    r"Prefill batch, #new-seq: (\d+), #new-token: (\d+),.*#running-req: (\d+), #queue-req: (\d+),.*"
    r"input throughput \(token/s\): ([\d.]+)"
)


@dataclass(frozen=True)
class Fit:
    """One engine's costs on one machine and workload (milliseconds)."""

    a_ms: float  # fixed cost of a decode step (weights, launches)
    b_ms: float  # a decode step's cost per running request (its KV, its host work)
    g_ms: float  # a prompt token's prefill cost
    decode_points: int
    prefill_points: int

    def rate(self, running: float, prompt: float, output: float) -> float:
        """Output tokens/s with ``running`` requests at once."""
        return 1000 * output / (prompt * self.g_ms + output * (self.a_ms / running + self.b_ms))

    def tpot_ms(self, running: float, prompt: float, output: float) -> float:
        return self.a_ms + running * (self.b_ms + prompt * self.g_ms / output)

    def running_for_tpot(self, tpot_ms: float, prompt: float, output: float) -> float:
        """The most requests at once whose TPOT stays within ``tpot_ms``."""
        return max(0.0, (tpot_ms - self.a_ms) / (self.b_ms + prompt * self.g_ms / output))


def read_log(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        return f.read()


def decode_points(text: str, min_running: int = 8) -> list[tuple[int, float]]:
    """``(running, step ms)`` of the decode lines logged with nothing queued under CUDA graphs,
    leaving out the first such line after a queued or eager one (its interval still held prefills
    or eager steps)."""
    points, clean_before = [], False
    for m in DECODE.finditer(text):
        running, graph, tok_s, queued = int(m[1]), m[3] == "True", float(m[4]), int(m[5])
        clean = graph and not queued
        if clean and clean_before and running >= min_running and tok_s > 0:
            points.append((running, 1000 * running / tok_s))
        clean_before = clean
    return points


def prefill_points(text: str, chunk: int, max_decoding: int) -> list[float]:
    """Prompt tokens/s of the prefill lines carrying at least 95% of ``chunk`` while at most
    ``max_decoding`` requests decode beside them."""
    return [
        float(m[5])
        for m in PREFILL.finditer(text)
        if int(m[2]) >= 0.95 * chunk and int(m[3]) <= max_decoding and float(m[5]) > 0
    ]


def least_squares(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope of ``y = a + b x``."""
    if len(points) < 2:
        raise ValueError(f"need two decode points to fit a step, got {len(points)}")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx:
        raise ValueError("the decode points share one batch size: no slope")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def fit(text: str, chunk: int, max_decoding: int) -> Fit:
    dec = decode_points(text)
    a, b = least_squares(dec)
    pre = prefill_points(text, chunk, max_decoding)
    if not pre:
        raise ValueError(f"no prefill line of a full {chunk}-token chunk with <= {max_decoding} decoding")
    return Fit(a, b, 1000 / statistics.median(pre), len(dec), len(pre))


def run_record(part_path: str) -> dict:
    """The timed run of a ``served_speed`` part (its ``bench_serving`` result and the most running)."""
    part = json.loads(Path(part_path).read_text())
    (run,) = part["runs"]
    return run


def engine_report(name: str, log: str, part: str, chunk: int, max_decoding: int) -> dict:
    run = run_record(part)
    res = run["result"]
    prompt, output = (
        res["total_input_tokens"] / res["completed"],
        res["total_output_tokens"] / res["completed"],
    )
    f = fit(read_log(log), chunk, max_decoding)
    running = run.get("max_running_seen")
    knee_state = (run.get("wgkv") or {}).get("running_knee") or {}
    return {
        "engine": name,
        # the server's own timed decode step (running_knee.py), where its knee ran: its hold target
        "knee_step_ms": knee_state.get("fixed_step_ms"),
        "log": log,
        "part": part,
        "fit": asdict(f),
        "prompt_mean": prompt,
        "output_mean": output,
        "measured": {
            "output_tok_s": res["output_throughput"],
            "median_tpot_ms": res["median_tpot_ms"],
            "median_ttft_ms": res["median_ttft_ms"],
            "median_e2e_ms": res["median_e2e_latency_ms"],
            "max_running_seen": running,
        },
        "_fit": f,
    }


def compare(
    engines: list[dict],
    reference: str,
    running_grid: list[int],
    knee: float = 8.0,
    knee_step_ms: float | None = None,
) -> dict:
    """Each engine's predicted rate and TPOT over ``running_grid``, and against the reference engine
    at the reference's running batch: the running batch at TPOT parity and its rate there, and where
    ``--wgkv-running-knee knee`` would hold it (TPOT ``(1 + knee) a``; floored at the reference's count
    as the rule floors at a dense pool's). The rule's ``a`` is the step the server timed itself: the
    engine's ``knee_step_ms`` (its part's knee state), else ``knee_step_ms`` given, else the fitted
    ``a``."""
    ref = next(e for e in engines if e["engine"] == reference)
    ref_running = ref["measured"]["max_running_seen"]
    if not ref_running:
        raise ValueError(f"{reference}: its part records no max_running_seen")
    for e in engines:
        f, p, o = e["_fit"], e["prompt_mean"], e["output_mean"]
        e["predicted"] = [
            {"running": r, "output_tok_s": f.rate(r, p, o), "tpot_ms": f.tpot_ms(r, p, o)}
            for r in running_grid
        ]
    rf, p, o = ref["_fit"], ref["prompt_mean"], ref["output_mean"]
    ref_rate, ref_tpot = rf.rate(ref_running, p, o), rf.tpot_ms(ref_running, p, o)
    against = {}
    for e in engines:
        if e is ref:
            continue
        f = e["_fit"]
        parity = f.running_for_tpot(ref_tpot, p, o)
        against[e["engine"]] = {
            "reference_running": ref_running,
            "reference_rate_tok_s": ref_rate,
            "reference_tpot_ms": ref_tpot,
            "rate_at_reference_running": f.rate(ref_running, p, o) / ref_rate,
            "tpot_at_reference_running": f.tpot_ms(ref_running, p, o) / ref_tpot,
            "running_at_tpot_parity": parity,
            "rate_at_tpot_parity": f.rate(parity, p, o) / ref_rate if parity else 0.0,
            "rate_limit": f.rate(1e9, p, o) / ref_rate,
            # The prompt-token cost that would give 1.1x the reference's rate at its TPOT.
            "g_ms_for_1p1x_at_parity": g_for_goal(f, ref_rate, ref_tpot, p, o, 1.1),
        }
        step = e.get("knee_step_ms") or knee_step_ms or f.a_ms
        at_knee = max(f.running_for_tpot((1 + knee) * step, p, o), ref_running)
        against[e["engine"]].update(
            knee=knee,
            knee_step_ms=step,
            running_at_knee=at_knee,
            rate_at_knee=f.rate(at_knee, p, o) / ref_rate,
            tpot_at_knee=f.tpot_ms(at_knee, p, o) / ref_tpot,
        )
    return against


def g_for_goal(f: Fit, ref_rate: float, ref_tpot: float, prompt: float, output: float, goal: float) -> float:
    """The largest prompt-token cost ``g`` at which some running batch gives ``goal`` x the reference
    rate with TPOT at most the reference's (bisection: the rate at TPOT parity falls as ``g`` grows)."""
    lo, hi = 0.0, 10 * f.g_ms
    for _ in range(60):
        mid = (lo + hi) / 2
        trial = Fit(f.a_ms, f.b_ms, mid, 0, 0)
        r = trial.running_for_tpot(ref_tpot, prompt, output)
        ok = r > 0 and trial.rate(r, prompt, output) >= goal * ref_rate
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine", action="append", required=True, help="NAME=SERVER_LOG,PART_JSON (twice or more)"
    )
    ap.add_argument("--reference", required=True, help="the engine the others are compared with")
    ap.add_argument(
        "--chunk", type=int, default=8192, help="a full prefill chunk's tokens (engines without their own)"
    )
    ap.add_argument(
        "--max-decoding", type=int, default=64, help="prefill lines kept: at most this many decoding"
    )
    ap.add_argument("--running", default="32,64,96,128,160,192,256,384")
    ap.add_argument("--knee", type=float, default=8.0, help="the K of --wgkv-running-knee predicted")
    ap.add_argument(
        "--knee-step-ms",
        type=float,
        help="the decode step a server's knee timed (runs[].wgkv.running_knee.fixed_step_ms of another "
        "run on the machine) where an engine's own part has none; default: the fitted a",
    )
    ap.add_argument("--note", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    engines = []
    for spec in a.engine:
        name, _, paths = spec.partition("=")
        log, part, *chunk = paths.split(",")
        if not (name and log and part) or len(chunk) > 1 or (chunk and not chunk[0].isdigit()):
            ap.error(f"--engine {spec!r}: expected NAME=SERVER_LOG,PART_JSON[,CHUNK]")
        engines.append(engine_report(name, log, part, int(chunk[0]) if chunk else a.chunk, a.max_decoding))
    if a.reference not in {e["engine"] for e in engines}:
        ap.error(f"--reference {a.reference!r} names no --engine")
    against = compare(engines, a.reference, [int(x) for x in a.running.split(",")], a.knee, a.knee_step_ms)
    for e in engines:
        del e["_fit"]
    from benchmarks.common import write_json

    result = {
        "what": "decode step and prompt-token costs fitted from server logs; throughput and TPOT against "
        "the running batch",
        "note": a.note,
        "command": "python -m benchmarks.served_model " + shlex.join(sys.argv[1:] if argv is None else argv),
        "reference": a.reference,
        "engines": engines,
        "against_reference": against,
    }
    write_json(a.out, result, "served_model")
    print(json.dumps({"fits": {e["engine"]: e["fit"] for e in engines}, "against": against}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
