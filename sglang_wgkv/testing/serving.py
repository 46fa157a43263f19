"""A real ``python -m sglang_wgkv.launch_server`` process for the serving tests.

Servers run on CPU in float32 with a small KV budget (fast start-up, exhaustion reachable), strict
idle memory checks (SGLang's ``available + evictable == total`` and the dual pool's idle check raise
inside the scheduler, so a leak kills the server and the next request fails).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import requests

from sglang_wgkv.server_process import LAUNCHER, ServerProcess, free_port
from sglang_wgkv.testing.lean import lean_server_env

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = float(os.environ.get("WGKV_TEST_STARTUP_TIMEOUT", "420"))
# --sleep-on-idle: an idle scheduler otherwise busy-polls a whole core (two servers share 2 cores).
# --skip-server-warmup: wait_healthy's /health_generate runs a generation of its own.
BASE_ARGS = (
    "--dtype", "float32", "--max-total-tokens", "2048", "--log-level", "warning", "--sleep-on-idle",
    "--skip-server-warmup",
)  # fmt: skip
# Stopping a server kills its scheduler, which SGLang's launcher takes for a crash: without these it
# sleeps 5 s for py-spy and CUDA core dumps before it exits.
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# SGLang's model modules the test servers load: their models (the embedded one, its short cut, the
# GPU tests' Llama) are all LlamaForCausalLM.
TEST_MODEL_MODULES = ("llama",)


@functools.cache
def only_test_models_env() -> dict[str, str]:
    """``SGLANG_DISABLED_MODEL_ARCHS`` naming every SGLang model module but :data:`TEST_MODEL_MODULES`:
    a scheduler otherwise imports all of them to find one class."""
    from importlib.util import find_spec

    models = Path(find_spec("sglang").submodule_search_locations[0]) / "srt" / "models"
    others = sorted(p.stem for p in models.glob("*.py") if p.stem not in (*TEST_MODEL_MODULES, "__init__"))
    return {"SGLANG_DISABLED_MODEL_ARCHS": ",".join(others)}


HEALTH_POLL_S = 0.25
BASE_DTYPE_BYTES = 4  # BASE_ARGS' float32: the pool's per-slot state costs half as many tokens as in bf16


class Server(ServerProcess):
    """One ``sglang_wgkv.launch_server`` process with the test settings; ``url`` once
    :meth:`wait_healthy` returned. ``port`` 0: a free one (another: e.g. a restart on the same URL)."""

    def __init__(
        self, args: list[str], log_path: Path, env: dict | None = None, base_args=BASE_ARGS, port: int = 0
    ):
        port = port or free_port()
        full_env = {
            **os.environ,
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
            **QUIET_STOP_ENV,
            **only_test_models_env(),
            **lean_server_env(),
            **(env or {}),
        }
        super().__init__(
            [*LAUNCHER, *base_args, "--port", str(port), *args], log_path, port=port, env=full_env, cwd=REPO
        )

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        super().wait_healthy(timeout, poll_s=HEALTH_POLL_S)
        return self

    # -- API helpers ----------------------------------------------------------------------------
    def generate(self, text, max_new_tokens: int = 16, timeout: float = 600, **extra) -> dict | list:
        body = {
            "text": text,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                **extra.pop("sampling_params", {}),
            },
            **extra,
        }
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def wgkv_stats(self) -> dict:
        r = requests.get(self.url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["wgkv"]

    def wait_idle_checked(self, timeout: float = 60) -> dict:
        """Stats once the scheduler, idle, checked the pool after the last request ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.wgkv_stats()
            if stats["active_requests"] == 0 and stats["idle_checked_released"] == stats["requests_released"]:
                return stats
            time.sleep(0.5)
        raise TimeoutError(f"scheduler not idle-checked after {timeout} s: {stats}")


def flush_cache(server) -> None:
    """``/flush_cache``, retried while the server still holds running requests (it refuses then)."""
    for _ in range(60):
        if requests.post(server.url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.5)
    raise TimeoutError("flush_cache refused for 30 s")


def stream_generate(server, rid, prompt, max_new_tokens, abort_after, results, timeout=900):
    """Stream one greedy ``/generate`` request into ``results[rid]`` (its last ``meta_info``); with
    ``abort_after`` chunks received, abort it through ``/abort_request``."""
    body = {
        "text": prompt,
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    chunks, last = 0, None
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks, last = chunks + 1, line
                if chunks == abort_after:
                    requests.post(
                        server.url + "/abort_request", json={"rid": rid}, timeout=60
                    ).raise_for_status()
    results[rid] = json.loads(last[len(b"data:") :])["meta_info"]


def embedded_model_dir() -> str:
    """The embedded SmolLM2's converted directory; skips the calling test when its GGUF is not installed."""
    import pytest

    from sglang_wgkv.embedded_model import ensure_embedded_model, find_gguf

    try:
        find_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"embedded model not installed: {e}")
    return str(ensure_embedded_model())


def long_prompt(n_items: int, seed: int = 0) -> str:
    """A deterministic list-like prompt, about 12 tokens per item."""
    colors, things = ["red", "blue", "green", "old", "new"], ["car", "house", "tree", "river", "book"]
    items = [
        f"Item {i}: the {colors[(i + seed) % 5]} {things[(3 * i + seed) % 5]} number {(7 * i + seed) % 13}."
        for i in range(n_items)
    ]
    return " ".join(items) + " Which item mentions a river first?"


def shipped_gates_at(path: Path, local_window: int, num_layers: int | None = None) -> Path:
    """A copy of the shipped embedded-model gates (trained with W_local = 256) declared for
    ``local_window``: the server refuses a checkpoint trained for another window, and the CPU tests
    run the trained gates with small windows so that prompts of a few hundred tokens leave the ring.
    ``num_layers``: only the first layers' gates (for :mod:`~sglang_wgkv.testing.short_model`)."""
    import dataclasses
    import json
    import shutil

    from sglang_wgkv.embedded_model import SHIPPED_GATES
    from sglang_wgkv.gate import WriteGates, load_gates, save_gates
    from sglang_wgkv.gate.checkpoint import CONFIG_FILE

    shutil.copytree(SHIPPED_GATES, path)
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**config, "local_window": local_window}, indent=2) + "\n")
    if num_layers is not None:
        full = load_gates(path)
        cut = WriteGates(dataclasses.replace(full.config, num_layers=num_layers))
        for mine, theirs in zip(cut.layers, full.layers):
            mine.load_state_dict(theirs.state_dict())
        shutil.rmtree(path)
        save_gates(cut, path)
    return path


def embedded_plan(budget_tokens: int, dtype_bytes: int = BASE_DTYPE_BYTES, **options):
    """The capacity plan (``integration/pools/capacity.py``) a CPU server of the embedded model (30 layers,
    9 query / 3 KV heads of 64, context 8192) makes of ``--max-total-tokens budget_tokens`` in a
    ``dtype_bytes`` KV dtype (default: the float32 of :data:`BASE_ARGS`; the per-slot state is
    counted in dense tokens of that dtype); ``options``: plan_capacity's keywords (local_window,
    kv_budget, ...)."""
    from sglang_wgkv.integration.pools.capacity import plan_capacity
    from sglang_wgkv.integration.pools.slot_costs import ModelShape

    shape = ModelShape(
        num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, context_len=8192, dtype_bytes=dtype_bytes
    )
    return plan_capacity(budget_tokens, 10**6, shape=shape, **options)


def save_head_gates(
    path: Path, head_bias, local_window: int, num_layers: int = 30, head_dim: int = 64
) -> Path:
    """Gates whose output bias per KV head is ``head_bias`` in every layer: +30 admits every token
    (sigmoid = 1), -30 none. Defaults: the embedded model (30 layers, 3 KV heads, head_dim 64)."""
    import torch

    from sglang_wgkv.gate import GateConfig, WriteGates, save_gates

    gates = WriteGates(
        GateConfig(
            num_layers=num_layers, num_kv_heads=len(head_bias), head_dim=head_dim, local_window=local_window
        )
    )
    with torch.no_grad():
        for layer in gates.layers:
            layer.b2.copy_(torch.tensor(head_bias, dtype=torch.float32))
    return save_gates(gates, path)


class OfflineTruth:
    """What a served request's output logprobs are in float32, computed offline: the model's HF copy
    (``model_dir``) under the same gates, tau and W_local (``evals.harness.teacher_forced_logprobs``),
    each prompt tokenized as the server does and its served output tokens teacher-forced. On CPU the
    float32 reference server matches it to ~1e-5 (tests/test_served_matches_offline.py), so a bf16
    path's distance from it is that path's own error, along its own tokens (no shared prefix needed).
    Also the GPU tests' float32 truth: SGLang's CUDA RMSNorm has no float32 kernel (a float32 server
    dies at its first forward)."""

    def __init__(self, model_dir, gates_dir, local_window: int, device="cpu", tau: float | None = None):
        import torch
        from transformers import AutoTokenizer

        from evals.policies import WGKVAdmission
        from sglang_wgkv.config import DEFAULT_TAU
        from sglang_wgkv.gate import load_gates
        from sglang_wgkv.training.backbone import load_backbone

        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.backbone = load_backbone(str(model_dir), torch.float32, device)
        self.policy = WGKVAdmission(
            load_gates(gates_dir, device), DEFAULT_TAU if tau is None else tau, local_window
        )

    def with_window(self, local_window: int) -> OfflineTruth:
        """The same truth (model, gates, tau) under another W_local, without loading the model again."""
        import copy

        from evals.policies import WGKVAdmission

        other = copy.copy(self)
        other.policy = WGKVAdmission(self.policy.gates, self.policy.tau, local_window)
        return other

    def logprobs(self, prompt: str, output_ids) -> list[float]:
        """Float32 logprob of each output token given the prompt and the output tokens before it."""
        return self.logprobs_ids(self.tokenizer.encode(prompt), output_ids)

    def logprobs_ids(self, prompt_ids, output_ids) -> list[float]:
        """:meth:`logprobs` of a prompt given as token ids."""
        import torch

        from evals.harness import teacher_forced_logprobs

        ids = torch.tensor([*prompt_ids, *output_ids], device=self.device)
        return teacher_forced_logprobs(self.backbone, ids, self.policy, len(prompt_ids))
