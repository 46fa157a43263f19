"""The README's serve command with its defaults (no --max-total-tokens: the launcher's CPU default KV
budget) survives an SGLang frontend program (gen then select, fork, run_batch), chat, streaming and a
6K-token prompt (the soak tier; 1.1K tokens in the default run), and the whole process tree's peak
RSS stays well inside the RAM (``benchmarks/serving_memory.py``; its 3-prompt run is recorded in
``benchmarks/results/serving/memory_*.json``). Before the CPU default and the bounded temporaries of
the idle check and the CPU prefill attention, this workload got the scheduler OOM-killed on a 24 GB
machine."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.scale

REPO = Path(__file__).resolve().parents[1]


def _serving_memory():
    from benchmarks import serving_memory

    return serving_memory


# the 6K-token prompt runs in the soak tier; the default run's 1,100 tokens still pass the gate's
# 1,024-row block (INFERENCE_ROW_BLOCK) and span many attention score blocks, the bounded temporaries
@pytest.mark.server
@pytest.mark.parametrize("long_tokens", [1100, pytest.param(6000, marks=pytest.mark.soak)])
def test_default_server_survives_the_mixed_workload(tmp_path, long_tokens, monkeypatch):
    from sglang_wgkv.launch_server import CPU_KV_RAM_FRACTION
    from sglang_wgkv.testing.serving import QUIET_STOP_ENV, only_test_models_env

    # the server inherits the environment; its scheduler imports only the model module it loads
    for name, value in {**QUIET_STOP_ENV, **only_test_models_env()}.items():
        monkeypatch.setenv(name, value)

    result = _serving_memory().measure(
        ["--sleep-on-idle"],
        "wgkv_default",
        tmp_path / "server.log",
        long_prompt_count=1,
        long_tokens=long_tokens,
        stream_tokens=16,  # a streamed reply of a few tokens streams as a long one does
    )
    summary = {k: v for k, v in result.items() if k != "rss_timeline"}
    assert result["survived"], json.dumps(summary) + (tmp_path / "server.log").read_text()[-3000:]
    assert all(p.get("ok", True) for p in result["phases"].values()), json.dumps(summary)
    frontend = result["phases"]["frontend"]["detail"]
    assert frontend["select"] in ("yes", "no") and len(frontend["batch_answers"]) == 8
    assert (
        "Paris" in frontend["answer"]
    )  # the README's defaults answer right (the launcher's CPU dtype, shipped gates)
    ram = result["machine"]["mem_total_bytes"]
    kv_bytes = result["server"]["wgkv"]["total_pages"] * result["server"]["wgkv"]["page_bytes"]
    assert kv_bytes <= CPU_KV_RAM_FRACTION * ram
    # the KV cache, three Python processes (~1.5 GB each with torch + SGLang) and the activations
    assert result["peak_rss_bytes"] < 0.6 * ram, json.dumps(summary)
