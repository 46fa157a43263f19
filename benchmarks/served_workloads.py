"""The served workloads, baselines and metrics of ``benchmarks/workloads.json``, validated, and the
server and client commands they make.

=================  ==========================================================================
field              meaning
=================  ==========================================================================
``server_args``    both engines (context length, graphs, memory); with ``common_server_args``
``wgkv_args``      the WG-KV server only (admission, capacity, budget)
``env``            both servers' environment (e.g. a context longer than the config's)
``client``         bench_serving: prompts, input_len, output_len, range_ratio, request_rate
``wgkv_request``   WG-KV only: ``custom_params.wgkv`` of every request
``upstream_from``  a workload whose upstream runs stand for this one's (the same requests)
``keep_defaults``  flags of ``common_server_args`` this workload leaves out, so SGLang's defaults
                   hold (e.g. the radix cache and upstream's prefill CUDA graphs: what a user runs)
``metrics``        the summary rows (names in ``metrics``), first the goal's
=================  ==========================================================================
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS_JSON = Path(__file__).resolve().parent / "workloads.json"
SERVERS = ("upstream", "wgkv")
CLIENT_KEYS = {"prompts", "input_len", "output_len", "range_ratio", "request_rate"}


@dataclass(frozen=True)
class Metric:
    """A summary metric read from bench_serving's JSON line: ``result[key] * scale``."""

    name: str
    key: str
    scale: float
    better: str  # "lower" (times) | "higher" (throughput)

    def __post_init__(self):
        if self.better not in ("lower", "higher"):
            raise ValueError(f"metric {self.name}: better must be lower or higher, not {self.better!r}")

    def value(self, result: dict | None) -> float | None:
        x = (result or {}).get(self.key)
        return None if x is None else x * self.scale

    def ratio(self, upstream: float | None, wgkv: float | None) -> float | None:
        """> 1 when WG-KV is better."""
        if not upstream or not wgkv:
            return None
        return upstream / wgkv if self.better == "lower" else wgkv / upstream

    def best(self, values: list[float]) -> float:
        return min(values) if self.better == "lower" else max(values)


@dataclass(frozen=True)
class Client:
    prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 1.0
    request_rate: float | str = "inf"

    def __post_init__(self):
        if min(self.prompts, self.input_len, self.output_len) < 1:
            raise ValueError(f"client sizes must be positive: {self}")
        if not 0 < self.range_ratio <= 1:
            raise ValueError(f"range_ratio must lie in (0, 1]: {self.range_ratio}")
        if self.request_rate != "inf" and not (
            isinstance(self.request_rate, (int, float)) and self.request_rate > 0
        ):
            raise ValueError(f"request_rate must be 'inf' or a positive number: {self.request_rate!r}")


@dataclass(frozen=True)
class Workload:
    name: str
    server_args: str
    wgkv_args: str
    client: Client
    metrics: tuple[str, ...]
    goal: str
    env: dict = field(default_factory=dict)
    wgkv_request: dict = field(default_factory=dict)
    upstream_from: str | None = None
    upstream_may_refuse: bool = False
    keep_defaults: tuple[str, ...] = ()
    bench_timeout_s: float = 540.0
    # GiB SGLang may hold for weights and the KV pool; the fraction of the card's memory is computed at
    # start (server_command), so the pool is the same size on any card
    static_memory_gib: float | None = None
    why: str = ""

    def server_key(self, server: str) -> tuple:
        """Workloads with equal keys share one server start."""
        wgkv_args = self.wgkv_args if server == "wgkv" else ""
        env = tuple(sorted(self.env.items()))
        return (self.server_args, self.static_memory_gib, wgkv_args, env, self.keep_defaults)


@dataclass(frozen=True)
class Config:
    """An upstream baseline or a WG-KV configuration: extra server arguments."""

    name: str
    server_args: str
    about: str = ""


@dataclass(frozen=True)
class WorkloadSet:
    common_server_args: str
    baselines: dict[str, Config]
    wgkv_configs: dict[str, Config]
    metrics: dict[str, Metric]
    workloads: dict[str, Workload]

    def __post_init__(self):
        for w in self.workloads.values():
            unknown = [m for m in w.metrics if m not in self.metrics]
            if not w.metrics or unknown:
                raise ValueError(f"{w.name}: metrics {list(w.metrics)} (unknown: {unknown})")
            if w.upstream_from is not None:
                src = self.workloads.get(w.upstream_from)
                if src is None or src.upstream_from is not None:
                    raise ValueError(
                        f"{w.name}: upstream_from {w.upstream_from!r} is not a measured workload"
                    )
                same = (src.server_args, src.client, src.env, src.keep_defaults)
                if same != (w.server_args, w.client, w.env, w.keep_defaults):
                    raise ValueError(f"{w.name}: upstream_from {src.name} sends other requests or servers")
        if "best" in self.baselines:
            raise ValueError("'best' is the summary's pick among baselines, not a baseline")

    def __getitem__(self, name: str) -> Workload:
        if name not in self.workloads:
            raise KeyError(
                f"unknown workload {name!r} (benchmarks/workloads.json has {', '.join(self.workloads)})"
            )
        return self.workloads[name]


def _switches(args: str) -> set[str]:
    """The flags of ``args`` that take no value."""
    words = shlex.split(args)
    nxt = words[1:] + ["--"]
    return {a for a, b in zip(words, nxt) if a.startswith("--") and b.startswith("--")}


def _fields(kind: str, d: dict, allowed: set[str], required: set[str]) -> None:
    extra, missing = set(d) - allowed, required - set(d)
    if extra or missing:
        raise ValueError(f"{kind}: unknown fields {sorted(extra)}, missing {sorted(missing)}")


def parse(d: dict) -> WorkloadSet:
    """A :class:`WorkloadSet` from the JSON document; ValueError naming the first bad entry."""
    _fields(
        "workloads.json",
        d,
        {"kind", "about", "common_server_args", "common_server_args_why"}
        | {"baselines", "wgkv_configs", "metrics", "workloads"},
        {"kind", "common_server_args", "baselines", "wgkv_configs", "metrics", "workloads"},
    )
    if d["kind"] != "served_workloads":
        raise ValueError(f"workloads.json: kind {d['kind']!r}, not 'served_workloads'")
    workloads: dict[str, Workload] = {}
    for e in d["workloads"]:
        allowed = {f.name for f in Workload.__dataclass_fields__.values()}
        _fields(
            f"workload {e.get('name')}",
            e,
            allowed,
            {"name", "server_args", "wgkv_args", "client"} | {"metrics", "goal"},
        )
        _fields(
            f"workload {e['name']} client", e["client"], CLIENT_KEYS, {"prompts", "input_len", "output_len"}
        )
        if e["name"] in workloads:
            raise ValueError(f"workload {e['name']} is listed twice")
        shlex.split(e["server_args"] + " " + e["wgkv_args"])  # unbalanced quotes raise here
        memory = e.get("static_memory_gib")
        if memory is not None and (not isinstance(memory, (int, float)) or memory <= 0):
            raise ValueError(
                f"workload {e['name']}: static_memory_gib must be a positive number, got {memory!r}"
            )
        if memory is not None and "--mem-fraction-static" in e["server_args"]:
            raise ValueError(f"workload {e['name']}: static_memory_gib and --mem-fraction-static both given")
        keep = tuple(e.get("keep_defaults", ()))
        if not all(flag in _switches(d["common_server_args"]) for flag in keep):
            raise ValueError(
                f"workload {e['name']}: keep_defaults {list(keep)} must be switches (flags without a "
                "value) of common_server_args"
            )
        workloads[e["name"]] = Workload(
            **{**e, "client": Client(**e["client"]), "metrics": tuple(e["metrics"]), "keep_defaults": keep}
        )
    configs = {
        key: {n: Config(n, c["server_args"], c.get("about", "")) for n, c in d[key].items()}
        for key in ("baselines", "wgkv_configs")
    }
    metrics = {n: Metric(n, m["key"], float(m["scale"]), m["better"]) for n, m in d["metrics"].items()}
    return WorkloadSet(
        d["common_server_args"], configs["baselines"], configs["wgkv_configs"], metrics, workloads
    )


def load(path: Path = WORKLOADS_JSON) -> WorkloadSet:
    return parse(json.loads(Path(path).read_text()))


# SGLang's own default leaves about this much of a card for activations and CUDA graphs.
MAX_MEMORY_FRACTION = 0.9
# Tensor parallel: NVLink multicast stays off (it can take the host's shared GPUs out of service).
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def server_command(
    ws: WorkloadSet,
    server: str,
    config: str,
    w: Workload,
    model: Path,
    port: int,
    tp: int = 1,
    extra: str = "",
    gpu_total_mib: int | None = None,
) -> list[str]:
    """``config``: a baseline name (upstream) or a WG-KV configuration name (wgkv); ``gpu_total_mib``:
    the card's memory, for a workload that sizes its memory in GiB."""
    common = [a for a in shlex.split(ws.common_server_args) if a not in w.keep_defaults]
    args = ["--model-path", str(model), "--port", str(port), *common]
    args += shlex.split(w.server_args) + memory_args(w, gpu_total_mib)
    if tp > 1:
        args += ["--tp-size", str(tp), "--disable-custom-all-reduce"]
    if server == "upstream":
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *shlex.split(ws.baselines[config].server_args),
            *args,
        ]
    if server != "wgkv":
        raise ValueError(f"server {server!r}: upstream or wgkv")
    config_args = shlex.split(ws.wgkv_configs[config].server_args)
    return [sys.executable, "-m", "sglang_wgkv.launch_server", *args, *shlex.split(w.wgkv_args), *config_args]


def memory_args(w: Workload, gpu_total_mib: int | None) -> list[str]:
    """``--mem-fraction-static`` for ``w.static_memory_gib`` on a card of ``gpu_total_mib`` (none if the
    workload gives no memory in GiB); ValueError without the card's size or where it is too small."""
    if w.static_memory_gib is None:
        return []
    if not gpu_total_mib:
        raise ValueError(
            f"{w.name} sizes its memory in GiB ({w.static_memory_gib}): the GPU's total is needed"
        )
    fraction = w.static_memory_gib * 1024 / gpu_total_mib
    if fraction > MAX_MEMORY_FRACTION:
        raise ValueError(
            f"{w.name}: {w.static_memory_gib} GiB is {fraction:.2f} of this card's {gpu_total_mib} MiB "
            f"(at most {MAX_MEMORY_FRACTION})"
        )
    return ["--mem-fraction-static", f"{fraction:.4f}"]


def bench_command(
    w: Workload,
    url: str,
    out_file: Path,
    seed: int,
    body: dict | None,
    client: Client | None = None,
    details: bool = False,
) -> list[str]:
    """``python -m sglang.bench_serving`` for ``client`` (default: the workload's); ``body`` is
    WG-KV's ``custom_params.wgkv``."""
    c = client or w.client
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url]
    cmd += ["--dataset-name", "random-ids", "--tokenize-prompt"]
    cmd += ["--random-input-len", str(c.input_len), "--random-output-len", str(c.output_len)]
    cmd += ["--random-range-ratio", f"{c.range_ratio:g}", "--num-prompts", str(c.prompts)]
    cmd += ["--request-rate", str(c.request_rate), "--warmup-requests", "0", "--seed", str(seed)]
    cmd += ["--disable-tqdm", "--ready-check-timeout-sec", "300", "--output-file", str(out_file)]
    if details:  # the errors of refused requests
        cmd.append("--output-details")
    if body:
        # bench_serving merges this at the top level of /generate: repeat its sampling parameters.
        params = {"max_new_tokens": c.output_len, "temperature": 0.0, "ignore_eos": True}
        if c.range_ratio < 1:
            raise ValueError(
                f"{w.name}: a request body fixes max_new_tokens; random output lengths need none"
            )
        cmd += [
            "--extra-request-body",
            json.dumps({"sampling_params": {**params, "custom_params": {"wgkv": body}}}),
        ]
    return cmd


def warmup_client(w: Workload) -> Client:
    """Compiles kernels and captures nothing new: 1 x (<= 8K + 16) tokens."""
    return Client(1, min(w.client.input_len, 8192), 16)


def bench_env() -> dict:
    """bench_serving's environment: the ``datasets`` stand-in (``offline_imports/``) only where the
    real package is missing (its import is unconditional, its use is not ours)."""
    import importlib.util
    import os

    env = dict(os.environ)
    if importlib.util.find_spec("datasets") is None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent / "offline_imports"), env.get("PYTHONPATH", "")]
        )
    return env
