"""A gate checkpoint that does not fit the model, or is corrupt, stops the server from starting with a
clear message: in our launcher (before SGLang starts) and in SGLang's scheduler (for servers started
with ``python -m sglang.launch_server --attention-backend wgkv``)."""

import os
import subprocess
import sys

import pytest

from sglang_wgkv.testing.serving import REPO, free_port

pytestmark = pytest.mark.serving


@pytest.fixture(scope="module")
def bad_gates(tmp_path_factory):
    from sglang_wgkv.gate import GateConfig, WriteGates, save_gates

    tmp = tmp_path_factory.mktemp("bad_gates")
    save_gates(WriteGates(GateConfig(num_layers=2, num_kv_heads=3, head_dim=64)), tmp / "two_layers")
    save_gates(WriteGates(GateConfig(num_layers=30, num_kv_heads=3, head_dim=64)), tmp / "thirty_layers")
    corrupt = save_gates(WriteGates(GateConfig(num_layers=30, num_kv_heads=3, head_dim=64)), tmp / "corrupt")
    (corrupt / "gates.safetensors").write_bytes(b"\x00garbage" * 10)
    return tmp


def _launch(args, env=None, module="sglang_wgkv.launch_server", timeout=300):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "name, message",
    [
        ("two_layers", r"expected (layers, kv_heads, head_dim) = (30, 3, 64), found (2, 3, 64)"),
        ("corrupt", "corrupt gate weights"),
    ],
)
def test_launcher_refuses_bad_gate_file(bad_gates, name, message):
    proc = _launch(["--wgkv-gates", str(bad_gates / name), "--port", str(free_port())], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Uvicorn running" not in proc.stderr + proc.stdout


def test_scheduler_refuses_mismatched_gates(bad_gates):
    """The 30-layer gates on the short model (the embedded model's first two layers: a quick load)."""
    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.integration.plugin.settings import ENV_VAR, ServingSettings
    from sglang_wgkv.testing.lean import hidden_modules_env
    from sglang_wgkv.testing.serving import QUIET_STOP_ENV, only_test_models_env
    from sglang_wgkv.testing.short_model import SHORT_LAYERS, short_model_dir

    settings = ServingSettings(config=WGKVConfig(), gates_path=str(bad_gates / "thirty_layers"))
    proc = _launch(
        [
            "--model-path",
            str(short_model_dir(SHORT_LAYERS)),
            "--device",
            "cpu",
            "--attention-backend",
            "wgkv",
            "--max-total-tokens",
            "2048",
            "--port",
            str(free_port()),
        ],
        # the scheduler's exit is a crash to SGLang's launcher: no 5-s wait for crash diagnostics; the
        # scheduler imports only the model module it loads, no process the unused packages (its
        # scheduler is still spawned: it loads the plugin itself)
        env={
            ENV_VAR: settings.to_env(),
            "SGLANG_USE_CPU_ENGINE": "1",
            **QUIET_STOP_ENV,
            **only_test_models_env(),
            **hidden_modules_env(),
        },
        module="sglang.launch_server",
    )
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "does not match the model" in log and "found (30, 3, 64)" in log, log[-3000:]
