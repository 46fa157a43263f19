"""Shared helpers for the GPU benchmarks: environment record, JSON output, CUDA-event timing."""

import datetime
import json
import os
import platform
import sys
import time

import torch


def environment() -> dict:
    """What produced a result: command, GPU, library versions, time."""
    env = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for mod in ("triton", "flashinfer"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal: the benchmark says what it could not import
            env[mod] = f"unavailable: {exc!r}"
    return env


def write_json(path: str, obj: dict, kind: str) -> None:
    """``obj`` as JSON at ``path`` (atomically), first field ``kind`` (benchmarks.summary's renderer)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"kind": kind, **obj}, f, indent=1)
    os.replace(tmp, path)


def cuda_ms(fn, reps: int = 3, warmup: int = 1) -> list:
    """Wall time of ``fn()`` on the current stream in milliseconds, one entry per rep."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """Run ``fn()`` once on a side stream (warm-up: compiles, allocator pools), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class Deadline:
    """Skip work that would not finish inside the run's time limit (results so far are kept)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()
