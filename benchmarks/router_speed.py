"""Served throughput of several servers behind SGLang's router (issue 42) against one server: a
workload of ``benchmarks/served_speed.py`` (W3 by default) sent by ``sglang.bench_serving`` to
``python -m sglang_wgkv.launch_router --policy cache_aware`` in front of ``--workers`` servers.

Memory: each worker gets ``--max-total-tokens`` = ``--kv-tokens`` / workers, so the workers hold the
KV budget of one server between them (``--kv-tokens``: the one-server run's pool, e.g. upstream's
``max_total_num_tokens`` in ``benchmarks/results/serving/W3.json``; for WG-KV the cap is the dense
budget its capacity plan starts from). Workers that share a GPU (``--gpus 0,0``) start one after the
other, each measuring the memory the one before left; each holds its own copy of the weights.

    python -m benchmarks.router_speed run --server wgkv --workers 2 --gpus 0,0 --kv-tokens 218482 --out-dir $OUT
    python -m benchmarks.router_speed run --server upstream --workers 2 --gpus 0,0 --kv-tokens 218482 --out-dir $OUT

Writes ``part.router.<server>.<workers>x.<tag>.json``: bench_serving's JSON line, the commands and each
worker's capacity, to set beside ``python -m benchmarks.served_speed --server <server> --workloads W3``
run on the same machine (the one-server number).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import time
from pathlib import Path

from benchmarks import served_workloads as sw
from benchmarks.served_speed import (
    environment,
    gpu_total_mib,
    model_dir,
    run_bench,
    server_state,
    wait_gpu_idle,
)
from sglang_wgkv import launch_router
from sglang_wgkv.server_process import ServerProcess, free_port

ROUTER_POLICY = "cache_aware"


def worker_commands(a, ws: sw.WorkloadSet, config: str, model: Path, ports: list[int]) -> list[list[str]]:
    """One server command per worker: the workload's, with its share of the KV budget."""
    w = ws[a.workload]
    share = ["--max-total-tokens", str(a.kv_tokens // a.workers)] if a.kv_tokens else []
    total, extra = gpu_total_mib(), shlex.split(a.wgkv_extra)
    return [
        [*sw.server_command(ws, a.server, config, w, model, port, a.tp, gpu_total_mib=total), *extra, *share]
        for port in ports
    ]


def wait_router(url: str, workers: int, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            listed = requests.get(url + "/workers", timeout=10).json()["workers"]
            if sum(w["is_healthy"] for w in listed) == workers:
                return
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(2)
    raise TimeoutError(f"the router at {url} did not list {workers} healthy workers in {timeout_s:.0f} s")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # timeout's SIGTERM: unwind, so that `finally` stops the servers


def run(a) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ws = sw.load(Path(a.workloads_file))
    w = ws[a.workload]
    config = a.baseline if a.server == "upstream" else a.wgkv_config
    body = w.wgkv_request if a.server == "wgkv" else None
    if body:  # the router's typed /generate body has no custom_params (docs/scale-out.md)
        raise SystemExit(f"{w.name} sends custom_params.wgkv, which the router drops on /generate")
    model = model_dir(Path(a.model_dir))
    gpus = a.gpus.split(",") if a.gpus else []
    if gpus and len(gpus) != a.workers:
        raise SystemExit(f"--gpus lists {len(gpus)} GPUs for {a.workers} workers")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **w.env, **(sw.TP_ENV if a.tp > 1 else {})}
    if a.server == "upstream":
        env["SGLANG_PLUGINS"] = "none"
    ports = [free_port() for _ in range(a.workers)]
    commands = worker_commands(a, ws, config, model, ports)
    part = {
        "kind": "router_part",
        "server": a.server,
        "config": config,
        "workers": a.workers,
        "gpus": gpus,
        "kv_tokens": a.kv_tokens,
        "workload": w.name,
        "policy": ROUTER_POLICY,
        "environment": environment(),
        "worker_commands": [shlex.join(c) for c in commands],
    }
    part_file = out_dir / f"part.router.{a.server}.{a.workers}x.{a.tag}.json"
    workers: list[ServerProcess] = []
    router = None
    try:
        part["gpu_used_mib_before_start"] = wait_gpu_idle()
        for i, (cmd, port) in enumerate(zip(commands, ports)):
            worker_env = {**env, "CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else env
            srv = ServerProcess(
                cmd,
                out_dir / f"worker{i}.{a.server}.log",
                port=port,
                env=worker_env,
                cwd="/tmp",
                stop_timeout_s=60,
            )
            workers.append(srv)
            if gpus and gpus[i] in gpus[i + 1 :]:  # a later worker shares the GPU: it measures after this one
                srv.wait_healthy(a.startup_timeout, path="/health", probe_timeout_s=10)
        part["startup_s"] = [
            srv.wait_healthy(a.startup_timeout, path="/health", probe_timeout_s=10) for srv in workers
        ]
        router_port = free_port()
        rcmd = launch_router.command(
            router_port, [srv.url for srv in workers], "--policy", ROUTER_POLICY, "--log-level", "warn"
        )
        part["router_command"] = shlex.join(rcmd)
        router = ServerProcess(rcmd, out_dir / "router.log", port=router_port, env=env, cwd="/tmp")
        router.wait_healthy(300, path="/health", probe_timeout_s=10)
        wait_router(router.url, a.workers, 300)
        warm = sw.bench_command(w, router.url, out_dir / "warmup.jsonl", 7, None, sw.warmup_client(w))
        run_bench(warm, out_dir / "warmup.jsonl", a.bench_timeout)
        out_file = out_dir / f"bench.router.{a.server}.{a.workers}x.{w.name}.jsonl"
        timed = sw.bench_command(w, router.url, out_file, 1, None)
        part["bench_command"] = shlex.join(timed)
        part["result"] = run_bench(timed, out_file, max(a.bench_timeout, w.bench_timeout_s))
        part["worker_states"] = [server_state(srv.url) for srv in workers]
    except Exception as exc:  # recorded with whatever ran
        part["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    finally:
        if router is not None:
            router.stop()
        for srv in workers:
            srv.stop()
        part_file.write_text(json.dumps(part, indent=1))
    result = part.get("result", {})
    print(
        json.dumps(
            {
                "part": str(part_file),
                "error": part.get("error"),
                "output_tok_s": result.get("output_throughput"),
            }
        )
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--server", choices=("upstream", "wgkv"), required=True)
    r.add_argument("--workers", type=int, default=2)
    r.add_argument(
        "--gpus", default="", help="comma-separated CUDA_VISIBLE_DEVICES per worker (0,0: one GPU)"
    )
    r.add_argument(
        "--kv-tokens", type=int, default=0, help="the KV budget split between the workers (0: none)"
    )
    r.add_argument("--workload", default="W3")
    r.add_argument("--workloads-file", default=str(sw.WORKLOADS_JSON))
    r.add_argument("--baseline", default="fa3", help="upstream: a baseline of the workloads file")
    r.add_argument("--wgkv-config", default="bf16", help="wgkv: a configuration of the workloads file")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--wgkv-extra", default="")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--tag", default="a")
    r.add_argument("--model-dir", default="/tmp/served_speed_model")
    r.add_argument("--startup-timeout", type=float, default=480)
    r.add_argument("--bench-timeout", type=float, default=540)
    a = p.parse_args(argv)
    if a.workers < 1:
        raise SystemExit("--workers must be at least 1")
    run(a)


if __name__ == "__main__":
    main()
