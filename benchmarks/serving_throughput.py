"""Serving throughput: WG-KV against upstream SGLang dense attention at the same memory fraction.

For each ``--server`` in turn: start it (``python -m sglang.launch_server --attention-backend X`` for
``upstream``, ``python -m sglang_wgkv.launch_server`` with ``--wgkv-args`` for ``wgkv``), wait for
``/health`` in a loop, read its capacity (``max_total_num_tokens``, effective ``max_running_requests``),
send a warm-up request, then ``--num-requests`` streaming ``/generate`` requests at once, each
``--prompt-tokens`` random token ids (``input_ids``: works with ``--skip-tokenizer-init``) and
``--output-tokens`` greedy tokens with EOS ignored; record output tokens/s over the whole run, TTFT
and TPOT per request (p50/p99), and the most requests seen running at once (the largest
``#running-req`` of the server's batch log lines; WG-KV also reports ``wgkv.peak_active_requests``,
requests holding a slot, prefilling ones included). Then stop it.

    # H200, one device call per server (each writes a part), then merge here
    python benchmarks/serving_throughput.py --server upstream --part-out $OUT/serving_throughput.upstream.json
    python benchmarks/serving_throughput.py --server wgkv --part-out $OUT/serving_throughput.wgkv.json
    python benchmarks/serving_throughput.py --merge A.json B.json --out benchmarks/results/serving/serving_throughput.json

``--out`` (without ``--merge``) runs all servers and writes the merged JSON and its PNG directly.
Defaults: the Llama-3.1-8B configuration in ``launch/configs/llama-3.1-8b`` with dummy weights,
32 x (32768 + 256) tokens, the Triton backend for upstream (no FlashInfer JIT on a cold machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "launch" / "configs" / "llama-3.1-8b"
GPU_COMMON = ("--load-format dummy --skip-tokenizer-init --disable-radix-cache --context-length 34816 "
              "--max-running-requests 64 --disable-prefill-cuda-graph --cuda-graph-max-bs-decode 32 "
              "--sampling-backend pytorch")
GPU_WGKV = "--kv-budget 4096 --wgkv-random-admission 0.3"


def environment() -> dict:
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "host": platform.node()}
    for mod in ("torch", "sglang", "triton", "flashinfer"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal
            env[mod] = f"unavailable: {exc!r}"
    try:
        import torch

        env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        env["cuda"] = torch.version.cuda
    except Exception:
        env["gpu"] = None
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(a, server: str, port: int) -> list[str]:
    common = ["--model-path", str(a.model_path), "--mem-fraction-static", str(a.mem_fraction_static),
              "--port", str(port), *shlex.split(a.common_args)]
    if server == "upstream":
        return [sys.executable, "-m", "sglang.launch_server", "--attention-backend", a.upstream_backend, *common]
    if server == "wgkv":
        return [sys.executable, "-m", "sglang_wgkv.launch_server", *common, *shlex.split(a.wgkv_args)]
    raise ValueError(f"unknown server {server!r} (upstream, wgkv)")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def stream_one(url: str, ids: list[int], out_tokens: int, start: threading.Event) -> dict:
    """One streaming /generate request: arrival time and token count of every chunk."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0, "ignore_eos": True}}
    start.wait()
    t0 = time.perf_counter()
    events, meta = [], {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            meta = json.loads(line[len("data:"):])["meta_info"]
            events.append((time.perf_counter() - t0, meta["completion_tokens"]))
    return {"t_start": t0, "events": events, "completion_tokens": meta.get("completion_tokens", 0),
            "prompt_tokens": meta.get("prompt_tokens")}


def request_metrics(res: dict) -> dict:
    ev = [e for e in res["events"] if e[1] > 0]
    ttft = ev[0][0] if ev else None
    n = res["completion_tokens"]
    tpot = (ev[-1][0] - ev[0][0]) / (n - 1) if ev and n > 1 else None
    return {"ttft_s": ttft, "tpot_s": tpot, "completion_tokens": n, "e2e_s": ev[-1][0] if ev else None}


def max_running_in_log(text: str) -> int | None:
    counts = [int(m) for m in re.findall(r"#running-req: (\d+)", text)]
    return max(counts) if counts else None


def run_server(a, server: str, log_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(a, server, port)
    log_path = log_dir / f"serving_throughput.{server}.log"
    log = open(log_path, "w")
    t_launch = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=a.server_cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result = {"server": server, "command": shlex.join(cmd), "log": str(log_path)}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{server} exited with {proc.returncode}; log {log_path}:\n"
                                   + "\n".join(log_path.read_text(errors="replace").splitlines()[-40:]))
            if time.perf_counter() - t_launch > a.startup_timeout:
                raise TimeoutError(f"{server} not healthy after {a.startup_timeout} s; log {log_path}")
            try:
                if requests.get(url + "/health", timeout=10).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        rng = random.Random(a.seed)
        warm = requests.post(url + "/generate", timeout=1800, json={  # compiles kernels before timing
            "input_ids": [rng.randrange(100, a.vocab_hi) for _ in range(min(a.prompt_tokens, 8192))],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
        warm.raise_for_status()
        result["startup_s"] = time.perf_counter() - t_launch
        info = requests.get(url + "/server_info", timeout=60).json()
        state = info["internal_states"][0]
        result["max_total_num_tokens"] = info["max_total_num_tokens"]
        result["max_running_requests"] = state.get("effective_max_running_requests_per_dp")
        prompts = [[rng.randrange(100, a.vocab_hi) for _ in range(a.prompt_tokens)] for _ in range(a.num_requests)]
        start = threading.Event()
        with cf.ThreadPoolExecutor(a.num_requests) as ex:
            futs = [ex.submit(stream_one, url, p, a.output_tokens, start) for p in prompts]
            t0 = time.perf_counter()
            start.set()
            outs = [f.result() for f in futs]
        wall = time.perf_counter() - t0
        per = [request_metrics(o) for o in outs]
        out_tokens = sum(p["completion_tokens"] for p in per)
        ttft = [p["ttft_s"] for p in per if p["ttft_s"] is not None]
        tpot = [p["tpot_s"] for p in per if p["tpot_s"] is not None]
        result.update(
            wall_s=wall, output_tokens=out_tokens, output_tok_s=out_tokens / wall,
            total_tok_s=(out_tokens + sum(o["prompt_tokens"] or 0 for o in outs)) / wall,
            ttft_p50_s=percentile(ttft, 0.5), ttft_p99_s=percentile(ttft, 0.99),
            tpot_p50_s=percentile(tpot, 0.5), tpot_p99_s=percentile(tpot, 0.99),
            all_finished=all(p["completion_tokens"] == a.output_tokens for p in per), requests=per)
        info = requests.get(url + "/server_info", timeout=60).json()
        wgkv = info["internal_states"][0].get("wgkv")
        if wgkv is not None:
            result["wgkv"] = {k: v for k, v in wgkv.items() if not k.endswith("per_layer_head")}
        result["max_running_seen"] = max_running_in_log(log_path.read_text(errors="replace"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    return result


SUMMARY_KEYS = ("max_total_num_tokens", "max_running_requests", "max_running_seen", "output_tok_s",
                "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "wall_s", "startup_s", "all_finished")


def merge(parts: list[dict], label: str | None) -> dict:
    runs = {r["server"]: r for p in parts for r in p["runs"]}
    first = parts[0]
    for p in parts[1:]:
        if p["workload"] != first["workload"]:
            raise ValueError(f"parts ran different workloads: {p['workload']} vs {first['workload']}")
    merged = {"label": label or first.get("label"), "workload": first["workload"],
              "environment": [p["environment"] for p in parts],
              "bench_commands": [p.get("bench_command") for p in parts], "runs": runs,
              "summary": {s: {**{k: r.get(k) for k in SUMMARY_KEYS},
                              "wgkv_peak_active_requests": (r.get("wgkv") or {}).get("peak_active_requests")}
                          for s, r in runs.items()}}
    if "upstream" in runs and "wgkv" in runs and runs["upstream"].get("output_tok_s"):
        merged["wgkv_over_upstream_output_tok_s"] = runs["wgkv"]["output_tok_s"] / runs["upstream"]["output_tok_s"]
    return merged


def plot(merged: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(merged["runs"])
    s = merged["summary"]
    panels = (("output tokens/s", ["output_tok_s"]), ("requests running at once", ["max_running_seen"]),
              ("TTFT (s)", ["ttft_p50_s", "ttft_p99_s"]), ("TPOT (ms)", ["tpot_p50_s", "tpot_p99_s"]))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (title, keys) in zip(axes, panels):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            vals = [(s[x].get(key) or 0) * (1000 if title.startswith("TPOT") else 1) for x in servers]
            bars = ax.bar([i + j * width for i in range(len(servers))], vals, width,
                          label=key.split("_")[1] if len(keys) > 1 else None)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(servers))], servers)
        ax.set_title(title, fontsize=9)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    w = merged["workload"]
    fig.suptitle(f"{merged.get('label') or 'serving throughput'}: {w['num_requests']} x ({w['prompt_tokens']} prompt + "
                 f"{w['output_tokens']} output) tokens, mem fraction {w['mem_fraction_static']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def write(path: str, obj: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", choices=("upstream", "wgkv"),
                   help="server(s) to run, in order (default: upstream then wgkv)")
    p.add_argument("--model-path", default=str(DEFAULT_MODEL))
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--upstream-backend", default="triton")
    p.add_argument("--common-args", default=GPU_COMMON, help="SGLang arguments given to every server")
    p.add_argument("--wgkv-args", default=GPU_WGKV, help="extra arguments of the WG-KV server")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--vocab-hi", type=int, default=120000, help="prompt token ids are drawn from [100, this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=420)
    p.add_argument("--server-cwd", default="/tmp", help="servers start here (not from a folder that shadows "
                                                         "the package)")
    p.add_argument("--label", default=None)
    p.add_argument("--part-out", default=None, help="write this run's part (for --merge)")
    p.add_argument("--out", default=None, help="merged JSON (its PNG next to it)")
    p.add_argument("--log-dir", default="/tmp/wgkv_serving_logs",
                   help="server logs (kept out of benchmarks/results/)")
    p.add_argument("--merge", nargs="+", default=None, help="merge these part files into --out")
    a = p.parse_args(argv)
    if a.merge:
        merged = merge([json.loads(Path(f).read_text()) for f in a.merge], a.label)
        merged["merge_command"] = shlex.join([Path(sys.executable).name, *sys.argv])
    else:
        env = environment()
        workload = {k: getattr(a, k) for k in ("num_requests", "prompt_tokens", "output_tokens",
                                               "mem_fraction_static", "model_path", "seed")}
        log_dir = Path(a.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        runs = []
        for server in a.server or ["upstream", "wgkv"]:
            try:
                runs.append(run_server(a, server, log_dir))
            except Exception as exc:  # recorded in the part (with its log beside it); the next server runs
                runs.append({"server": server, "error": f"{type(exc).__name__}: {exc}"[-4000:]})
        part = {"label": a.label, "workload": workload, "environment": env,
                "bench_command": shlex.join([Path(sys.executable).name, *sys.argv]), "runs": runs}
        for r in runs:
            print(json.dumps({"server": r["server"], "error": r.get("error"),
                              **{k: r.get(k) for k in SUMMARY_KEYS}}), flush=True)
        if a.part_out:
            write(a.part_out, part)
        if not a.out:
            return
        merged = merge([part], a.label)
    if not a.out:
        raise SystemExit("--merge needs --out")
    write(a.out, merged)
    plot(merged, str(Path(a.out).with_suffix(".png")))
    print(json.dumps(merged["summary"], indent=1))


if __name__ == "__main__":
    main()
