"""A burst through the running knee's own code on a simulated clock (``sglang_wgkv/testing/knee_burst.py``),
at served costs: WG-KV with each ``K`` (and none), prefill-only and mixed passes, against an upstream-like
pool capped at its running count with upstream's costs; the overlap scheduler's late launches on.

python -m benchmarks.knee_sim [--a MS --b MS --g US --upstream-a MS --upstream-b MS --upstream-g US
                               --prompt N --out N --prompts N --dense N --upstream-cap N --k K ...] [--out-file PATH]

The defaults are M1D's on one H100 (``serving/M1D_model_knee8.json``'s fit of both engines' logs, ``a``
as the served knee timed it, the dense count of WG-KV's pool as the knee computes it: the plan's 397,120
tokens over a request's prompt and half its outputs, 3,264; upstream's 127 running). The simulation under-predicts both engines' real
median TPOT by about 1.2x (upstream 36.9 against 45.3 ms measured): compare its rows with each other.
"""

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import environment, write_json
from sglang_wgkv.testing.knee_burst import Burst, run_burst


def row(label: str, burst: Burst) -> dict:
    got = run_burst(burst)
    out = {
        "variant": label,
        "knee_k": burst.knee_k,
        "mixed": burst.mixed,
        "output_tok_s": round(got.output_tok_s, 1),
        "median_tpot_ms": round(1000 * got.median_tpot_s, 2),
        "median_ttft_s": round(got.median_ttft_s, 2),
        "max_running": got.max_running,
        "target_ms": None if got.target_s is None else round(1000 * got.target_s, 2),
        "held_passes": got.held_passes,
    }
    print(out, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=float, default=4.42, help="WG-KV's fixed step cost, ms")
    ap.add_argument("--b", type=float, default=0.063, help="WG-KV's cost per running request a step, ms")
    ap.add_argument("--g", type=float, default=29.2, help="WG-KV's cost per prompt token, us")
    ap.add_argument("--upstream-a", type=float, default=5.07)
    ap.add_argument("--upstream-b", type=float, default=0.158)
    ap.add_argument("--upstream-g", type=float, default=23.5)
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--out", type=int, default=384)
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--dense", type=int, default=122, help="requests WG-KV's pool would run densely")
    ap.add_argument("--upstream-cap", type=int, default=127, help="requests upstream's pool runs")
    ap.add_argument("--k", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument(
        "--out-file", default=str(Path(__file__).parent / "results" / "serving" / "knee_sim.json")
    )
    a = ap.parse_args()
    shape = {"prompt": a.prompt, "out": a.out, "prompts": a.prompts, "overlap": True}
    ours = {"a": a.a / 1e3, "b": a.b / 1e3, "g": a.g / 1e6, "dense": a.dense, **shape}
    upstream = Burst(
        a=a.upstream_a / 1e3,
        b=a.upstream_b / 1e3,
        g=a.upstream_g / 1e6,
        dense=a.upstream_cap,
        knee_k=None,
        cap=a.upstream_cap,
        **shape,
    )
    rows = [row("upstream-like (its pool's count, prefill-only)", upstream)]
    for mixed in (False, True):
        for k in a.k:
            rows.append(row(f"WG-KV K={k:g}", Burst(**ours, knee_k=k, mixed=mixed)))
        rows.append(row("WG-KV without the knee", Burst(**ours, knee_k=None, mixed=mixed)))
    write_json(
        a.out_file,
        {
            "env": environment(),
            "command": "python " + " ".join(sys.argv),
            "bursts": {"wgkv": ours, "upstream": {k: v for k, v in asdict(upstream).items()}},
            "rows": rows,
            "note": "a simulation on the host clock; compare rows with each other, not with served runs",
        },
        "knee_sim",
    )


if __name__ == "__main__":
    main()
