"""Peak memory of a server (the whole process tree's RSS; on a GPU host also the GPU's used memory)
under a mixed workload, against RAM and the GPU's memory.

Starts ``python -m sglang_wgkv.launch_server`` with the given arguments only (the launcher's defaults
otherwise: embedded model, CPU, default KV budget), samples the RSS of the launcher and every process
it spawned every 0.2 s, and runs, phase by phase: an SGLang frontend program (``sgl.gen`` then
``sgl.select``, ``fork``, ``run_batch``), OpenAI chat, streaming ``/generate``, and a few prompts of
about 6K tokens. Writes a JSON (peak RSS overall and per phase, MemTotal, MemAvailable at start and
its minimum, the server's KV budget and request slots, whether it survived) and keeps the server log
outside the results. With ``nvidia-smi`` on the PATH it also samples the used memory of GPU 0 (the
whole device: run nothing else on it), peak overall and per phase, against the device's total.

    python -m benchmarks.serving_memory --label wgkv_default --out benchmarks/results/serving
    python -m benchmarks.serving_memory --label upstream_default --out benchmarks/results/serving -- --disable-wgkv
    # the H200 kit (no FA3): upstream's baseline there
    python -m benchmarks.serving_memory --label upstream_h200 -- --disable-wgkv --attention-backend flashinfer
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import psutil
import requests

from sglang_wgkv.server_process import LAUNCHER, ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]


def gpu_memory() -> tuple[int, int] | None:
    """``(used, total)`` bytes of GPU 0 from ``nvidia-smi``, or None (no NVIDIA GPU or tool)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "-i",
                "0",
                "--query-gpu=memory.used,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        used, total = (int(x) << 20 for x in out.stdout.strip().split(","))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return used, total


class TreeSampler(threading.Thread):
    """Samples the summed RSS of a process and its descendants, the system's MemAvailable and, where
    ``gpu_memory`` answers, the GPU's used memory."""

    def __init__(self, pid: int, period: float = 0.2):
        super().__init__(daemon=True)
        self.root, self.period = psutil.Process(pid), period
        self.peak = self.phase_peak = 0
        self.gpu = gpu_memory() is not None
        self.gpu_peak = self.gpu_phase_peak = 0
        self.min_available = psutil.virtual_memory().available
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        # A sample counts towards the phase it started in: one taken across take_phase (nvidia-smi can
        # take a while on a loaded host) is not credited to the next phase.
        self._lock = threading.Lock()
        self._phase = 0

    def rss(self) -> int:
        total = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def run(self):
        t0 = time.monotonic()
        while not self._stop.is_set():
            phase = self._phase
            rss = self.rss()
            available = psutil.virtual_memory().available
            gpu = gpu_memory() if self.gpu else None
            with self._lock:
                self.peak = max(self.peak, rss)
                self.min_available = min(self.min_available, available)
                self.samples.append((round(time.monotonic() - t0, 2), rss))
                if gpu is not None:
                    self.gpu_peak = max(self.gpu_peak, gpu[0])
                if phase == self._phase:
                    self.phase_peak = max(self.phase_peak, rss)
                    if gpu is not None:
                        self.gpu_phase_peak = max(self.gpu_phase_peak, gpu[0])
            time.sleep(self.period)

    def take_phase(self) -> dict:
        """Peaks since the last phase: ``peak_rss_bytes`` (and ``peak_gpu_used_bytes`` on a GPU host)."""
        rss = self.rss()
        with self._lock:
            peak, self.phase_peak = self.phase_peak, rss
            out = {"peak_rss_bytes": peak}
            if self.gpu:
                out["peak_gpu_used_bytes"], self.gpu_phase_peak = self.gpu_phase_peak, 0
            self._phase += 1
        return out

    def stop(self):
        self._stop.set()


def _long_prompt(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of list-like text (about 12 tokens per item)."""
    colors, things = ["red", "blue", "green", "old", "new"], ["car", "house", "tree", "river", "book"]
    items = [
        f"Item {i}: the {colors[(i + seed) % 5]} {things[(3 * i + seed) % 5]} number {(7 * i + seed) % 13}."
        for i in range(tokens // 12)
    ]
    return " ".join(items) + " Which item mentions a river first?"


def frontend_program(url: str) -> dict:
    import sglang as sgl

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))

    @sgl.function
    def yes_no(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))
        s += sgl.user("Is that answer correct? Say yes or no.")
        s += sgl.assistant(sgl.select("yn", choices=["yes", "no"]))

    @sgl.function
    def forked(s, topic):
        s += "Three facts about " + topic + ":\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=12, temperature=0, stop="\n")
        forks.join()
        s += "Summary:" + sgl.gen("summary", max_tokens=12, temperature=0)

    one = yes_no.run(question="What is the capital of France?")
    fork = forked.run(topic="rivers")
    batch = yes_no.run_batch([{"question": f"What is {a} plus {a}?"} for a in range(2, 10)])
    return {
        "answer": one["answer"],
        "select": one["yn"],
        "fork_summary": fork["summary"],
        "batch_answers": [b["yn"] for b in batch],
    }


def chat(url: str) -> None:
    r = requests.post(
        url + "/v1/chat/completions",
        timeout=600,
        json={
            "model": "default",
            "max_tokens": 32,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
        },
    )
    r.raise_for_status()


def stream(url: str, max_new_tokens: int = 48) -> None:
    body = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass


def long_prompts(url: str, n: int, tokens: int) -> list[int]:
    out = []
    for i in range(n):
        r = requests.post(
            url + "/generate",
            timeout=1800,
            json={
                "text": _long_prompt(tokens, seed=i),
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            },
        )
        r.raise_for_status()
        out.append(r.json()["meta_info"]["prompt_tokens"])
    return out


def measure(
    server_args: list[str],
    label: str,
    log_path: Path,
    long_prompt_count: int = 3,
    long_tokens: int = 6000,
    stream_tokens: int = 48,
) -> dict:
    """Start the launcher with ``server_args``, run the phases, stop it; the result dict (module
    docstring). The server is always stopped, also when a phase fails."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vm = psutil.virtual_memory()
    gpu = gpu_memory()
    cmd = [*LAUNCHER, "--port", str(port), *server_args]
    result = {
        "label": label,
        "command": " ".join(["python -m sglang_wgkv.launch_server", *server_args]),
        "machine": {
            "mem_total_bytes": vm.total,
            "mem_available_at_start_bytes": vm.available,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            **({"gpu_total_bytes": gpu[1], "gpu_used_at_start_bytes": gpu[0]} if gpu else {}),
        },
        "phases": {},
        "survived": False,
    }
    srv = ServerProcess(cmd, log_path, port=port, env=dict(os.environ), cwd=REPO, stop_timeout_s=60)
    sampler = TreeSampler(srv.proc.pid)
    sampler.start()
    try:
        result["startup_s"] = round(srv.wait_healthy(900, probe_timeout_s=30), 1)
        info = requests.get(url + "/server_info", timeout=60).json()
        state = info["internal_states"][0]
        result["server"] = {
            "max_total_num_tokens": info.get("max_total_num_tokens"),
            "max_running_requests": state.get("effective_max_running_requests_per_dp"),
            "wgkv": {
                k: v
                for k, v in state.get("wgkv", {}).items()
                if k in ("total_pages", "page_bytes", "local_window", "tau")
            },
        }
        result["phases"]["startup"] = sampler.take_phase()
        for name, fn in (
            ("frontend", lambda: frontend_program(url)),
            ("chat", lambda: chat(url)),
            ("stream", lambda: stream(url, stream_tokens)),
            ("long_prompts", lambda: long_prompts(url, long_prompt_count, long_tokens)),
        ):
            t = time.monotonic()
            try:
                detail, ok = fn(), True
            except KeyboardInterrupt:  # stopped by hand: keep what was measured
                detail, ok = "interrupted", False
            except Exception as e:  # the server may have died: record it and stop
                detail, ok = f"{type(e).__name__}: {e}", False
            time.sleep(2)  # the idle check after the phase
            result["phases"][name] = {
                "ok": ok and srv.alive(),
                "seconds": round(time.monotonic() - t, 1),
                **sampler.take_phase(),
                "detail": detail,
            }
            if not result["phases"][name]["ok"]:
                break
        result["survived"] = srv.alive()
        result["exit_code"] = srv.proc.returncode
    finally:
        sampler.stop()
        srv.stop()
        result["peak_rss_bytes"] = sampler.peak
        result["min_mem_available_bytes"] = sampler.min_available
        result["peak_rss_fraction_of_ram"] = round(sampler.peak / vm.total, 3)
        if gpu:
            result["peak_gpu_used_bytes"] = sampler.gpu_peak
            result["peak_gpu_fraction"] = round(sampler.gpu_peak / gpu[1], 3)
        result["rss_timeline"] = sampler.samples[::5]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving"))
    ap.add_argument("--log", default=None, help="server log (default: /tmp/serving_memory_<label>.log)")
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=6000)
    ap.add_argument("server_args", nargs="*", help="launcher arguments (after --)")
    a = ap.parse_args()
    result = measure(
        a.server_args,
        a.label,
        Path(a.log or f"/tmp/serving_memory_{a.label}.log"),
        a.long_prompts,
        a.long_tokens,
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"memory_{a.label}.json").write_text(
        json.dumps({"kind": "serving_memory", **result}, indent=1) + "\n"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "rss_timeline"}, indent=1))


if __name__ == "__main__":
    main()
