"""WG-KV server settings, handed from the launcher to SGLang's scheduler subprocesses.

SGLang's ``ServerArgs`` has no room for plugin options and its scheduler processes are spawned, so
:mod:`sglang_wgkv.launch_server` serializes a :class:`ServingSettings` into the environment variable
:data:`ENV_VAR`, which every spawned process inherits. It is parsed in three places only: once when
the server arguments are prepared (the launcher: a malformed value fails there), once per
scheduler process, into its :class:`~sglang_wgkv.integration.plugin.runtime.WGKVRuntime`, which every other
part reads, and once in the tokenizer manager for the served W_local and ``--kv-budget`` that a
request's ``kv_budget`` is checked against (:func:`~sglang_wgkv.integration.requests.control.check_request_budget`). A process that finds no variable (e.g. a plain ``python -m sglang.launch_server
--attention-backend wgkv``) uses the defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from sglang_wgkv.config import WGKVConfig

ENV_VAR = "SGLANG_WGKV_SETTINGS"
BACKEND_NAME = "wgkv"
ATTENTION_IMPLS = ("auto", "reference", "kernels")
PREFILL_VERTICAL = ("auto", "fa3", "triton")
PREFILL_BAND = ("triton", "fa3")


# The launcher's overcommit on CUDA when admission is on (no --kv-budget): requests are admitted by
# their post-admission footprint up to 4x a dense pool's (25% admitted fills the pool exactly).
DEFAULT_GPU_OVERCOMMIT = 4.0

# The launcher's forward token budget on CUDA (--wgkv-forward-tokens, integration/scheduling/mixed_batches.py): while
# requests decode, a forward carries them all and at most this many tokens in all, with mixed batches on.
# SGLang's own chunk on Hopper: of 2048, 4096, 8192 and 0 it gave the most output tokens/s, the lowest
# median TTFT of the mixed settings and the lowest median end-to-end latency on M1D
# (benchmarks/results/serving/M1D_forward_tokens_ab.json).
DEFAULT_GPU_FORWARD_TOKENS = 8192

# The launcher's running knee on CUDA with one scheduler (--wgkv-running-knee, integration/scheduling/
# running_knee.py): past a dense pool's running count, admit while TPOT stays under 5 decode steps' fixed
# cost. On prompt-heavy traffic that holds the batch at the dense count, where the output rate has
# saturated: at K = 8 M1D ran ~190 requests for the rate of a cap at 128 and 1.37x its TPOT
# (serving/M1D_running_tpot_ab.json, M1D_cap128_ab.json; serving/knee_sim.json: K <= 4 holds at the
# dense count); a workload whose decode dominates (W3) stays under the target and runs as without it.
DEFAULT_GPU_RUNNING_KNEE = 4.0

# MiB of GPU memory by which the wgkv backend lowers SGLang's own choice of --mem-fraction-static (none
# given; hooks.reserve_gpu_memory), for what it holds outside the static pool: SGLang sets nothing aside
# for prefill CUDA graphs, which wgkv turns off, and the allocator arrays over overcommit's larger logical
# pool and the extend transients live outside it. With this reserve the wgkv server peaks below upstream's
# --disable-wgkv --attention-backend flashinfer (benchmarks/results/serving/memory_{wgkv,upstream}_h200.json).
GPU_RESERVE_MIB = 2048


@dataclass(frozen=True)
class ServingSettings:
    """Parameters
    ----------
    config : admission parameters (W_local, tau, random admission, kv budget).
    gates_path : gate checkpoint (directory or official ``.pt``); None = fresh gates, which admit
        every token (output bias 3.0, g ~ 0.95 >= tau).
    seed : seeds the fresh gates and the random-admission generator (reproducible runs).
    attention : ``reference`` (torch, any device), ``kernels`` (Triton prefill and decode, CUDA,
        fp16/bf16; decode runs under SGLang's CUDA graphs) or ``auto`` (kernels where they fit,
        reference otherwise).
    overcommit : if set (> 1), the logical pool and request slots are this many times the
        dense-equivalent ones and the scheduler guards the physical pool (:mod:`~sglang_wgkv.integration.scheduling.overcommit`).
        The launcher's default on CUDA with admission on and no ``--kv-budget``:
        :data:`DEFAULT_GPU_OVERCOMMIT`.
    decode_launch : the kernels path's decode split-kernel launch shape,
        ``DecodeConfig.parse``'s spec (``""``: its defaults); for measuring launch shapes in service.
    extend_kernels : the kernels path's pool moves a prefill chunk's rows with Triton launches
        (``DualCachePool(triton_extend=True)``); the launcher's default on CUDA (the torch path builds
        each chunk's context index on the host, which grows with the context).
    prefill_vertical : who runs the kernels path's prefill over the admitted keys before each query
        block's band (:mod:`~sglang_wgkv.integration.backend.prefill_vertical`): ``fa3`` (FA3, Hopper,
        every extend), ``triton`` (the one-pass Triton kernel) or ``auto``, the default (FA3 where it loads
        and passes the start-up check, for forwards with a long key range; Triton otherwise).
    prefill_band : who runs the local window of prefills
        (:mod:`~sglang_wgkv.integration.backend.prefill_band`): ``triton`` (the band launch, the default)
        or ``fa3`` (FA3's sliding window, Hopper; the band launch then adds only the admitted keys).
    forward_tokens : while requests decode, a forward's tokens (prefill share + decode rows,
        :class:`~sglang_wgkv.integration.scheduling.mixed_batches.ForwardBudget`); None: SGLang's own chunk
        sizes. The launcher's default on CUDA: :data:`DEFAULT_GPU_FORWARD_TOKENS`, with
        ``--enable-mixed-chunk``.
    running_knee : ``K`` of :mod:`~sglang_wgkv.integration.scheduling.running_knee` (past the dense pool's
        running count, new requests wait while TPOT exceeds ``(1 + K)`` decode steps' fixed cost); None:
        off (the default until served runs choose ``K``). One scheduler only (no TP, PP or DP).
    """

    config: WGKVConfig = field(default_factory=WGKVConfig)
    gates_path: str | None = None
    seed: int = 0
    attention: str = "auto"
    overcommit: float | None = None
    decode_launch: str = ""
    extend_kernels: bool = False
    forward_tokens: int | None = None
    prefill_vertical: str = "auto"
    prefill_band: str = "triton"
    running_knee: float | None = None

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if self.overcommit is not None and not self.overcommit > 1:
            raise ValueError(f"overcommit must be > 1, got {self.overcommit}")
        if self.overcommit is not None and self.config.kv_budget is not None:
            raise ValueError(
                "overcommit and kv_budget exclude each other (kv_budget has its own bounded split)"
            )
        if self.decode_launch:
            from sglang_wgkv.attention.decode_config import DecodeConfig

            DecodeConfig.parse(self.decode_launch)  # ValueError naming the field
        if self.forward_tokens is not None:
            from sglang_wgkv.integration.scheduling.mixed_batches import ForwardBudget

            ForwardBudget(self.forward_tokens)  # ValueError naming the bound
        if self.prefill_vertical not in PREFILL_VERTICAL:
            raise ValueError(
                f"prefill_vertical must be one of {PREFILL_VERTICAL}, got {self.prefill_vertical!r}"
            )
        if self.prefill_vertical == "fa3" and self.attention == "reference":
            raise ValueError("prefill_vertical 'fa3' needs the kernels path (attention 'kernels' or 'auto')")
        if self.prefill_band not in PREFILL_BAND:
            raise ValueError(f"prefill_band must be one of {PREFILL_BAND}, got {self.prefill_band!r}")
        if self.prefill_band == "fa3" and self.attention == "reference":
            raise ValueError("prefill_band 'fa3' needs the kernels path (attention 'kernels' or 'auto')")
        if self.running_knee is not None and not self.running_knee > 0:
            raise ValueError(f"running_knee must be > 0 (or None: off), got {self.running_knee}")
        if self.extend_kernels and self.attention == "reference":
            raise ValueError("extend_kernels needs the kernels path (attention 'kernels' or 'auto')")

    def decode_graph_blocker(self, device: str | None, dtype: str | None = None) -> str | None:
        """Why the ``wgkv`` decode cannot run under SGLang's CUDA graphs with SGLang's ``--device`` and
        ``--dtype`` (None: auto-detected), or None when it can (kernels path on CUDA; any served KV
        dtype, FP8 included)."""
        import torch

        if device not in (None, "cuda") or (device is None and not torch.cuda.is_available()):
            return f"device {device or 'cpu'}"
        if self.attention == "reference" or (self.attention == "auto" and dtype in ("float32", "float")):
            return "the reference attention syncs with the host every layer"
        return None

    def to_env(self) -> str:
        return json.dumps(
            {
                "config": asdict(self.config),
                "gates_path": self.gates_path,
                "seed": self.seed,
                "attention": self.attention,
                "overcommit": self.overcommit,
                "decode_launch": self.decode_launch,
                "extend_kernels": self.extend_kernels,
                "forward_tokens": self.forward_tokens,
                "prefill_vertical": self.prefill_vertical,
                "prefill_band": self.prefill_band,
                "running_knee": self.running_knee,
            }
        )

    @classmethod
    def from_env(cls, environ=None) -> ServingSettings:
        """Settings from :data:`ENV_VAR` (defaults when unset); ValueError on a malformed value."""
        raw = (environ if environ is not None else os.environ).get(ENV_VAR)
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
            return cls(
                config=WGKVConfig(**data["config"]),
                gates_path=data.get("gates_path"),
                seed=int(data.get("seed", 0)),
                attention=data.get("attention", "auto"),
                overcommit=data.get("overcommit"),
                decode_launch=data.get("decode_launch", ""),
                extend_kernels=bool(data.get("extend_kernels", False)),
                forward_tokens=data.get("forward_tokens"),
                prefill_vertical=data.get("prefill_vertical", "auto"),
                prefill_band=data.get("prefill_band", "triton"),
                running_knee=data.get("running_knee"),
            )
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"malformed {ENV_VAR}={raw!r}: {e}") from e
