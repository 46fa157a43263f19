"""evals/aime25.py end to end against the real CPU server (wgkv backend) on the
shipped sample: the OpenAI request it sends (chat template, top_k in the extra body) is accepted and
every sample is scored. The server runs the short model (the embedded one's first layers): nothing is
expected to be solved; accuracy is not asserted."""

import json
import subprocess
import sys

import pytest

from sglang_wgkv.testing.server_pool import ShippedGates, shared_server
from sglang_wgkv.testing.serving import REPO
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.serving

# the radix tests' server (shared): the shipped gates at W_local 32
server = shared_server(
    "--model-path", ShortModel(), "--wgkv-local-window", "32", "--chunked-prefill-size", "64",
    "--wgkv-gates", ShippedGates(32, SHORT_LAYERS),
)  # fmt: skip


def test_eval_cli_runs_against_the_server(server, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "evals.aime25",
            "--base-url",
            server.url + "/v1",
            "--limit",
            "2",
            "--samples",
            "2",
            "--max-tokens",
            "24",
            "--concurrency",
            "4",
            "--no-progress",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr + server.log_tail()
    report = json.loads(out.read_text())
    assert report["errors"] == 0, [s["error"] for s in report["samples"]]
    assert len(report["samples"]) == 4 and report["num_problems"] == 2
    assert all(0 < s["completion_tokens"] <= 24 for s in report["samples"])
    # the server's usage["wgkv"] reaches the report: ring (32) + global tokens per KV head
    assert report["mean_kv_tokens_per_head"] > 32 and report["mean_eviction_triggers"] >= 0
    assert 0.0 <= report["accuracy"] <= report["pass@k"] <= 1.0
    assert server.alive()
