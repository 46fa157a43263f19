"""Torch-profiler traces of a served workload's decode and prefill (``served_speed
--profile-dir``): an idle server's decode steps, one prefill, and decode steps under the workload's own
load; each returns :func:`benchmarks.trace_summary.summarize_dir` of its trace."""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.served_workloads import Workload, bench_command, bench_env

# ``--profile-host``: what SGLang's torch profiler records beside the GPU's kernels (``/start_profile``).
# Python stacks name each launch's frame but slow the host several times over, so a trace taken with
# them shows a host-bound GPU wherever the host's time matters (under load, a pass's start).
PROFILE_HOST = {
    "stack": {"activities": ["CPU", "GPU"], "with_stack": True},  # launches named by their frames
    "ops": {"activities": ["CPU", "GPU"], "with_stack": False},  # forwards, launches, host waits
    "gpu": {"activities": ["GPU"]},  # kernels alone: forwards cut at their last layer (``forwards``)
}


def start_body(a, trace_dir: Path, steps: int) -> dict:
    """``/start_profile``'s body: ``steps`` forward steps into ``trace_dir``, ``a.profile_host``'s events."""
    return {"output_dir": str(trace_dir), "num_steps": steps, **PROFILE_HOST[a.profile_host]}


def profile_decode(url: str, w: Workload, body: dict | None, a, trace_dir: Path) -> dict:
    """One streamed request of ``w``'s prompt length with ``--profile-steps`` x 4 output tokens; at its
    first token, SGLang's torch profiler records the next ``--profile-steps`` forward steps (decode
    only). Returns the trace summary (:mod:`trace_summary`) and the request's inter-token gaps."""
    import requests

    rng = random.Random(3)
    params = {"max_new_tokens": 4 * a.profile_steps, "temperature": 0.0, "ignore_eos": True}
    if body:
        params["custom_params"] = {"wgkv": body}
    req = {
        "input_ids": [rng.randrange(1000, 100000) for _ in range(w.client.input_len)],
        "stream": True,
        "sampling_params": params,
    }
    started, stamps = None, []
    with requests.post(url + "/generate", json=req, stream=True, timeout=a.bench_timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            if started is None:
                started = requests.post(
                    url + "/start_profile",
                    timeout=60,
                    json=start_body(a, trace_dir, a.profile_steps),
                ).text
    time.sleep(10)  # the trace is written after the last profiled step
    from benchmarks.trace_summary import summarize_dir

    gaps = sorted(b - a_ for a_, b in zip(stamps[1:], stamps[2:]))
    return {
        "start_profile": started,
        "profile_host": a.profile_host,
        "tokens": len(stamps),
        "median_gap_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
        **summarize_dir(str(trace_dir), a.profile_steps),
    }


def prefill_batch(input_len: int, chunk: int) -> tuple[int, int]:
    """(requests, forward steps) of the profiled prefill: one prompt of ``input_len`` over as many
    chunks as it takes, or, for prompts shorter than half a chunk, as many prompts as fill one chunk
    together (a served pass of prompt-heavy traffic: M1D's 8K passes hold two to four prompts)."""
    if chunk <= 0:
        return 1, 1
    n = max(1, chunk // input_len) if input_len > 0 else 1
    return n, -(-n * input_len // chunk)


def profile_prefill(url: str, w: Workload, body: dict | None, a, trace_dir: Path) -> dict:
    """The prefill of ``w``'s prompt length on an idle server (:func:`prefill_batch` prompts, sent in
    one ``/generate`` call so that one pass takes them together): SGLang's torch profiler is started
    for as many forward steps as they make (``chunked_prefill_size`` from ``/get_server_info``), then
    the request (one output token each) is sent. Returns the trace summary (:mod:`trace_summary`) with
    the request's wall time."""
    import requests

    info = requests.get(url + "/get_server_info", timeout=60).json()
    chunk = int(info.get("chunked_prefill_size") or w.client.input_len)
    prompts, steps = prefill_batch(w.client.input_len, chunk)
    started = requests.post(
        url + "/start_profile",
        timeout=60,
        json=start_body(a, trace_dir, steps),
    ).text
    rng = random.Random(4)
    params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    if body:
        params["custom_params"] = {"wgkv": body}
    ids = [[rng.randrange(1000, 100000) for _ in range(w.client.input_len)] for _ in range(prompts)]
    t0 = time.perf_counter()
    requests.post(
        url + "/generate",
        json={"input_ids": ids[0] if prompts == 1 else ids, "sampling_params": params},
        timeout=a.bench_timeout,
    ).raise_for_status()
    wall = time.perf_counter() - t0
    time.sleep(10)  # the trace is written after the last profiled step
    from benchmarks.trace_summary import summarize_dir

    return {
        "start_profile": started,
        "profile_host": a.profile_host,
        "chunk": chunk,
        "prompts": prompts,
        "steps": steps,
        "request_s": wall,
        **summarize_dir(str(trace_dir), steps),
    }


def batch_state(url: str) -> tuple[int, int]:
    """(running, waiting) requests of the server's first DP rank (SGLang's ``/v1/loads``)."""
    import requests

    load = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=60).json()["loads"][0]
    return int(load["num_running_reqs"]), int(load["num_waiting_reqs"])


def profile_under_load(url: str, w: Workload, body: dict | None, a, trace_dir: Path, out_dir: Path) -> dict:
    """The decode steps of a loaded server: ``w``'s own bench_serving run again (another seed), and
    once ``--profile-load-delay-s`` have passed and no request of it waits (the batch at its full size),
    SGLang's torch profiler records ``--profile-steps`` forward steps; then the run is stopped (its
    requests are aborted as their connections close) and the server waits to be idle. Returns the trace
    summary (:mod:`trace_summary`) and the running batch logged at the start. With
    ``--profile-load-waiting`` it profiles once the delay has passed even while requests wait (the
    steady state of prefill-heavy traffic: mixed forwards)."""
    import requests

    cmd = bench_command(w, url, out_dir / "profile_load.jsonl", 11, body)
    bench = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=bench_env(), start_new_session=True
    )
    try:
        # at least the delay, then until every request of the load runs (none waiting), at most 300 s more
        time.sleep(a.profile_load_delay_s)
        deadline, running, waiting = time.monotonic() + 300, None, None
        while bench.poll() is None and time.monotonic() < deadline:
            running, waiting = batch_state(url)
            if running and (not waiting or a.profile_load_waiting):
                break
            time.sleep(1)
        if bench.poll() is not None:
            return {
                "error": f"the load ended before the profile ({bench.returncode}): lower --profile-load-delay-s"
            }
        started = requests.post(
            url + "/start_profile",
            timeout=120,
            json=start_body(a, trace_dir, a.profile_steps),
        ).text
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(trace_dir.rglob("*.json*")):
            time.sleep(2)  # the trace is written after the last profiled step
        time.sleep(5)
    finally:
        os.killpg(bench.pid, signal.SIGTERM)
        bench.wait(timeout=60)
    deadline = time.monotonic() + a.profile_drain_timeout_s
    while time.monotonic() < deadline:  # the aborted requests leave before the next workload starts
        if batch_state(url) == (0, 0):
            break
        time.sleep(2)
    from benchmarks.trace_summary import summarize_dir

    return {
        "bench_command": shlex.join(cmd),
        "start_profile": started,
        "profile_host": a.profile_host,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        **summarize_dir(str(trace_dir), a.profile_steps),
    }
