"""The CPU server's dtype: the embedded model's linear layers per dtype, then the README's serve command
served in float16 (what SGLang's ``auto`` picks for the float32 checkpoint) and in float32 (the
launcher's default on a CPU without half-precision matmul units, ``launch_server.cpu_half_matmul``),
each through ``benchmarks/serving_memory.py``'s phases (frontend program, chat, streaming, one long
prompt): seconds per phase, start-up, peak RSS, KV budget.

    python -m benchmarks.cpu_dtype [--long-tokens 1100] [--out benchmarks/results/serving/cpu_dtype_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_json
from benchmarks.serving_memory import measure
from sglang_wgkv.launch_server import cpu_half_matmul

DTYPES = ("float16", "bfloat16", "float32")


def linear_ms(rows: int, shapes, dtype: torch.dtype, reps: int = 5) -> float:
    """Milliseconds of one pass over ``shapes`` (``(in, out)`` linear layers) at ``rows`` tokens."""
    layers = [(torch.randn(rows, i).to(dtype), torch.randn(o, i).to(dtype)) for i, o in shapes]
    for x, w in layers:
        torch.nn.functional.linear(x, w)
    t = time.perf_counter()
    for _ in range(reps):
        for x, w in layers:
            torch.nn.functional.linear(x, w)
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1100, help="tokens of the linear-layer timing")
    ap.add_argument("--long-tokens", type=int, default=1100)
    ap.add_argument("--no-serve", action="store_true", help="the linear layers only")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "serving" / "cpu_dtype_ab.json")
    )
    a = ap.parse_args()
    # one layer of the embedded model (SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536)
    shapes = [(576, 576 + 2 * 192), (576, 576), (576, 2 * 1536), (1536, 576)]
    linear = {name: round(linear_ms(a.rows, shapes, getattr(torch, name)), 2) for name in DTYPES}
    print(json.dumps({"linear_ms_per_layer": linear}), flush=True)
    served = {}
    if not a.no_serve:
        for name in ("float16", "float32"):
            result = measure(
                ["--dtype", name], f"readme_cpu_{name}", Path(f"/tmp/cpu_dtype_{name}.log"), 1, a.long_tokens
            )
            served[name] = {
                "command": result["command"],
                "survived": result["survived"],
                "startup_s": result.get("startup_s"),
                "phase_s": {k: v.get("seconds") for k, v in result["phases"].items() if k != "startup"},
                "phases_ok": all(v.get("ok", True) for v in result["phases"].values()),
                "peak_rss_bytes": result["peak_rss_bytes"],
                "kv_tokens": result.get("server", {}).get("max_total_num_tokens"),
            }
            print(json.dumps({name: served[name]}), flush=True)
    write_json(
        a.out,
        {
            "env": environment(),
            "command": " ".join(["python -m benchmarks.cpu_dtype", *sys.argv[1:]]),
            "cpus": os.cpu_count(),
            "cpu_half_matmul": cpu_half_matmul(),
            "rows": a.rows,
            "linear_ms_per_layer": linear,
            "served": served,
        },
        "cpu_dtype",
    )


if __name__ == "__main__":
    main()
