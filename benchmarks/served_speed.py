"""Served speed: WG-KV against upstream SGLang (FlashInfer backend) on the same GPU and memory,
measured with SGLang's own client, ``python -m sglang.bench_serving --backend sglang --dataset-name
random-ids`` (offline token ids).

Workloads (``WORKLOADS``; 25% random admission on the WG-KV side, the paper's profiling protocol for
dummy weights, the gate still evaluated):

====  =====================================  ==========================================
W0    1 x (126,976 + 128), every token kept   TPOT within 3% of upstream (``admission: false``)
W1    1 x (126,976 + 128)                     TTFT >= 3x, TPOT >= 1.6x
W2    32 x (32,768 + 256)                     output tok/s >= 1.5x
W3    128 x (2,048 + 4,096), mem 0.3          output tok/s >= 2.5x (upstream KV-bound)
W4    64 x (1,024 + 4,096), ``--kv-budget``   output tok/s >= 4x (the evictor fires)
W4L   64 x (1,024 + 8,192), ``--kv-budget``   output tok/s >= 4x (the issue's 1K + 8K request shape)
====  =====================================  ==========================================

``run`` starts one server per distinct server configuration of the workloads asked for, runs a short
warm-up ``bench_serving`` (another seed: no prefix shared with the timed prompts) and the timed one,
records bench_serving's JSON line, the commands, the server's capacity and (WG-KV) its ``wgkv``
stats, then stops the server. ``merge`` turns part files into ``benchmarks/results/serving/``:
one JSON per workload, ``summary.json`` (``{"rows": [{"workload", "metric", "upstream", "wgkv",
"ratio", "goal", "command"}]}``) and ``summary.png``.

    python benchmarks/served_speed.py run --server upstream --workloads W1,W0 --out-dir $OUT
    python benchmarks/served_speed.py merge PARTS... --out-dir benchmarks/results/serving

The model directory is the Llama-3.1-8B configuration plus a word-level tokenizer of the same
vocabulary (``t0 .. tN``: every id decodes to a non-empty word, so bench_serving's streamed text
counts every token; built at run time, nothing downloaded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's sglang_wgkv, not an installed one

from sglang_wgkv.server_process import ServerProcess, free_port  # noqa: E402

CONFIG_DIR = REPO / "launch" / "configs" / "llama-3.1-8b"
# --incremental-streaming-output (both servers): SGLang's /generate stream otherwise repeats the whole
# text so far in every chunk, O(n^2) per request in the server's tokenizer manager and in
# bench_serving's one asyncio thread. Seen on 2026-12-02 (W3, 128 streams x 4,096 tokens): the WG-KV
# server decoded at 14.6K-10K tok/s by its own log, the client saw median ITL 9.2 ms but mean 18.2 ms
# (p99 159 ms) and finished 25 s after the server's last decode step.
COMMON = (
    "--load-format dummy --disable-radix-cache --sampling-backend pytorch --disable-prefill-cuda-graph "
    "--incremental-streaming-output --log-level info"
)
WGKV_ADMISSION = "--wgkv-random-admission 0.25"


@dataclass(frozen=True)
class Workload:
    id: str
    prompts: int
    input_len: int
    output_len: int
    server: str  # extra arguments of both servers (context length, graphs, memory)
    wgkv: str  # extra arguments of the WG-KV server
    metric: str  # ttft_s | tpot_ms | output_tok_s (what the goal is about)
    goal: str
    request_body: dict = field(default_factory=dict)  # WG-KV only: extra /generate body


# W0-W2 share one server per engine (one start); W3/W4 change the memory fraction.
SHARED = "--context-length 131072 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --mem-fraction-static 0.5"
WGKV_CAPACITY = f"{WGKV_ADMISSION} --wgkv-overcommit 4"
W4_SERVER = "--context-length 16384 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --mem-fraction-static 0.19"
WORKLOADS = {
    w.id: w
    for w in [
        Workload(
            "W1", 1, 126976, 128, SHARED, WGKV_CAPACITY, "tpot_ms", "TTFT >= 3x and TPOT >= 1.6x upstream"
        ),
        Workload(
            "W0",
            1,
            126976,
            128,
            SHARED,
            WGKV_CAPACITY,
            "tpot_ms",
            "TPOT <= 1.03 x upstream, every token kept",
            request_body={"admission": False},
        ),
        Workload(
            "W2", 32, 32768, 256, SHARED, WGKV_CAPACITY, "output_tok_s", "output tok/s >= 1.5x upstream"
        ),
        Workload(
            "W3",
            128,
            2048,
            4096,
            "--context-length 8192 --cuda-graph-max-bs-decode 128 --max-running-requests 128 --mem-fraction-static 0.3",
            WGKV_CAPACITY,
            "output_tok_s",
            "output tok/s >= 2.5x upstream",
        ),
        # W4's memory (both servers): 0.19 so that the WG-KV plan's slots hold all 64 prompts in one wave
        # (plan_capacity at upstream's 0.18 budget of 81,649 tokens: 61 slots of 1,318 dense tokens; at
        # 0.19 ~93K tokens, 64 slots); upstream gets the same 14% more KV. W4L is the request shape
        # (1K prompt + 8K generated; 64 requests, not 256, so that upstream's run stays within a device
        # call); both share one server per engine (context 16,384; the WG-KV plan keeps 64 slots).
        Workload(
            "W4",
            64,
            1024,
            4096,
            W4_SERVER,
            f"{WGKV_ADMISSION} --kv-budget 512",
            "output_tok_s",
            "output tok/s >= 4x upstream",
        ),
        Workload(
            "W4L",
            64,
            1024,
            8192,
            W4_SERVER,
            f"{WGKV_ADMISSION} --kv-budget 512",
            "output_tok_s",
            "output tok/s >= 4x upstream",
        ),
    ]
}


def environment() -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }
    for mod in ("torch", "sglang", "triton", "flashinfer"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal
            env[mod] = f"unavailable: {type(exc).__name__}"
    try:
        import torch

        env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        env["gpu"] = None
    return env


def model_dir(dest: Path) -> Path:
    """The Llama-3.1-8B configuration with a word-level tokenizer over its whole vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIG_DIR / "config.json", dest / "config.json")
    vocab_size = json.loads((CONFIG_DIR / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="\x00", cleanup=False)  # joins words with spaces
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1 << 20,
                "bos_token": None,
                "eos_token": "t0",
                "unk_token": "t0",
            }
        )
    )
    return dest


# Tensor parallel: NVLink multicast stays off (it can take the host's shared GPUs out of service).
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def server_command(
    server: str, w: Workload, model: Path, port: int, upstream_backend: str, tp: int = 1, wgkv_extra: str = ""
) -> list[str]:
    args = ["--model-path", str(model), "--port", str(port), *shlex.split(COMMON), *shlex.split(w.server)]
    if tp > 1:
        args += ["--tp-size", str(tp), "--disable-custom-all-reduce"]
    if server == "upstream":
        return [sys.executable, "-m", "sglang.launch_server", "--attention-backend", upstream_backend, *args]
    return [
        sys.executable,
        "-m",
        "sglang_wgkv.launch_server",
        *args,
        *shlex.split(w.wgkv),
        *shlex.split(wgkv_extra),
    ]


def bench_command(
    w: Workload,
    url: str,
    out_file: Path,
    seed: int,
    prompts: int,
    output_len: int,
    body: dict | None,
    input_len: int | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--random-input-len",
        str(input_len or w.input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "1",
        "--num-prompts",
        str(prompts),
        "--request-rate",
        "inf",
        "--warmup-requests",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "300",
        "--output-file",
        str(out_file),
    ]
    if body:
        # bench_serving merges this at the top level of /generate: repeat its sampling parameters.
        cmd += [
            "--extra-request-body",
            json.dumps(
                {
                    "sampling_params": {
                        "max_new_tokens": output_len,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "custom_params": {"wgkv": body},
                    }
                }
            ),
        ]
    return cmd


def server_state(url: str) -> dict:
    import requests

    info = requests.get(url + "/server_info", timeout=60).json()
    state = info["internal_states"][0]
    out = {
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "max_running_requests": state.get("effective_max_running_requests_per_dp"),
    }
    if "wgkv" in state:
        out["wgkv"] = {k: v for k, v in state["wgkv"].items() if not k.endswith("per_layer_head")}
    return out


def bench_env() -> dict:
    """bench_serving's environment: the ``datasets`` stand-in (``offline_imports/``) only where the
    real package is missing (its import is unconditional, its use is not ours)."""
    import importlib.util

    env = dict(os.environ)
    if importlib.util.find_spec("datasets") is None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent / "offline_imports"), env.get("PYTHONPATH", "")]
        )
    return env


def run_bench(cmd: list[str], out_file: Path, timeout: float) -> dict:
    out_file.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=bench_env())
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(
            f"bench_serving failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(out_file.read_text().splitlines()[-1])


# MiB of GPU memory other processes may hold when a server starts: more means a server left running by
# an earlier call (seen on 2026-12-03: a device call cut by its time limit left its upstream server up,
# holding 29 GB, and the next upstream server got a pool of 47,931 tokens instead of 93,052), and any
# number measured beside it is not comparable.
GPU_BUSY_MIB = 2048


def gpu_used_mib() -> int | None:
    """MiB in use on the busiest GPU (nvidia-smi), None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return max(int(x) for x in out.split())


def wait_gpu_idle(limit_s: float = 60.0) -> int | None:
    """The GPU's used MiB once it is at most :data:`GPU_BUSY_MIB` (polled up to ``limit_s``);
    RuntimeError when another process still holds more."""
    deadline = time.monotonic() + limit_s
    while True:
        used = gpu_used_mib()
        if used is None or used <= GPU_BUSY_MIB:
            return used
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the GPU is busy: {used} MiB in use before the server starts "
                f"(another process; a measurement beside it is not comparable)"
            )
        time.sleep(2)


def _exit_on_sigterm(signum, frame):
    # a call's time limit (timeout sends SIGTERM): unwind, so that `finally` stops the server
    raise SystemExit(128 + signum)


def run(a) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir(Path(a.model_dir))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.server == "upstream":  # SGLang's plugin whitelist: none of ours (or anyone's) is loaded
        env["SGLANG_PLUGINS"] = "none"
    if a.tp > 1:
        env.update(TP_ENV)
    if a.profile_dir:
        env["SGLANG_TORCH_PROFILER_DIR"] = a.profile_dir
    part = {"server": a.server, "tp": a.tp, "environment": environment(), "runs": []}
    if a.wgkv_extra:
        if a.server != "wgkv":
            raise SystemExit("--wgkv-extra is for the wgkv server")
        part["wgkv_extra"] = a.wgkv_extra  # an A/B part (served_speed.py ab), never a workload row
    part_file = out_dir / f"part.{a.server}.{a.tag}.json"

    def write_part() -> None:
        part_file.write_text(json.dumps(part, indent=1))

    by_config: dict[tuple, list[Workload]] = {}
    for wid in a.workloads.split(","):
        w = WORKLOADS[wid]
        by_config.setdefault((w.server, w.wgkv if a.server == "wgkv" else ""), []).append(w)
    for workloads in by_config.values():
        port = free_port()
        cmd = server_command(a.server, workloads[0], model, port, a.upstream_backend, a.tp, a.wgkv_extra)
        try:  # a warm-up run (compiles, times nothing) may share the GPU with other work
            gpu_before = gpu_used_mib() if a.warm_only else wait_gpu_idle()
        except RuntimeError as exc:
            part["runs"].append(
                {"workloads": [w.id for w in workloads], "server_command": shlex.join(cmd), "error": str(exc)}
            )
            print(part["runs"][-1]["error"], flush=True)
            continue
        # cwd /tmp: the checkout comes from PYTHONPATH, never from python -m's working directory
        srv = ServerProcess(
            cmd,
            out_dir / f"server.{a.server}.{'_'.join(w.id for w in workloads)}.log",
            port=port,
            env=env,
            cwd="/tmp",
            stop_timeout_s=60,
        )
        try:
            startup = srv.wait_healthy(a.startup_timeout, path="/health", probe_timeout_s=10)
            for w in workloads:
                rec = {
                    "workload": w.id,
                    "server_command": shlex.join(cmd),
                    "startup_s": startup,
                    "gpu_used_mib_before_start": gpu_before,
                }
                try:
                    body = w.request_body if a.server == "wgkv" else None
                    # Compiles kernels and captures nothing new: 1 x (<= 8K + 16) tokens, another seed.
                    warm = bench_command(
                        w, srv.url, out_dir / "warmup.jsonl", 7, 1, 16, body, min(w.input_len, 8192)
                    )
                    run_bench(warm, out_dir / "warmup.jsonl", a.bench_timeout)
                    if a.warm_only:  # compiles (FlashInfer's JIT cache) and times nothing
                        continue
                    timed = bench_command(
                        w,
                        srv.url,
                        out_dir / f"bench.{a.server}.{w.id}.jsonl",
                        1,
                        w.prompts,
                        w.output_len,
                        body,
                    )
                    rec["bench_command"] = shlex.join(timed)
                    rec["result"] = run_bench(
                        timed, out_dir / f"bench.{a.server}.{w.id}.jsonl", a.bench_timeout
                    )
                    if a.profile_dir and w.id in a.profile_workloads.split(","):
                        rec["profile"] = profile_decode(srv.url, w, body, a, Path(a.profile_dir) / w.id)
                    if a.profile_dir and w.id in a.profile_prefill_workloads.split(","):
                        rec["profile_prefill"] = profile_prefill(
                            srv.url, w, body, a, Path(a.profile_dir) / f"{w.id}_prefill"
                        )
                    if a.profile_dir and w.id in a.profile_load_workloads.split(","):
                        rec["profile_under_load"] = profile_under_load(
                            srv.url, w, body, a, Path(a.profile_dir) / f"{w.id}_load", out_dir
                        )
                    rec.update(server_state(srv.url))
                    rec["max_running_seen"] = max(
                        (
                            int(m)
                            for m in re.findall(
                                r"#running-req: (\d+)", srv.log_path.read_text(errors="replace")
                            )
                        ),
                        default=None,
                    )
                except Exception as exc:  # recorded; the next workload still runs
                    rec["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
                part["runs"].append(rec)
                write_part()  # after every workload: a call stopped at its time limit keeps what ran
                print(json.dumps({k: rec.get(k) for k in ("workload", "error")} | summarize(rec)), flush=True)
        except Exception as exc:
            part["runs"].append(
                {
                    "workloads": [w.id for w in workloads],
                    "server_command": shlex.join(cmd),
                    "error": f"{type(exc).__name__}: {exc}"[-4000:],
                }
            )
            print(part["runs"][-1]["error"][-2000:], flush=True)
        finally:
            srv.stop()
    write_part()


def profile_decode(url: str, w: Workload, body: dict | None, a, trace_dir: Path) -> dict:
    """One streamed request of ``w``'s prompt length with ``--profile-steps`` x 4 output tokens; at its
    first token, SGLang's torch profiler records the next ``--profile-steps`` forward steps (decode
    only). Returns the trace summary (:mod:`trace_summary`) and the request's inter-token gaps."""
    import random

    import requests

    rng = random.Random(3)
    params = {"max_new_tokens": 4 * a.profile_steps, "temperature": 0.0, "ignore_eos": True}
    if body:
        params["custom_params"] = {"wgkv": body}
    req = {
        "input_ids": [rng.randrange(1000, 100000) for _ in range(w.input_len)],
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
                    json={
                        "output_dir": str(trace_dir),
                        "num_steps": a.profile_steps,
                        "activities": ["CPU", "GPU"],
                    },
                ).text
    time.sleep(10)  # the trace is written after the last profiled step
    from trace_summary import summarize_dir

    gaps = sorted(b - a_ for a_, b in zip(stamps[1:], stamps[2:]))
    return {
        "start_profile": started,
        "tokens": len(stamps),
        "median_gap_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
        **summarize_dir(str(trace_dir), a.profile_steps),
    }


def profile_prefill(url: str, w: Workload, body: dict | None, a, trace_dir: Path) -> dict:
    """The prefill of one request of ``w``'s prompt length on an idle server: SGLang's torch profiler
    is started for as many forward steps as the prompt has chunks (``chunked_prefill_size`` from
    ``/get_server_info``), then the request (one output token) is sent. Returns the trace summary
    (:mod:`trace_summary`) with the request's wall time."""
    import random

    import requests

    info = requests.get(url + "/get_server_info", timeout=60).json()
    chunk = int(info.get("chunked_prefill_size") or w.input_len)
    steps = -(-w.input_len // chunk) if chunk > 0 else 1
    started = requests.post(
        url + "/start_profile",
        timeout=60,
        json={"output_dir": str(trace_dir), "num_steps": steps, "activities": ["CPU", "GPU"]},
    ).text
    rng = random.Random(4)
    params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    if body:
        params["custom_params"] = {"wgkv": body}
    t0 = time.perf_counter()
    requests.post(
        url + "/generate",
        json={
            "input_ids": [rng.randrange(1000, 100000) for _ in range(w.input_len)],
            "sampling_params": params,
        },
        timeout=a.bench_timeout,
    ).raise_for_status()
    wall = time.perf_counter() - t0
    time.sleep(10)  # the trace is written after the last profiled step
    from trace_summary import summarize_dir

    return {
        "start_profile": started,
        "chunk": chunk,
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
    summary (:mod:`trace_summary`) and the running batch logged at the start."""
    import requests

    cmd = bench_command(w, url, out_dir / "profile_load.jsonl", 11, w.prompts, w.output_len, body)
    bench = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=bench_env(), start_new_session=True
    )
    try:
        # at least the delay, then until every request of the load runs (none waiting), at most 300 s more
        time.sleep(a.profile_load_delay_s)
        deadline = time.monotonic() + 300
        while bench.poll() is None and time.monotonic() < deadline:
            running, waiting = batch_state(url)
            if running and not waiting:
                break
            time.sleep(1)
        if bench.poll() is not None:
            return {
                "error": f"the load ended before the profile ({bench.returncode}): lower --profile-load-delay-s"
            }
        started = requests.post(
            url + "/start_profile",
            timeout=120,
            json={"output_dir": str(trace_dir), "num_steps": a.profile_steps, "activities": ["CPU", "GPU"]},
        ).text
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(trace_dir.rglob("*.json*")):
            time.sleep(2)  # the trace is written after the last profiled step
        time.sleep(5)
    finally:
        os.killpg(bench.pid, signal.SIGTERM)
        bench.wait(timeout=60)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the aborted requests leave before the next workload starts
        if batch_state(url) == (0, 0):
            break
        time.sleep(2)
    from trace_summary import summarize_dir

    return {
        "bench_command": shlex.join(cmd),
        "start_profile": started,
        "num_running_reqs": running,
        **summarize_dir(str(trace_dir), a.profile_steps),
    }


def summarize(rec: dict) -> dict:
    r = rec.get("result") or {}
    return {
        "ttft_s": (r.get("median_ttft_ms") or 0) / 1000 or None,
        "tpot_ms": r.get("median_tpot_ms"),
        "output_tok_s": r.get("output_throughput"),
        "completed": r.get("completed"),
        "max_running_seen": rec.get("max_running_seen"),
    }


# Parts whose runs are compared must come from one lease: at most this far apart (a lease is 30 min).
MAX_PAIR_SPAN_S = 3600


def check_comparable(runs: dict[str, dict[str, dict]]) -> None:
    """ValueError unless each workload's runs used the workload's current server arguments (a changed
    definition, e.g. W4's context length on 2026-12-03, makes an older part another workload) and
    started within :data:`MAX_PAIR_SPAN_S` of each other (one lease, not two)."""
    for key, by_server in runs.items():
        w = WORKLOADS[key.partition("_tp")[0]]
        want = shlex.split(w.server)
        stamps = []
        for server, rec in by_server.items():
            cmd = shlex.split(rec.get("server_command") or "")
            if not any(cmd[i : i + len(want)] == want for i in range(len(cmd))):
                raise ValueError(
                    f"{key} {server}: its server ran without the workload's arguments {w.server!r}"
                )
            if rec.get("date_utc"):
                stamps.append(datetime.datetime.fromisoformat(rec["date_utc"]))
        if len(stamps) > 1 and (max(stamps) - min(stamps)).total_seconds() > MAX_PAIR_SPAN_S:
            raise ValueError(f"{key}: its runs are {max(stamps) - min(stamps)} apart (not one lease)")


def kept_runs(path: Path) -> dict:
    """The runs an earlier lease left in a workload file under names other than a server's (e.g. a
    profiled run the README cites, ``wgkv_2026-12-01_profiled``): a merge replaces ``wgkv`` and
    ``upstream`` and keeps these."""
    if not path.exists():
        return {}
    return {
        k: v for k, v in json.loads(path.read_text()).get("runs", {}).items() if k not in ("wgkv", "upstream")
    }


def merge(a) -> None:
    from trace_summary import recategorize

    runs: dict[str, dict[str, dict]] = {}
    envs = []
    for path in a.parts:
        part = json.loads(Path(path).read_text())
        if part.get("wgkv_extra"):
            raise ValueError(
                f"{path}: ran with --wgkv-extra {part['wgkv_extra']!r}, an A/B part "
                "(served_speed.py ab), not the workload's row"
            )
        envs.append(part["environment"])
        for rec in part["runs"]:
            for summary in (rec.get("profile") or {}).get("summary", []):
                recategorize(summary)  # phases of the current trace_summary.PHASES
            if "workload" in rec:  # TP > 1 runs are their own rows ("W1_tp2")
                tp = part.get("tp", 1)
                rec = {**rec, "date_utc": part["environment"].get("date_utc")}
                runs.setdefault(rec["workload"] + (f"_tp{tp}" if tp > 1 else ""), {})[part["server"]] = rec
    if "W0" in runs and "W1" in runs and "upstream" not in runs["W0"] and "upstream" in runs["W1"]:
        runs["W0"]["upstream"] = runs["W1"]["upstream"]  # upstream keeps every token in W1 already
    check_comparable(runs)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for key, by_server in sorted(runs.items()):
        wid, _, tp_tag = key.partition("_tp")
        tp = int(tp_tag or 1)
        w = WORKLOADS[wid]
        (out / f"{key}.json").write_text(
            json.dumps(
                {
                    "workload": {
                        "id": wid,
                        "tp": tp,
                        "prompts": w.prompts,
                        "input_len": w.input_len,
                        "output_len": w.output_len,
                        "server_args": w.server,
                        "wgkv_args": w.wgkv,
                        "wgkv_request": w.request_body,
                        "goal": w.goal,
                    },
                    "environment": envs,
                    "runs": {**kept_runs(out / f"{key}.json"), **by_server},
                    **({"leases": a.leases} if a.leases else {}),
                },
                indent=1,
            )
        )
        metrics = ["ttft_s", "tpot_ms"] if wid == "W1" else [w.metric]
        for metric in metrics:
            up = summarize(by_server.get("upstream", {})).get(metric)
            wg = summarize(by_server.get("wgkv", {})).get(metric)
            ratio = None
            if up and wg:
                ratio = up / wg if metric in ("ttft_s", "tpot_ms") else wg / up
            rows.append(
                {
                    "workload": wid,
                    "tp": tp,
                    "metric": metric,
                    "upstream": up,
                    "wgkv": wg,
                    "ratio": ratio,
                    "goal": w.goal,
                    "command": {
                        s: {"server": r.get("server_command"), "bench": r.get("bench_command")}
                        for s, r in by_server.items()
                    },
                }
            )
    # Rows of workloads this merge did not measure stay as an earlier lease left them (each row carries
    # its own commands; the workload files say which lease).
    merged = {(r["workload"], r["tp"]) for r in rows}
    if (out / "summary.json").exists():
        kept = [
            r
            for r in json.loads((out / "summary.json").read_text())["rows"]
            if (r["workload"], r.get("tp", 1)) not in merged
        ]
        rows = sorted(rows + kept, key=lambda r: (r["workload"], r.get("tp", 1)))
    (out / "summary.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "ratio": "upstream/wgkv for times, wgkv/upstream for throughput: > 1 means WG-KV is faster",
            },
            indent=1,
        )
    )
    plot(rows, out / "summary.png")
    for row in rows:
        print(json.dumps({k: row[k] for k in ("workload", "metric", "upstream", "wgkv", "ratio")}))


def ab(a) -> None:
    """WG-KV server variants (``run --wgkv-extra``) of one lease side by side, workload by workload:
    each part's TTFT, TPOT and output tok/s with its server command; ratios against the part without
    extra arguments (the served default) where one is given."""
    rows, envs = [], []
    for path in a.parts:
        part = json.loads(Path(path).read_text())
        if part["server"] != "wgkv":
            raise ValueError(f"{path}: an {part['server']} part (ab compares WG-KV variants)")
        envs.append(part["environment"])
        for rec in part["runs"]:
            if "workload" in rec and not rec.get("error"):
                rows.append(
                    {
                        "variant": part.get("wgkv_extra") or "default",
                        "workload": rec["workload"],
                        **summarize(rec),
                        "server_command": rec["server_command"],
                        "bench_command": rec.get("bench_command"),
                    }
                )
    stamps = [datetime.datetime.fromisoformat(env["date_utc"]) for env in envs]
    if (max(stamps) - min(stamps)).total_seconds() > MAX_PAIR_SPAN_S:
        raise ValueError(f"the parts are {max(stamps) - min(stamps)} apart (not one lease)")
    base = {r["workload"]: r for r in rows if r["variant"] == "default"}
    for r in rows:
        b = base.get(r["workload"])
        r["tpot_vs_default"] = b["tpot_ms"] / r["tpot_ms"] if b and r["tpot_ms"] else None
        r["tok_s_vs_default"] = r["output_tok_s"] / b["output_tok_s"] if b and b["output_tok_s"] else None
    out = {
        "what": a.what,
        "command": " ".join(["python", "benchmarks/served_speed.py", *sys.argv[1:]]),
        "environment": envs[0],
        "ab_rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(
            json.dumps(
                {k: r[k] for k in ("variant", "workload", "tpot_ms", "output_tok_s", "tpot_vs_default")}
            )
        )


def plot(rows: list[dict], png: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the `train` extra brings it; the tables and JSON do not need it
        print(f"matplotlib is not installed (pip install -e .[train]): {png} not redrawn", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ratio"]]
    fig, ax = plt.subplots(figsize=(1.4 * max(3, len(rows)) + 2, 3.6))
    labels = [f"{r['workload']}\n{r['metric']}" for r in rows]
    bars = ax.bar(labels, [r["ratio"] for r in rows], color="tab:blue")
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("WG-KV speed / upstream FlashInfer")
    ax.set_title(
        "Served speed on one H200 (Llama-3.1-8B config, dummy weights; WG-KV admits 25% at random, W0 keeps every token)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--server", choices=("upstream", "wgkv"), required=True)
    r.add_argument("--workloads", default="W1,W0")
    r.add_argument("--upstream-backend", default="flashinfer")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--tag", default="a")
    r.add_argument(
        "--tp", type=int, default=1, help="tensor parallel size of both servers (GPUs of one host)"
    )
    r.add_argument("--model-dir", default="/tmp/served_speed_model")
    r.add_argument("--startup-timeout", type=float, default=480)
    r.add_argument("--bench-timeout", type=float, default=540)
    r.add_argument(
        "--profile-dir", default=None, help="after timing them, profile the decode of --profile-workloads"
    )
    r.add_argument("--profile-workloads", default="W1,W0")
    r.add_argument("--profile-steps", type=int, default=12)
    r.add_argument(
        "--profile-load-workloads",
        default="",
        help="with --profile-dir: also profile these "
        "workloads' decode steps under their own load (e.g. W3 at batch 128)",
    )
    r.add_argument(
        "--profile-prefill-workloads",
        default="",
        help="with --profile-dir: also profile the "
        "prefill (every chunk) of one request of these workloads on the idle server",
    )
    r.add_argument(
        "--warm-only",
        action="store_true",
        help="start each server and send the warm-up request "
        "only (builds FlashInfer's JIT cache beside other work; writes no runs)",
    )
    r.add_argument("--profile-load-delay-s", type=float, default=30, help="then until no request waits")
    r.add_argument(
        "--wgkv-extra",
        default="",
        help='more WG-KV server arguments (e.g. "--wgkv-decode-launch '
        'pdl=1"): an A/B part for `ab`, refused by `merge`',
    )
    m = sub.add_parser("merge")
    m.add_argument("parts", nargs="+")
    m.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results" / "serving"))
    m.add_argument(
        "--leases",
        default="",
        help="what lease the merged runs come from (the workload files' "
        '"leases" text; left out when not given)',
    )
    b = sub.add_parser("ab", help="WG-KV variants of one lease (run --wgkv-extra) side by side")
    b.add_argument("parts", nargs="+")
    b.add_argument("--out", required=True)
    b.add_argument("--what", required=True, help="what the variants test (goes into the JSON)")
    a = p.parse_args(argv)
    {"run": run, "merge": merge, "ab": ab}[a.cmd](a)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
