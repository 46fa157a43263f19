"""CPU soak (issue 14): mixed requests against one small-pool server, strict idle checks throughout
(:mod:`sglang_wgkv.testing.soak` holds the workload and the checks).

The default run soaks :data:`SMOKE_JOBS` jobs (every kind but one, one pressure job, no retraction
asked); the ``soak`` tier ``WGKV_SOAK_REQUESTS`` jobs (default 150); the issue's 2,000-job run is
the same test::

    WGKV_SOAK_REQUESTS=2000 WGKV_SOAK_OUT=benchmarks/results/reliability/soak_cpu.json python -m pytest -q -s -m soak tests/test_soak.py

The smoke's server is the pool's, shared with tests/test_serving_reliability.py (same arguments; the
soak reads only deltas and flushes the prefix cache before its probes); the soak tier's adds
``--schedule-conservativeness 0.1``, so that its pressure batches make the scheduler retract.
"""

import json
import os

import pytest

from sglang_wgkv.testing.server_pool import shared_server
from sglang_wgkv.testing.soak import CPU_SERVER_ARGS, Soak, SoakConfig
from sglang_wgkv.testing.soak_jobs import MIX

pytestmark = pytest.mark.serving

N_JOBS = int(os.environ.get("WGKV_SOAK_REQUESTS", "150"))
SMOKE_JOBS = 40

server = shared_server(*CPU_SERVER_ARGS)
# SGLang admits a request only with room for 70% of its max_new_tokens (reset whenever it idles, which a
# soak of the short model does often), so the default pressure batch (4 x ~480 tokens against 1469
# logical ones) ran three at a time and never retracted. The soak tier's server reserves 7%, and its
# pressure batches (4 x ~250 prompt + 160 new tokens) are admitted whole and then outgrow the pool.
retracting_server = shared_server(*CPU_SERVER_ARGS, "--schedule-conservativeness", "0.1")
RETRACTING_PRESSURE = {"pressure_items": 20, "pressure_tokens": 160}


def _soak(server, n_jobs: int, checkpoint_every: int, **pressure) -> dict:
    config = SoakConfig(requests=n_jobs, concurrency=6, checkpoint_every=checkpoint_every, **pressure)
    summary = Soak(server.url, config, str(server.log_path)).run()
    print(json.dumps({k: v for k, v in summary.items() if k not in ("checkpoints", "final_stats")}, indent=1))
    return summary


def _check(summary, server, n_jobs: int) -> None:
    assert not summary["failures"], "\n".join(summary["failures"][:20])
    assert summary["jobs"] == n_jobs and summary["probe_equal"] and server.alive()


def test_cpu_soak_smoke(server):
    # the first 40 jobs: all kinds but one, one pressure job (too few to make the scheduler retract:
    # the retraction is the soak tier's check)
    summary = _soak(server, SMOKE_JOBS, checkpoint_every=20)
    _check(summary, server, SMOKE_JOBS)
    assert summary["counts"]["pressure"] >= 1 and len(summary["counts"]) >= len(MIX) - 1


@pytest.mark.soak
def test_cpu_soak(retracting_server):
    server = retracting_server
    summary = _soak(server, N_JOBS, checkpoint_every=50, **RETRACTING_PRESSURE)
    out = os.environ.get("WGKV_SOAK_OUT")
    if out:
        summary["command"] = (
            f"WGKV_SOAK_REQUESTS={N_JOBS} WGKV_SOAK_OUT={out} "
            "python -m pytest -q -s -m soak tests/test_soak.py"
        )
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
    _check(summary, server, N_JOBS)
    assert summary["retractions"] >= 1, "no retraction: the pressure jobs did not fill the pool"
    assert set(summary["counts"]) == set(MIX) or N_JOBS < 100
