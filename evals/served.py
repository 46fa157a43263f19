"""RULER-style accuracy through the served engine: one server per configuration, greedy ``/generate``.

Each configuration is a ``python -m sglang_wgkv.launch_server`` process (started here, stopped after
its samples) with the configuration's WG-KV options on top of ``--server-args``:

=====================  ==============================================  ===========================
method                 options                                         what
=====================  ==============================================  ===========================
``full``               ``--disable-wgkv``                              dense SGLang, full cache
``wgkv_served``        (none)                                          admission alone
``snapkv_served``      ``--disable-wgkv --kv-budget N``                SnapKV alone (every token
                                                                       written, evicted to N)
``wgkv_snapkv_served`` ``--kv-budget N``                               admission + SnapKV
=====================  ==============================================  ===========================

``evals/data/ruler_2k_8k.json.gz``: 8 samples of each task at 2K, 4K and 8K tokens (``evals.ruler``,
seed 0, the held-out corpus of this machine as the NIAH haystack), stored because the haystack depends
on the machine. A sample (:mod:`evals.ruler`: token ids in the embedded model's chat format, ending with the answer
prefix) is sent as ``input_ids`` with ``max_new_tokens = len(answer)`` at temperature 0; it is correct
when the generated ids are exactly the answer's. ``kv_fraction`` is the request's
``mean_kv_tokens_per_head`` (ring + global tokens per layer and KV head at its end, from
``meta_info["wgkv"]``) over its cached tokens; 1 for ``full``.

Results: every sample's row in ``--out`` (an existing ``--out`` is resumed: its configurations are
kept and not run again); one row per (method, budget) merged into ``--summary``
(``benchmarks/results/accuracy/summary.json``: ``{"rows": [...]}``, rows of other methods kept), with
per-task accuracy, the full cache's on the same samples, and the ratio.

CLI::

    python -m evals.served --ruler evals/data/ruler_2k_8k.json.gz --methods full,snapkv_served,wgkv_snapkv_served --budgets 512,1024 \\
        --out served.json --summary benchmarks/results/accuracy/summary.json [--server-args "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

from evals.ruler import load_samples
from evals.summary import merge_summary
from sglang_wgkv.server_process import LAUNCHER, ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
METHOD_ARGS = {
    "full": ["--disable-wgkv"],
    "wgkv_served": [],
    "snapkv_served": ["--disable-wgkv"],
    "wgkv_snapkv_served": [],
}
BUDGETED = ("snapkv_served", "wgkv_snapkv_served")


@dataclass(frozen=True)
class Configuration:
    method: str
    budget: int | None

    def __post_init__(self):
        if self.method not in METHOD_ARGS:
            raise ValueError(f"method must be one of {sorted(METHOD_ARGS)}, got {self.method!r}")
        if (self.budget is not None) != (self.method in BUDGETED):
            raise ValueError(f"{self.method}: a budget is needed exactly for {BUDGETED}")

    def args(self) -> list[str]:
        extra = ["--kv-budget", str(self.budget)] if self.budget is not None else []
        return METHOD_ARGS[self.method] + extra


def start_server(args: list[str], log_path: Path, cwd: Path = REPO) -> ServerProcess:
    """A launcher process running checkout ``cwd``'s ``sglang_wgkv`` with ``args``."""
    port = free_port()
    # python -m puts the working directory first on sys.path: the server runs cwd's sglang_wgkv
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])}
    return ServerProcess([*LAUNCHER, "--port", str(port), *args], log_path, port=port, env=env, cwd=cwd)


def ask(url: str, sample: dict, timeout: float = 3600) -> dict:
    """One greedy ``/generate`` of ``sample``; its row (correct, kv_fraction, usage, seconds)."""
    answer = sample["answer"]
    t0 = time.monotonic()
    r = requests.post(
        url + "/generate",
        timeout=timeout,
        json={
            "input_ids": sample["prompt"],
            "sampling_params": {"max_new_tokens": len(answer), "temperature": 0},
        },
    )
    r.raise_for_status()
    out = r.json()
    meta = out["meta_info"]
    usage = next((u for u in reversed(meta.get("wgkv") or []) if u), None)
    cached = usage["cached_tokens"] if usage else meta["prompt_tokens"] + meta["completion_tokens"]
    kv = usage["mean_kv_tokens_per_head"] / cached if usage else 1.0
    return {
        "task": sample["task"],
        "length": sample["length"],
        "index": sample["index"],
        "correct": list(out["output_ids"][: len(answer)]) == list(answer),
        "output_ids": out["output_ids"],
        "kv_fraction": kv,
        "prompt_tokens": meta["prompt_tokens"],
        "usage": usage,
        "seconds": round(time.monotonic() - t0, 2),
    }


def run_configuration(
    config: Configuration,
    samples: list[dict],
    server_args: list[str],
    log_dir: Path,
    concurrency: int,
    startup_timeout: float,
    cwd: Path = REPO,
    log=print,
) -> dict:
    """Start the configuration's server (the ``sglang_wgkv`` of checkout ``cwd``), ask every sample
    (``concurrency`` at once), stop it."""
    name = config.method + (f"_{config.budget}" if config.budget is not None else "")
    server = start_server([*server_args, *config.args()], log_dir / f"{name}.log", cwd)
    t0 = time.monotonic()
    try:
        server.wait_healthy(startup_timeout)
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as ex:
            rows = list(ex.map(lambda s: ask(server.url, s), samples))
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    acc = sum(r["correct"] for r in rows) / len(rows)
    log(
        f"{name}: accuracy {acc:.3f} over {len(rows)} samples, {elapsed:.0f} s of requests "
        f"(start-up {started - t0:.0f} s)"
    )
    return {
        "method": config.method,
        "budget": config.budget,
        "command": shlex.join(server.command),
        "rows": rows,
        "seconds": round(elapsed, 1),
    }


def summary_rows(results: list[dict], engine: str) -> list[dict]:
    """One row per configuration: accuracy overall and per task, mean kv_fraction, and the full
    cache's accuracy on the same samples (when ``full`` ran)."""

    def by_task(rows):
        groups = defaultdict(list)
        for r in rows:
            groups[r["task"]].append(r["correct"])
        return {t: sum(v) / len(v) for t, v in sorted(groups.items())}

    full = next((res for res in results if res["method"] == "full"), None)
    out = []
    for res in results:
        rows = res["rows"]
        row = {
            "method": res["method"],
            "budget": res["budget"],
            "engine": engine,
            "n": len(rows),
            "lengths": sorted({r["length"] for r in rows}),
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "kv_fraction": sum(r["kv_fraction"] for r in rows) / len(rows),
            "tasks": by_task(rows),
            "lam": None,
            "command": res["command"],
        }
        if full is not None:
            full_acc = sum(r["correct"] for r in full["rows"]) / len(full["rows"])
            row.update(
                full_accuracy=full_acc,
                full_tasks=by_task(full["rows"]),
                accuracy_vs_full=row["accuracy"] / full_acc if full_acc else None,
            )
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ruler", required=True, help="samples from `python -m evals.ruler`")
    p.add_argument("--samples", type=int, default=None, help="at most this many per (task, length)")
    p.add_argument("--lengths", default=None, help="comma-separated lengths to keep (default: all)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks to keep (default: all)")
    p.add_argument("--methods", default="full,snapkv_served,wgkv_snapkv_served")
    p.add_argument("--budgets", default="512,1024")
    p.add_argument("--server-args", default="", help="SGLang arguments of every server")
    p.add_argument(
        "--wgkv-args",
        default="",
        help="arguments of the WG-KV servers only (not full, not "
        "snapkv_served, which takes no WG-KV option but --kv-budget)",
    )
    p.add_argument(
        "--full-args",
        default="",
        help="arguments of the full-cache server only (e.g. --attention-backend flashinfer on a GPU)",
    )
    p.add_argument("--engine", default="cpu", help="label of the summary rows (cpu, h200, ...)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument(
        "--checkout",
        default=str(REPO),
        help="checkout whose sglang_wgkv the servers run (e.g. an older one, for a before/after comparison)",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--summary", default=None)
    a = p.parse_args(argv)
    command = shlex.join(["python", "-m", "evals.served", *(sys.argv[1:] if argv is None else argv)])
    # a terminated run still stops its server (in its own session): SIGTERM unwinds through finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    samples = load_samples(a.ruler, a.samples, a.lengths, a.tasks)
    configs = []
    for method in a.methods.split(","):
        budgets = [int(b) for b in a.budgets.split(",")] if method in BUDGETED else [None]
        configs += [Configuration(method, b) for b in budgets]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.with_suffix(".logs")
    log_dir.mkdir(exist_ok=True)
    # an existing --out of the same set resumes: configurations already there are not run again
    results = json.loads(out.read_text())["results"] if out.exists() else []
    done = {(r["method"], r["budget"]) for r in results}
    for config in configs:
        if (config.method, config.budget) in done:
            continue
        own = {"full": a.full_args, "snapkv_served": ""}.get(config.method, a.wgkv_args)
        results.append(
            run_configuration(
                config,
                samples,
                shlex.split(a.server_args) + shlex.split(own),
                log_dir,
                a.concurrency,
                a.startup_timeout,
                Path(a.checkout),
            )
        )
        out.write_text(
            json.dumps(
                {"command": command, "ruler": a.ruler, "engine": a.engine, "results": results}, indent=1
            )
            + "\n"
        )
    rows = summary_rows(results, a.engine)
    if a.summary:
        merge_summary(Path(a.summary), rows)
    for r in rows:
        print(
            json.dumps(
                {k: r[k] for k in ("method", "budget", "n", "accuracy", "kv_fraction")}
                | {"vs_full": r.get("accuracy_vs_full")}
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
