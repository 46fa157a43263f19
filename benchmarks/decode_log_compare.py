"""Two runs of one served workload compared through their SGLang server logs: the scheduler's decode
lines (``Decode batch, #running-req: R, #token: T, ... gen throughput (token/s): G``, one per
``--decode-log-interval`` steps) matched by running requests and token count.

For a run cut before ``bench_serving`` wrote its result (a step's time limit), the decode
lines are what is left: same workload and seed, so the intervals of the two runs cover the same
tokens. Intervals under ``--stall`` of their run's median (a compile, an eviction wave) are listed
but left out of the summary.

    python -m benchmarks.decode_log_compare --before A/server.wgkv.W4.log --after B/server.wgkv.W4.log \\
        --label-before e14be5e~1 --label-after e14be5e --out benchmarks/results/serving/W4_decode_log.json
"""

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

from benchmarks.common import write_json

LINE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+),.*gen throughput \(token/s\): ([\d.]+)")


def decode_runs(text: str) -> list[list[tuple[int, int, float]]]:
    """``(running, tokens, tok/s)`` per decode line, split into runs where the token count drops."""
    runs, cur = [], []
    for line in text.splitlines():
        m = LINE.search(line)
        if not m:
            continue
        row = (int(m[1]), int(m[2]), float(m[3]))
        if cur and row[1] < cur[-1][1]:
            runs.append(cur)
            cur = []
        cur.append(row)
    if cur:
        runs.append(cur)
    return runs


def first_long_run(text: str, min_lines: int) -> list[tuple[int, int, float]]:
    runs = [r for r in decode_runs(text) if len(r) >= min_lines]
    if not runs:
        raise ValueError(f"no run of at least {min_lines} decode lines")
    return runs[0]


def compare(before: list, after: list, stall: float) -> dict:
    b = {(r, t): g for r, t, g in before}
    pairs = [{"running": r, "tokens": t, "before": b[r, t], "after": g} for r, t, g in after if (r, t) in b]
    if not pairs:
        raise ValueError("the runs share no (running, tokens) interval")
    med_b = statistics.median(p["before"] for p in pairs)
    med_a = statistics.median(p["after"] for p in pairs)
    for p in pairs:
        p["ratio"] = p["after"] / p["before"] if p["before"] else None
        p["stall"] = p["before"] < stall * med_b or p["after"] < stall * med_a
    kept = [p for p in pairs if not p["stall"]]
    ratios = [p["ratio"] for p in kept]
    return {
        "matched_intervals": pairs,
        "summary": {
            "intervals": len(pairs),
            "kept": len(kept),
            "stalls": len(pairs) - len(kept),
            "before_median_tok_s": med_b,
            "after_median_tok_s": med_a,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "before_mean_tok_s": statistics.fmean(p["before"] for p in kept),
            "after_mean_tok_s": statistics.fmean(p["after"] for p in kept),
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--label-before", required=True)
    p.add_argument("--label-after", required=True)
    p.add_argument("--min-lines", type=int, default=20, help="a run's decode lines (shorter runs: warm-ups)")
    p.add_argument("--stall", type=float, default=0.5)
    p.add_argument("--note", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    before = first_long_run(Path(a.before).read_text(errors="replace"), a.min_lines)
    after = first_long_run(Path(a.after).read_text(errors="replace"), a.min_lines)
    result = {
        "what": "decode throughput of two server runs of one workload, interval by interval",
        "before": a.label_before,
        "after": a.label_after,
        "note": a.note,
        "command": "python -m benchmarks.decode_log_compare "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        **compare(before, after, a.stall),
    }
    write_json(a.out, result, "decode_log")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
