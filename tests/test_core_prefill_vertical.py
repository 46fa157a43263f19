"""``--wgkv-prefill-vertical``: who runs the prefill's vertical range (FA3 or the Triton kernel), as
the backend chooses it at start-up (integration/backend/prefill_vertical.py) and as the launcher
refuses what cannot serve. The FA3 path's values are checked under the interpreter
(test_triton_fa3_vertical_interp.py, which also runs the start-up check) and on a GPU
(test_gpu_attention.py)."""

import logging

import pytest
import torch

from sglang_wgkv.integration.backend.prefill_vertical import (
    LOG_FA3,
    LOG_TRITON,
    choose_fa3,
    vertical_from_log,
)
from sglang_wgkv.integration.plugin.settings import ServingSettings

pytestmark = pytest.mark.core
CPU = torch.device("cpu")
SHAPE = (8, 2, 64)


def _never_loaded(device):
    raise AssertionError("triton must not load FA3")


def test_triton_never_loads_fa3():
    assert choose_fa3("triton", CPU, torch.bfloat16, SHAPE, load=_never_loaded) is None


def test_auto_falls_back_with_a_warning_and_fa3_refuses(caplog):
    """FA3 missing (no Hopper GPU, no sgl_kernel.flash_attn) or failing its start-up check: ``auto``
    serves with the Triton kernel and says why; ``fa3`` refuses to start with the reason."""
    with caplog.at_level(logging.WARNING):
        assert choose_fa3("auto", CPU, torch.bfloat16, SHAPE, load=lambda d: None) is None
    assert "does not load" in caplog.text
    with pytest.raises(RuntimeError, match="prefill-vertical fa3: sgl_kernel's FA3 does not load"):
        choose_fa3("fa3", CPU, torch.bfloat16, SHAPE, load=lambda d: None)

    def broken(**kwargs):
        raise RuntimeError("no kernel image is available")

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert choose_fa3("auto", CPU, torch.bfloat16, SHAPE, load=lambda d: broken) is None
    assert "start-up check failed" in caplog.text
    with pytest.raises(RuntimeError, match="start-up check failed"):
        choose_fa3("fa3", CPU, torch.bfloat16, SHAPE, load=lambda d: broken)


def test_settings_and_launcher(monkeypatch):
    """The setting travels to the schedulers; ``fa3`` is refused with the reference attention and on
    a CPU server, before any start-up; a bad value names the choices."""
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(["--model-path", "/m"])[0].prefill_vertical == "auto"
    settings, _, env = resolve(["--model-path", "/m", "--wgkv-prefill-vertical", "triton"])
    assert settings.prefill_vertical == "triton" and ServingSettings.from_env(env) == settings
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        resolve(["--model-path", "/m", "--wgkv-prefill-vertical", "fa3"])
    with pytest.raises(ValueError, match="needs the kernels path"):
        ServingSettings(attention="reference", prefill_vertical="fa3")
    with pytest.raises(ValueError, match="prefill_vertical must be one of"):
        ServingSettings(prefill_vertical="flashinfer")
    with pytest.raises(SystemExit):
        resolve(["--model-path", "/m", "--wgkv-prefill-vertical", "flashinfer"])


def test_the_choice_is_read_back_from_the_server_log(caplog):
    """served_speed.py records who ran the vertical range from the start-up lines the choice logs."""
    with caplog.at_level(logging.INFO):
        choose_fa3("triton", CPU, torch.bfloat16, SHAPE, load=_never_loaded)
        choose_fa3("auto", CPU, torch.bfloat16, SHAPE, load=lambda d: None)
    assert vertical_from_log(caplog.text) == "triton"
    assert (
        vertical_from_log(f"[t] {LOG_FA3} (start-up check: max |diff| = 0.004)\n[t] {LOG_FA3} (...)") == "fa3"
    )
    assert vertical_from_log(f"{LOG_FA3}\n{LOG_TRITON}: sgl_kernel's FA3 does not load here") == "mixed"
    assert vertical_from_log("server_args=ServerArgs(...)") is None


def test_a_failed_warm_up_is_logged_not_raised(caplog):
    """The backend's start-up compile of the one-pass prefill never takes the server down (here it
    cannot launch: CPU tensors without the interpreter)."""
    from sglang_wgkv.integration.backend.prefill_vertical import warm_up

    with caplog.at_level(logging.WARNING):
        warm_up(CPU, torch.bfloat16, SHAPE)
    assert "prefill warm-up failed (ValueError" in caplog.text
