"""Served speed, the run: WG-KV or one upstream baseline on the workloads of
``benchmarks/workloads.json``, measured with SGLang's own client (``python -m sglang.bench_serving
--dataset-name random-ids``), into one part file per run; ``benchmarks.served_report`` merges the
parts run on one machine within an hour into ``benchmarks/results/serving/``.

    python -m benchmarks.served_speed --server upstream --baseline fa3 --workloads W1 --out-dir $OUT
    python -m benchmarks.served_speed --server wgkv --wgkv-config bf16 --workloads W1,W0 --out-dir $OUT

One server per distinct server configuration of the workloads asked for: a short warm-up
bench_serving (another seed, no prefix shared with the timed prompts), the timed one, the server's
capacity and (WG-KV) its ``wgkv`` stats; then the server stops. The model directory is the
Llama-3.1-8B configuration plus a word-level tokenizer of the same vocabulary (``t0 .. tN``: every id
decodes to a non-empty word, so bench_serving's streamed text counts every token; nothing downloaded).
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
from pathlib import Path

import numpy as np

from benchmarks import served_workloads as sw
from benchmarks.prefill_log import prefill_under_load
from benchmarks.served_profile import profile_decode, profile_prefill, profile_under_load
from sglang_wgkv.server_process import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "launch" / "configs" / "llama-3.1-8b"


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


def run_bench(cmd: list[str], out_file: Path, timeout: float) -> dict:
    out_file.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=sw.bench_env())
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(
            f"bench_serving failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(out_file.read_text().splitlines()[-1])


# MiB of GPU memory other processes may hold when a server starts: more is a server an earlier step left
# running, and a pool sized beside it is not comparable.
GPU_BUSY_MIB = 2048


def _gpu_query(field: str) -> list[int] | None:
    """``nvidia-smi --query-gpu=FIELD`` per GPU (MiB), None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) for x in out.split()]


def gpu_used_mib() -> int | None:
    """MiB in use on the busiest GPU (nvidia-smi), None without nvidia-smi."""
    used = _gpu_query("memory.used")
    return max(used) if used else None


def gpu_total_mib() -> int | None:
    """The smallest GPU's memory in MiB (nvidia-smi), None without nvidia-smi."""
    total = _gpu_query("memory.total")
    return min(total) if total else None


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
    # a step's time limit (timeout sends SIGTERM): unwind, so that `finally` stops the server
    raise SystemExit(128 + signum)


def refusal(result: dict, prompts: int) -> str | None:
    """The first error of a run whose requests the server refused (``--output-details``), None when
    every request completed."""
    if (result.get("completed") or 0) >= prompts:
        return None
    return next((e for e in result.get("errors") or [] if e), "requests failed without a message")[-2000:]


def triton_cache_entries() -> set[str]:
    """Kernel binaries in Triton's cache (``TRITON_CACHE_DIR`` or ``~/.triton/cache``), by file name."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return {p.relative_to(root).as_posix() for p in root.glob("*/*.json")} if root.is_dir() else set()


def triton_compiled_since(before: set[str]) -> list[str]:
    """Names of the Triton kernels compiled since ``before`` (:func:`triton_cache_entries`): each is a
    compile some request waited for, where start-up should have paid it."""
    new = sorted(triton_cache_entries() - before)
    return sorted({Path(n).stem for n in new if not Path(n).name.startswith("__grp__")})


# SGLang's line per finished request under --enable-request-time-stats-logging (Req.log_time_stats).
_REQ_TIMES = re.compile(
    r"ReqTimeStats\(rid=[^,]*, input_len=\d+,.*?: queue_duration=([\d.]+)ms, forward_duration=([\d.]+)ms"
)


def request_times(log: str) -> dict | None:
    """The scheduler's own split of each request's time, from SGLang's ``ReqTimeStats`` lines: the wait
    in its queue (arrival to the forward that first carries the request) and the forward time (from
    there to completion), in ms: median, p90 and p99 of each. None when ``log`` has no such line."""
    found = _REQ_TIMES.findall(log)
    if not found:
        return None

    def spread(values: list[float]) -> dict:
        values = sorted(values)
        at = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
        return {"median": at(0.5), "p90": at(0.9), "p99": at(0.99)}

    return {
        "requests": len(found),
        "queue_ms": spread([float(q) for q, _ in found]),
        "forward_ms": spread([float(f) for _, f in found]),
    }


def ttft_by_length(result: dict) -> dict | None:
    """How the requests' TTFT grows with their prompts (bench_serving's ``--output-details``): the
    least-squares line ``ttft = fixed + per_token * input_len`` over the completed requests (a
    per-request cost shows in ``fixed_ms``, a per-token one in ``per_1k_tokens_ms``), and the median
    TTFT of each third of them by prompt length. None without per-request TTFTs."""
    pairs = sorted(
        (n, 1000 * t)
        for n, t, e in zip(
            result.get("input_lens") or [], result.get("ttfts") or [], result.get("errors") or []
        )
        if t and not e
    )
    if len(pairs) < 3:
        return None
    lens = np.array([n for n, _ in pairs], dtype=float)
    ttft = np.array([t for _, t in pairs])
    per_token, fixed = np.polyfit(lens, ttft, 1) if np.ptp(lens) else (0.0, float(np.median(ttft)))
    thirds = np.array_split(np.arange(len(pairs)), 3)
    return {
        "requests": len(pairs),
        "fixed_ms": round(float(fixed), 2),
        "per_1k_tokens_ms": round(1000 * float(per_token), 3),
        "thirds": [
            {
                "input_len": [int(lens[i[0]]), int(lens[i[-1]])],
                "median_ttft_ms": round(float(np.median(ttft[i])), 2),
            }
            for i in thirds
        ],
    }


def drop_token_details(out_file: Path) -> None:
    """The bench file's last line without each request's inter-token gaps and text (megabytes for
    hundreds of long outputs); its TTFTs, lengths and errors stay."""
    lines = out_file.read_text().splitlines()
    last = json.loads(lines[-1])
    for key in ("itls", "generated_texts"):
        last.pop(key, None)
    out_file.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")


def measure(srv, a, w: sw.Workload, rec: dict, out_dir: Path) -> None:
    """The warm-up and the timed bench_serving of ``w`` on the running server, into ``rec``."""
    body = w.wgkv_request if a.server == "wgkv" else None
    cache_before = triton_cache_entries()  # the first workload's: the server just reported healthy
    warm = sw.bench_command(w, srv.url, out_dir / "warmup.jsonl", 7, body, sw.warmup_client(w))
    run_bench(warm, out_dir / "warmup.jsonl", a.bench_timeout)
    if a.warm_only:  # compiles (FlashInfer's JIT cache) and times nothing
        return
    rec["compiled_in_warmup"] = triton_compiled_since(cache_before)
    cache_after_warmup = triton_cache_entries()
    if a.no_timed:
        measure_profiles(srv, a, w, body, rec, out_dir)
        return
    out_file = out_dir / f"bench.{a.server}.{rec['config']}.{a.tag}.{w.name}.jsonl"
    may_refuse = w.upstream_may_refuse and a.server == "upstream"
    timed = sw.bench_command(w, srv.url, out_file, 1, body, details=may_refuse or a.ttft_by_length)
    rec["bench_command"] = shlex.join(timed)
    log_before = len(srv.log_path.read_text(errors="replace"))  # the timed run's lines come after
    try:
        rec["result"] = run_bench(timed, out_file, max(a.bench_timeout, w.bench_timeout_s))
    except RuntimeError as exc:
        if not may_refuse:
            raise
        rec["refusal"] = str(exc)[-2000:]  # bench_serving itself gave up on the refused request
        return
    if may_refuse:
        rec["refusal"] = refusal(rec["result"], w.client.prompts)
    if a.ttft_by_length:
        rec["ttft_by_length"] = ttft_by_length(rec["result"])
        drop_token_details(out_file)
    for key in ("itls", "generated_texts", "errors", "ttfts", "input_lens", "output_lens"):
        rec["result"].pop(key, None)  # per-request details: kept in the bench file only
    rec["compiled_in_timed_run"] = triton_compiled_since(cache_after_warmup)
    timed_log = srv.log_path.read_text(errors="replace")[log_before:]
    times = request_times(timed_log)
    if times:  # a server started with --enable-request-time-stats-logging
        rec["request_times"] = times
    rec["prefill_under_load"] = prefill_under_load(timed_log)
    measure_profiles(srv, a, w, body, rec, out_dir)


def measure_profiles(srv, a, w: sw.Workload, body: dict | None, rec: dict, out_dir: Path) -> None:
    """The profiles asked for ``w`` (``--profile-*``), the server's state and its largest batch."""
    # one folder per run: a trace summary reads every trace under its folder, and a server's traces must
    # not land beside another's (two engines profiled with one --profile-dir)
    profile_dir = Path(a.profile_dir) / f"{a.server}.{rec['config']}.{a.tag}" if a.profile_dir else None
    if profile_dir and w.name in a.profile_workloads.split(","):
        rec["profile"] = profile_decode(srv.url, w, body, a, profile_dir / w.name)
    if profile_dir and w.name in a.profile_prefill_workloads.split(","):
        rec["profile_prefill"] = profile_prefill(srv.url, w, body, a, profile_dir / f"{w.name}_prefill")
    if profile_dir and w.name in a.profile_load_workloads.split(","):
        rec["profile_under_load"] = profile_under_load(
            srv.url, w, body, a, profile_dir / f"{w.name}_load", out_dir
        )
    rec.update(server_state(srv.url))
    log = srv.log_path.read_text(errors="replace")
    rec["max_running_seen"] = max((int(m) for m in re.findall(r"#running-req: (\d+)", log)), default=None)
    if a.server == "wgkv":  # who ran the prefill's vertical range: FA3 or the Triton kernel
        from sglang_wgkv.integration.backend.prefill_vertical import vertical_from_log

        rec["prefill_vertical"] = vertical_from_log(log)


def run(a) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ws = sw.load(Path(a.workloads_file))
    config = a.baseline if a.server == "upstream" else a.wgkv_config
    known = ws.baselines if a.server == "upstream" else ws.wgkv_configs
    if config not in known:
        raise SystemExit(
            f"{a.server}: no configuration {config!r} in {a.workloads_file} ({', '.join(known)})"
        )
    if a.wgkv_extra and a.server != "wgkv":
        raise SystemExit("--wgkv-extra is for the wgkv server")
    if a.upstream_extra and a.server != "upstream":
        raise SystemExit("--upstream-extra is for the upstream server")
    workloads = [ws[name] for name in a.workloads.split(",")]
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir(Path(a.model_dir))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.server == "upstream":  # SGLang's plugin whitelist: none of ours (or anyone's) is loaded
        env["SGLANG_PLUGINS"] = "none"
    if a.tp > 1:
        env.update(sw.TP_ENV)
    if a.profile_dir:
        env["SGLANG_TORCH_PROFILER_DIR"] = a.profile_dir
    config_key = "baseline" if a.server == "upstream" else "wgkv_config"
    part = {"kind": "served_part", "server": a.server, config_key: config, "tp": a.tp}
    part["gpu_total_mib"] = gpu_total = gpu_total_mib()
    part |= {"environment": environment(), "runs": []}
    if a.wgkv_extra:
        part["wgkv_extra"] = a.wgkv_extra  # an A/B part (served_report ab), never a workload row
    if a.upstream_extra:
        part["upstream_extra"] = a.upstream_extra  # a reference of an A/B (served_report ab) only
    # every file a run writes names its tag and workloads: runs chained into one folder never overwrite
    part_file = out_dir / f"part.{a.server}.{config}.{a.tag}.{'_'.join(w.name for w in workloads)}.json"

    def write_part() -> None:
        part_file.write_text(json.dumps(part, indent=1))

    by_server: dict[tuple, list[sw.Workload]] = {}
    for w in workloads:
        by_server.setdefault(w.server_key(a.server), []).append(w)
    for group in by_server.values():
        port = free_port()
        names = [w.name for w in group]
        try:
            cmd = sw.server_command(
                ws, a.server, config, group[0], model, port, a.tp, gpu_total_mib=gpu_total
            )
        except ValueError as exc:  # a workload this card cannot hold
            part["runs"].append({"workloads": names, "error": str(exc)})
            print(part["runs"][-1]["error"], flush=True)
            continue
        cmd += shlex.split(a.wgkv_extra) + shlex.split(a.upstream_extra)
        try:  # a warm-up run (compiles, times nothing) may share the GPU with other work
            gpu_before = gpu_used_mib() if a.warm_only else wait_gpu_idle()
        except RuntimeError as exc:
            part["runs"].append({"workloads": names, "server_command": shlex.join(cmd), "error": str(exc)})
            print(part["runs"][-1]["error"], flush=True)
            continue
        # cwd /tmp: the checkout comes from PYTHONPATH, never from python -m's working directory
        srv = ServerProcess(
            cmd,
            out_dir / f"server.{a.server}.{config}.{a.tag}.{'_'.join(names)}.log",
            port=port,
            env={**env, **group[0].env},
            cwd="/tmp",
            stop_timeout_s=60,
        )
        try:
            startup = srv.wait_healthy(a.startup_timeout, path="/health", probe_timeout_s=10)
            for w in group:
                rec = {"workload": w.name, "config": config, "server_command": shlex.join(cmd)}
                rec |= {"server_env": w.env, "startup_s": startup, "gpu_used_mib_before_start": gpu_before}
                try:
                    measure(srv, a, w, rec, out_dir)
                except Exception as exc:  # recorded; the next workload still runs
                    rec["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
                if a.warm_only:
                    continue
                part["runs"].append(rec)
                write_part()  # after every workload: a step stopped at its time limit keeps what ran
                print(json.dumps({k: rec.get(k) for k in ("workload", "error", "refusal")}), flush=True)
        except Exception as exc:
            part["runs"].append(
                {
                    "workloads": names,
                    "server_command": shlex.join(cmd),
                    "error": f"{type(exc).__name__}: {exc}"[-4000:],
                }
            )
            print(part["runs"][-1]["error"][-2000:], flush=True)
        finally:
            srv.stop()
    write_part()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", choices=sw.SERVERS, required=True)
    p.add_argument("--baseline", default="fa3", help="upstream: a baseline of the workloads file")
    p.add_argument("--wgkv-config", default="bf16", help="wgkv: a configuration of the workloads file")
    p.add_argument("--workloads", default="W1,W0")
    p.add_argument("--workloads-file", default=str(sw.WORKLOADS_JSON))
    p.add_argument("--out-dir", required=True)
    p.add_argument("--tag", default="a")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPUs of one host)")
    p.add_argument("--model-dir", default="/tmp/served_speed_model")
    p.add_argument("--startup-timeout", type=float, default=480)
    p.add_argument("--bench-timeout", type=float, default=540, help="at least; a workload may ask for more")
    p.add_argument("--profile-dir", default=None, help="after timing them, profile --profile-workloads")
    p.add_argument("--profile-workloads", default="W1,W0", help="the idle server's decode steps")
    p.add_argument("--profile-steps", type=int, default=12)
    p.add_argument(
        "--profile-host",
        choices=("stack", "ops", "gpu"),
        default="stack",
        help="the host events traced beside the kernels (served_profile.PROFILE_HOST): Python stacks, "
        "ops without them (the host near its unprofiled speed), or none",
    )
    p.add_argument("--profile-load-workloads", default="", help="decode steps under the workload's own load")
    p.add_argument(
        "--profile-prefill-workloads",
        default="",
        help="every prefill chunk of one request (prompts of half a chunk or less: as many as fill one pass)",
    )
    p.add_argument("--profile-load-delay-s", type=float, default=30, help="then until no request waits")
    p.add_argument(
        "--profile-load-waiting",
        action="store_true",
        help="profile under load once the delay has passed, while requests still wait (mixed traffic)",
    )
    p.add_argument("--no-timed", action="store_true", help="warm-up and profiles only: no timed run")
    p.add_argument(
        "--ttft-by-length",
        action="store_true",
        help="per-request TTFTs (bench_serving --output-details) fitted against the prompt lengths "
        "(runs[].ttft_by_length): a fixed cost per request against one per prompt token",
    )
    p.add_argument(
        "--profile-drain-timeout-s",
        type=float,
        default=300,
        help="after a profile under load, at most this long for its aborted requests to leave",
    )
    p.add_argument(
        "--warm-only",
        action="store_true",
        help="start each server and send the warm-up request only (builds FlashInfer's JIT cache; writes no runs)",
    )
    p.add_argument(
        "--wgkv-extra",
        default="",
        help='more WG-KV server arguments (e.g. "--wgkv-decode-launch pdl=1"): an A/B part, refused by merge',
    )
    p.add_argument(
        "--upstream-extra",
        default="",
        help='more upstream server arguments (e.g. "--cuda-graph-backend-prefill disabled"): an A/B reference, refused by merge',
    )
    run(p.parse_args(extra_args_joined(sys.argv[1:] if argv is None else argv)))


EXTRA_OPTIONS = ("--wgkv-extra", "--upstream-extra")


def extra_args_joined(argv: list[str]) -> list[str]:
    """``--wgkv-extra --flag`` as ``--wgkv-extra=--flag``: argparse takes a lone value that starts with
    ``--`` for an option of its own and refuses the pair."""
    out, it = [], iter(argv)
    for arg in it:
        if arg in EXTRA_OPTIONS:
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
