"""SGLang's frontend test programs (:mod:`evals.frontend_programs`) on WG-KV and on the dense baseline,
one server at a time, into one JSON table (program -> outcome per server).

Servers (``--servers``, in order):

* ``wgkv``: ``python -m sglang_wgkv.launch_server`` (the defaults: WG-KV, shipped gates);
* ``disable-wgkv``: the same with ``--disable-wgkv`` (SGLang's dense attention; our constrained-decoding
  hooks still apply: they are not tied to the attention backend);
* ``upstream``: ``--disable-wgkv`` with ``SGLANG_PLUGINS=wgkv_cpu_compat``: our plugin is not loaded
  (only the import stand-in that lets SGLang start on a CPU), i.e. SGLang 0.5.17 as shipped.

    # CPU, the recorded run (benchmarks/results/constrained/cpu_programs.json)
    python -m benchmarks.constrained_programs --server-args "--max-total-tokens 16384" \\
        --out benchmarks/results/constrained/cpu_programs.json
    # H200 (kernels path), see launch/h200.sh programs
    python -m benchmarks.constrained_programs --servers wgkv,disable-wgkv --out $OUT/h200_programs.json

``--max-new-tokens N`` caps every generation (default: the programs' own limits). ``--merge A.json B.json
--out C.json`` joins the runs of separate invocations (one server per invocation, e.g. on a busy machine).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import shlex
import sys
import time
from pathlib import Path

from evals.frontend_programs import run_programs
from sglang_wgkv.testing.serving import Server

SERVERS = {
    "wgkv": ([], {}),
    "disable-wgkv": (["--disable-wgkv"], {}),
    "upstream": (["--disable-wgkv"], {"SGLANG_PLUGINS": "wgkv_cpu_compat"}),
}


def environment() -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "host": platform.node(),
        "command": shlex.join(sys.argv),
    }
    for dist in ("torch", "sglang", "xgrammar"):
        env[dist] = importlib.metadata.version(dist)
    import torch

    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return env


def crash_lines(log: Path) -> list[str]:
    """The scheduler's fatal error lines, if it died (the reason behind every later failure)."""
    lines = log.read_text(errors="replace").splitlines()
    keys = ("Error:", "Exception:", "NVIDIA driver", "Unsupported device")
    return [line[:300] for line in lines if any(k in line for k in keys)][:8]


def run_server(
    name: str,
    server_args: list[str],
    max_new_tokens: int | None,
    log_dir: Path,
    programs: list[str] | None = None,
) -> dict:
    args, env = SERVERS[name]
    log = log_dir / f"constrained_programs.{name}.log"
    base = ("--log-level", "warning", "--sleep-on-idle")
    server = Server([*args, *server_args], log, env=env, base_args=base)
    record = {"server": name, "args": [*base, *args, *server_args], "env": env, "log": str(log)}
    t0 = time.perf_counter()
    try:
        server.wait_healthy()
        record["startup_s"] = round(time.perf_counter() - t0, 1)
        record["programs"] = run_programs(server.url, max_new_tokens, programs)
        record["alive_after"] = server.alive()
    finally:
        server.stop()
    record["fatal_log_lines"] = crash_lines(log)
    return record


def table(runs: list[dict]) -> dict:
    """{program: {server: outcome}}; "-" where a server did not run the program."""
    names = list(dict.fromkeys(p for r in runs for p in r["programs"]))
    return {p: {r["server"]: r["programs"].get(p, {}).get("outcome", "-") for r in runs} for p in names}


def write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"kind": "constrained_programs", **result}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="wgkv,disable-wgkv,upstream")
    ap.add_argument("--server-args", default="", help="extra arguments for every server")
    ap.add_argument(
        "--baseline-args",
        default="",
        help="extra arguments for the dense servers only (disable-wgkv, upstream), e.g. "
        "'--attention-backend flashinfer' on the H200 kit, which lacks SGLang's default FA3",
    )
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--programs", default=None, help="comma-separated subset of the programs (default: all)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--merge", nargs="+", default=None, help="JSON outputs of earlier calls to join")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.merge:
        parts = [json.loads(Path(p).read_text()) for p in a.merge]
        if len({p["max_new_tokens"] for p in parts}) != 1:
            raise SystemExit("--merge: the parts ran with different --max-new-tokens")
        runs = [r for p in parts for r in p["runs"]]
        result = {
            "environment": [p["environment"] for p in parts],
            "max_new_tokens": parts[0]["max_new_tokens"],
            "table": table(runs),
            "runs": runs,
        }
    else:
        programs = a.programs.split(",") if a.programs else None
        runs = []
        for name in a.servers.split(","):  # written after each server: a cut-off run keeps what it measured
            extra = shlex.split(a.server_args) + (shlex.split(a.baseline_args) if name != "wgkv" else [])
            runs.append(run_server(name, extra, a.max_new_tokens, Path(a.log_dir), programs))
            result = {
                "environment": environment(),
                "max_new_tokens": a.max_new_tokens,
                "table": table(runs),
                "runs": runs,
            }
            write(a.out, result)
    write(a.out, result)
    width = max(map(len, result["table"]))
    print(f"{'program':{width}}  " + "  ".join(f"{r['server']:>12}" for r in runs))
    for program, row in result["table"].items():
        print(f"{program:{width}}  " + "  ".join(f"{row[r['server']]:>12}" for r in runs))


if __name__ == "__main__":
    main()
