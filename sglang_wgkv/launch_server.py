"""Launch SGLang's server with WG-KV: ``python -m sglang_wgkv.launch_server [WG-KV options] [SGLang args]``.

WG-KV options (all others go to SGLang unchanged)::

    --kv-budget N                 global tokens kept per (request, layer, KV head) by the SnapKV evictor
    --wgkv-gates PATH|fresh       gate checkpoint: directory (gates.safetensors + gates.json) or official .pt;
                                  ``fresh``: untrained gates, which admit every token. Default: the gates
                                  shipped for the embedded model when it is served, else fresh
    --wgkv-tau T                  admission threshold (default: config.DEFAULT_TAU)
    --wgkv-local-window W         W_local, a multiple of 16 (default: config.DEFAULT_LOCAL_WINDOW); a gate
                                  checkpoint trained with another W_local is refused
    --wgkv-random-admission P     admit each (token, head) with probability P; the gate still runs
    --wgkv-seed S                 seed of fresh gates and random admission (default 0)
    --wgkv-overcommit F           F > 1: SGLang's token pool and request slots are F times the dense-equivalent
                                  ones; the scheduler admits and retracts by the physical pool's free pages
                                  (not with --kv-budget). Default on CUDA without --kv-budget:
                                  settings.DEFAULT_GPU_OVERCOMMIT (4); on CPU: off (dense-equivalent)
    --wgkv-forward-tokens T       while requests decode, a forward carries them all and at most T tokens in all
                                  (prefill share at least T/4), with --enable-mixed-chunk; 0: off (SGLang's own
                                  chunks). Default on CUDA: settings.DEFAULT_GPU_FORWARD_TOKENS (8192); CPU: off
    --wgkv-running-knee K         once the running requests fill what a dense pool of the same memory holds,
                                  admit new ones only while their TPOT is under (1 + K) decode steps' fixed
                                  cost (integration/scheduling/running_knee.py); 0: off. Default on CUDA with
                                  one scheduler: settings.DEFAULT_GPU_RUNNING_KNEE (4); with TP, PP or DP
                                  (each scheduler would admit apart) and on CPU: off
    --[no-]wgkv-extend-kernels    a prefill chunk's pool moves (its cached context read for the attention,
                                  its rows written to the ring and the global pages) in Triton launches
                                  instead of torch gathers built on the host. Default: on with the kernels
                                  path (CUDA), off with the reference attention
    --wgkv-attention IMPL         auto (kernels on CUDA), reference (torch) or kernels; the kernels' decode
                                  runs under SGLang's decode CUDA graphs (off with --disable-decode-cuda-graph;
                                  always off on CPU and with reference)
    --disable-wgkv                plain SGLang (dense attention) with the same defaults; with --kv-budget,
                                  the SnapKV-only baseline (admit every token, evict to the budget)

Defaults filled in when absent: ``--model-path`` = the embedded SmolLM2-135M-Instruct
(:mod:`sglang_wgkv.embedded_model`); without CUDA ``SGLANG_USE_CPU_ENGINE=1`` and ``--device cpu``;
on CPU (also with ``--disable-wgkv``) ``--dtype float32`` where the CPU has no half-precision matmul
units (:func:`cpu_half_matmul`; SGLang's ``auto`` serves a float32 checkpoint in float16, whose linear
layers then run several times slower), ``--sleep-on-idle`` (SGLang's idle scheduler otherwise spins a
whole core, half of a two-core box) and ``--max-total-tokens`` for a KV cache of 1/8 of the RAM
(:func:`cpu_default_kv_tokens`) unless ``--max-total-tokens`` or ``--mem-fraction-static`` is given;
``--attention-backend wgkv`` (``torch_native`` on CPU with ``--disable-wgkv``).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from sglang_wgkv.config import DEFAULT_LOCAL_WINDOW, DEFAULT_TAU, WGKVConfig
from sglang_wgkv.embedded_model import SHIPPED_GATES
from sglang_wgkv.integration.plugin.settings import (
    ATTENTION_IMPLS,
    BACKEND_NAME,
    DEFAULT_GPU_FORWARD_TOKENS,
    DEFAULT_GPU_OVERCOMMIT,
    DEFAULT_GPU_RUNNING_KNEE,
    ENV_VAR,
    PREFILL_BAND,
    PREFILL_VERTICAL,
    ServingSettings,
)
from sglang_wgkv.integration.scheduling.running_knee import scheduler_split

# Default KV budget on CPU, as a fraction of the machine's RAM (see cpu_default_kv_tokens).
CPU_KV_RAM_FRACTION = 0.125
# /proc/cpuinfo flags of CPUs whose half-precision matmuls keep up with float32 (AVX512-FP16, AMX
# tiles); without them the embedded model's float16 linear layers ran 8x slower than float32
# (benchmarks/results/serving/cpu_dtype_ab.json)
CPU_HALF_MATMUL_FLAGS = ("avx512_fp16", "amx_bf16", "amx_fp16")
WGKV_FLAGS = (
    "--kv-budget",
    "--wgkv-gates",
    "--wgkv-tau",
    "--wgkv-local-window",
    "--wgkv-random-admission",
    "--wgkv-seed",
    "--wgkv-attention",
    "--wgkv-overcommit",
    "--wgkv-decode-launch",
    "--wgkv-extend-kernels",
    "--no-wgkv-extend-kernels",
    "--wgkv-forward-tokens",
    "--wgkv-prefill-vertical",
    "--wgkv-prefill-band",
    "--wgkv-running-knee",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_wgkv.launch_server",
        allow_abbrev=False,
        description="SGLang server with Write-Gated KV. Unknown arguments are passed to SGLang.",
    )
    parser.add_argument("--kv-budget", type=int, default=None)
    parser.add_argument("--wgkv-gates", default=None)
    parser.add_argument("--wgkv-tau", type=float, default=DEFAULT_TAU)
    parser.add_argument("--wgkv-local-window", type=int, default=DEFAULT_LOCAL_WINDOW)
    parser.add_argument("--wgkv-random-admission", type=float, default=None)
    parser.add_argument("--wgkv-seed", type=int, default=0)
    parser.add_argument("--wgkv-attention", choices=ATTENTION_IMPLS, default="auto")
    parser.add_argument("--wgkv-overcommit", type=float, default=None)
    parser.add_argument("--wgkv-decode-launch", default="")
    parser.add_argument("--wgkv-extend-kernels", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--wgkv-forward-tokens", type=int, default=None)
    parser.add_argument("--wgkv-prefill-vertical", choices=PREFILL_VERTICAL, default="auto")
    parser.add_argument("--wgkv-prefill-band", choices=PREFILL_BAND, default="triton")
    parser.add_argument("--wgkv-running-knee", type=float, default=None)
    parser.add_argument("--disable-wgkv", action="store_true")
    return parser


TP_FLAGS = ("--tp-size", "--tp", "--tensor-parallel-size")  # SGLang's spellings (ServerArgs' aliases)


def _option(argv: list[str], *names: str) -> str | None:
    """Value of the last of ``names`` in ``argv`` (``--x v`` or ``--x=v``), else None: the one argparse
    keeps when an option is repeated (``--dtype float32 ... --dtype bfloat16`` is served as bfloat16,
    so it must not be refused as float32)."""
    found = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def _model_shape(model_path: str) -> tuple[int, int, int] | None:
    """(layers, kv heads, head_dim) of a local HF model directory, or None if not local."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def cpu_default_kv_tokens(
    model_path: str, sglang_argv: list[str], ram_bytes: int | None = None
) -> int | None:
    """The CPU default KV budget: the tokens whose K/V fill :data:`CPU_KV_RAM_FRACTION` of the RAM
    (None for a model that is not a local directory: SGLang's own default then).

    SGLang sizes a CPU KV cache from the memory available when it starts, less a slack for
    activations: on a 24 GB machine 16-17 GB of KV for a 135M model, and the server's processes
    and a long prompt's activations then come within ~2 GB of the RAM (upstream's peak 21.5 GB of
    23). A fixed fraction of the RAM leaves the rest to the processes, the activations and the
    machine's other users; ``--max-total-tokens`` or ``--mem-fraction-static`` override it."""
    shape = _model_shape(model_path)
    if shape is None:
        return None
    layers, kv_heads, head_dim = shape
    dtype = _option(sglang_argv, "--kv-cache-dtype")
    if dtype in (None, "auto"):
        dtype = _option(sglang_argv, "--dtype")
    dtype_bytes = 4 if dtype in ("float32", "float") else 1 if dtype in ("fp8_e4m3", "fp8_e5m2") else 2
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if ram_bytes is None else ram_bytes
    return int(ram * CPU_KV_RAM_FRACTION) // (2 * layers * kv_heads * head_dim * dtype_bytes)


def cpu_half_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has half-precision matmul units (:data:`CPU_HALF_MATMUL_FLAGS`); False where
    ``cpuinfo`` cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return False
    return any(flag in flags for flag in CPU_HALF_MATMUL_FLAGS)


def check_gates(path: str, model_path: str, local_window: int) -> None:
    """Load the gate checkpoint and check it against the model and the served W_local; ValueError
    with the reason."""
    from sglang_wgkv.gate import load_gates
    from sglang_wgkv.gate.checkpoint import check_served_window

    if not os.path.exists(path):
        raise ValueError(f"{path}: no such gate checkpoint")
    gates = load_gates(path)
    check_served_window(path, gates.config, local_window)
    shape = _model_shape(model_path)
    if shape is not None:
        try:
            gates.check_model(*shape)
        except ValueError as e:
            raise ValueError(f"{path} does not fit {model_path}: {e}") from e


def resolve(argv: list[str]) -> tuple[ServingSettings | None, list[str], dict[str, str]]:
    """Split our options from SGLang's and fill in defaults.

    Returns the WG-KV settings (None with ``--disable-wgkv``), SGLang's argv and environment
    variables to set. Raises ValueError with a user-facing message on invalid options.
    """
    import torch

    ours, sglang_argv = build_parser().parse_known_args(argv)
    env: dict[str, str] = {}
    model_path = _option(sglang_argv, "--model-path", "--model")
    embedded = model_path is None
    if embedded:
        from sglang_wgkv.embedded_model import ensure_embedded_model

        model_path = str(ensure_embedded_model())
        sglang_argv = ["--model-path", model_path, *sglang_argv]
    device = _option(sglang_argv, "--device")
    if device is None and not torch.cuda.is_available():
        device = "cpu"
        sglang_argv += ["--device", "cpu"]
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # OpenMP threads sleep when idle instead of spinning: spinning threads starve a server that
        # shares a small box with another busy process, and sleeping ones cost nothing when it runs
        # alone. A user's own OMP_WAIT_POLICY wins.
        env.setdefault("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        tp = int(_option(sglang_argv, *TP_FLAGS) or 1)
        if tp > 1:
            # SGLang's CPU engine binds one OpenMP core set per rank (default: one NUMA node per rank),
            # and with torch's CUDA build it would pick up the bundled libnccl on a CPU device.
            cores = os.cpu_count() or 1
            env.setdefault(
                "SGLANG_CPU_OMP_THREADS_BIND",
                os.environ.get("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(tp))),
            )
            env.setdefault(
                "SGLANG_NCCL_SO_PATH", os.environ.get("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
            )
        if _option(sglang_argv, "--dtype") is None and not cpu_half_matmul():
            sglang_argv += ["--dtype", "float32"]
        if "--sleep-on-idle" not in sglang_argv:  # an idle scheduler otherwise busy-polls a whole core
            sglang_argv.append("--sleep-on-idle")
        if _option(sglang_argv, "--max-total-tokens", "--mem-fraction-static") is None:
            tokens = cpu_default_kv_tokens(model_path, sglang_argv)
            if tokens is not None:
                sglang_argv += ["--max-total-tokens", str(tokens)]
    if device != "cpu" and _option(sglang_argv, "--dtype") in ("float32", "float"):
        # upstream fails the same way; refused here before minutes of start-up instead
        raise ValueError(
            "--dtype float32 is not served on CUDA: SGLang 0.5.17's CUDA RMSNorm "
            "(sgl_kernel.rmsnorm) has no float32 kernel, and the server would die at its first "
            "forward; use bfloat16 or float16 there"
        )
    if device == "cpu" and ours.wgkv_prefill_vertical == "fa3":
        raise ValueError("--wgkv-prefill-vertical fa3 needs a Hopper GPU (FA3); this server runs on the CPU")
    if device == "cpu" and ours.wgkv_prefill_band == "fa3":
        raise ValueError("--wgkv-prefill-band fa3 needs a Hopper GPU (FA3); this server runs on the CPU")
    backend = _option(sglang_argv, "--attention-backend")

    snapkv_only = ours.disable_wgkv and ours.kv_budget is not None
    if ours.disable_wgkv and not snapkv_only:
        given = [flag for flag in WGKV_FLAGS if any(a == flag or a.startswith(flag + "=") for a in argv)]
        if given:
            raise ValueError(f"{', '.join(given)} configure WG-KV; drop them or drop --disable-wgkv")
        if backend == BACKEND_NAME:
            raise ValueError(f"--disable-wgkv contradicts --attention-backend {BACKEND_NAME}")
        if backend is None and device == "cpu":
            sglang_argv += ["--attention-backend", "torch_native"]
        return None, sglang_argv, env

    if snapkv_only:
        # The paper's SnapKV-only baseline: every token is written (admission off), the evictor
        # alone enforces the budget. It needs the dual pool, so it runs on the wgkv backend.
        given = [
            flag
            for flag in WGKV_FLAGS
            if flag != "--kv-budget" and any(a == flag or a.startswith(flag + "=") for a in argv)
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} configure admission; --disable-wgkv --kv-budget is SnapKV alone"
            )
        ours.wgkv_random_admission, ours.wgkv_gates = 1.0, "fresh"
    try:
        config = WGKVConfig(
            local_window=ours.wgkv_local_window,
            tau=ours.wgkv_tau,
            random_admission=ours.wgkv_random_admission,
            kv_budget=ours.kv_budget,
        )
    except ValueError as e:
        raise ValueError(f"invalid WG-KV option: {e}") from e
    workers = _option(sglang_argv, "--tokenizer-worker-num")
    if workers is not None and workers.isdigit() and int(workers) > 1:
        # SGLang's extra tokenizer workers are fresh processes that never load plugins: requests they
        # take would skip WG-KV's request checks (custom_params.wgkv, sampling params, token ids).
        raise ValueError(
            f"--tokenizer-worker-num {workers} is not supported with WG-KV (SGLang's extra "
            "tokenizer workers load no plugins, so per-request checks would not run); use 1"
        )
    if backend is None:
        sglang_argv += ["--attention-backend", BACKEND_NAME]
    elif backend != BACKEND_NAME:
        raise ValueError(
            f"WG-KV runs with --attention-backend {BACKEND_NAME}, got {backend} "
            "(use --disable-wgkv for plain SGLang)"
        )
    if ours.wgkv_gates is None and embedded:
        ours.wgkv_gates = str(SHIPPED_GATES)
    if ours.wgkv_gates not in (None, "fresh"):
        check_gates(ours.wgkv_gates, model_path, config.local_window)
        gates_path = os.path.abspath(ours.wgkv_gates)
    else:
        gates_path = None
    overcommit = ours.wgkv_overcommit
    if overcommit is None and device != "cpu" and config.kv_budget is None:
        overcommit = DEFAULT_GPU_OVERCOMMIT  # admit by the post-admission footprint (settings.py)
    forward_tokens = ours.wgkv_forward_tokens
    if forward_tokens is None and device != "cpu":
        forward_tokens = DEFAULT_GPU_FORWARD_TOKENS  # decodes ride in every forward (mixed_batches.py)
    if forward_tokens == 0:
        forward_tokens = None
    elif forward_tokens is not None and "--enable-mixed-chunk" not in sglang_argv:
        sglang_argv += ["--enable-mixed-chunk"]
    split = scheduler_split(
        *(
            int(_option(sglang_argv, *flags) or 1)
            for flags in (
                TP_FLAGS,
                ("--pp-size", "--pipeline-parallel-size"),
                ("--dp-size", "--dp", "--data-parallel-size"),
            )
        )
    )
    running_knee = ours.wgkv_running_knee
    if running_knee is None and device != "cpu" and not split:
        running_knee = DEFAULT_GPU_RUNNING_KNEE  # TPOT-bounded admission past a dense pool's count
    running_knee = running_knee or None  # 0: off
    if running_knee is not None and split:
        raise ValueError(f"invalid WG-KV option: --wgkv-running-knee runs on one scheduler, got {split}")
    extend_kernels = ours.wgkv_extend_kernels
    # the torch path's host-built context index costs a late W0 chunk ~0.45 s (kernels/extend_step_w0_h100.json)
    if extend_kernels is None:
        extend_kernels = device != "cpu" and ours.wgkv_attention != "reference"
    try:
        settings = ServingSettings(
            config=config,
            gates_path=gates_path,
            seed=ours.wgkv_seed,
            attention=ours.wgkv_attention,
            overcommit=overcommit,
            decode_launch=ours.wgkv_decode_launch,
            extend_kernels=extend_kernels,
            forward_tokens=forward_tokens,
            prefill_vertical=ours.wgkv_prefill_vertical,
            prefill_band=ours.wgkv_prefill_band,
            running_knee=running_knee,
        )
    except ValueError as e:
        raise ValueError(f"invalid WG-KV option: {e}") from e
    from sglang_wgkv.integration.pools.kv_dtype import kv_cache_dtype_problem

    problem = kv_cache_dtype_problem(_option(sglang_argv, "--kv-cache-dtype"))
    if problem:
        raise ValueError(f"WG-KV does not serve {problem}")
    env[ENV_VAR] = settings.to_env()
    return settings, sglang_argv, env


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings, sglang_argv, env = resolve(argv)
    except ValueError as e:
        build_parser().error(str(e))
    if settings is not None and not any(
        ep.name == BACKEND_NAME for ep in entry_points(group="sglang.srt.plugins")
    ):
        build_parser().error(
            "the sglang-wgkv package is not installed (its SGLang plugin entry point is "
            "missing); run scripts/setup.sh or `pip install -e .`"
        )
    os.environ.update(env)
    if settings is None:
        os.environ.pop(ENV_VAR, None)

    # SGLang reads SGLANG_USE_CPU_ENGINE at import time: import it only now.
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
