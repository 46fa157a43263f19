"""Mixed-request soak against a running wgkv server (issue 14): the CPU soak test drives it in CI
(``tests/test_soak.py``), the H200 soak runs it as a script (``launch/h200.sh serve-soak``)::

    python -m sglang_wgkv.testing.soak --url http://127.0.0.1:30000 --requests 1000 --concurrency 32 \
        --server-log server.log --out soak.json

Jobs, drawn with a fixed seed (:data:`~sglang_wgkv.testing.soak_jobs.MIX`): ``/generate`` greedy on shared prefixes (the radix
cache), with per-request ``tau`` or ``admission: false``; streams, some aborted through
``/abort_request``, some dropped by the client; OpenAI chat (multi-turn on one system prompt, plain
and streaming with usage) and completions; SGLang frontend programs (``gen`` + ``select``); long
"pressure" requests that fill the pool so that the scheduler retracts; and bad input, which must be
a 4xx. Every job's answer is checked (status, finish reason, token counts, usage).

Checks: a fixed greedy probe (cold: ``/flush_cache`` first) answers the same token ids before and
after; every ``--checkpoint-every`` jobs the workers drain and the scheduler, idle, must have
checked the pool (the server runs with ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``, so a leaked
slot or page or a failed integrity check kills it): no request holds a slot, every page is free or
held by a prefix snapshot, requests started == released. Exit code 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests

from sglang_wgkv.testing.server_pool import HeadGates
from sglang_wgkv.testing.serving import long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel
from sglang_wgkv.testing.soak_jobs import MIX, SoakJobs

# The CPU soak's server (tests/test_soak.py, also tests/test_serving_reliability.py's), over the test
# servers' 2048-token budget (1469 logical tokens, which the soak tier's pressure batches outgrow:
# tests/test_soak.py): W_local 32 and 128-token chunks, so prompts leave the ring and get promoted; KV
# head 0 admits nothing, heads 1-2 everything; the short model (a forward ~5x cheaper; no job reads what
# it answers).
CPU_SERVER_ARGS = (
    "--model-path",
    ShortModel(),
    "--wgkv-local-window",
    "32",
    "--chunked-prefill-size",
    "128",
    "--enable-metrics",
    "--wgkv-gates",
    HeadGates((-30.0, 30.0, 30.0), 32, SHORT_LAYERS),
)
PROBES = ["The capital of France is", long_prompt(6, seed=11)]


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 200
    concurrency: int = 8
    seed: int = 0
    checkpoint_every: int = 100
    new_tokens: int = 12  # ordinary jobs generate up to this many tokens
    pressure_items: int = 30  # pressure prompt: long_prompt(items) ~ 12 tokens per item
    pressure_tokens: int = 120  # pressure jobs generate exactly this many (EOS ignored)
    pressure_batch: int = 4  # prompts per pressure job (one /generate call: admitted together)
    timeout_s: float = 1800.0
    time_budget_s: float = 0.0  # > 0: no new block of jobs starts after this many seconds

    def __post_init__(self):
        if (
            min(
                self.requests,
                self.concurrency,
                self.checkpoint_every,
                self.new_tokens,
                self.pressure_items,
                self.pressure_tokens,
                self.pressure_batch,
            )
            < 1
        ):
            raise ValueError(f"every size must be >= 1: {self}")


class Soak(SoakJobs):
    """One soak run against ``url``; :meth:`run` returns the summary (``failures`` empty = passed)."""

    def __init__(self, url: str, config: SoakConfig, server_log: str | None = None):
        self.url, self.config, self.server_log = url, config, server_log
        self.failures: list[str] = []
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall seconds per job kind (where a slow soak's time goes)
        self.http_requests = 0
        self._lock = threading.Lock()
        self.prefixes = [long_prompt(n, seed=s) for n, s in ((8, 1), (16, 2), (24, 3))]

    # -- HTTP -----------------------------------------------------------------------------------
    def post(self, path, body, **kw):
        with self._lock:
            self.http_requests += 1
        return requests.post(self.url + path, json=body, timeout=self.config.timeout_s, **kw)

    def stats(self) -> dict:
        r = requests.get(self.url + "/server_info", timeout=120)
        r.raise_for_status()
        return r.json()["internal_states"][0]["wgkv"]

    def fail(self, job, message):
        with self._lock:
            self.failures.append(f"job {job[0]} ({job[1]}): {message}")

    # -- checks ---------------------------------------------------------------------------------
    def probe(self) -> list[list[int]]:
        """Cold greedy answers of :data:`PROBES` (the prefix cache flushed first, so both probes
        prefill the same way)."""
        for _ in range(120):
            if requests.post(self.url + "/flush_cache", timeout=120).status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise TimeoutError("/flush_cache refused for 60 s")
        outs = []
        for p in PROBES:
            r = self.post(
                "/generate",
                {"text": p, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
            )
            r.raise_for_status()
            outs.append(r.json()["output_ids"])
        return outs

    def checkpoint(self, done: int) -> dict:
        """Idle, checked pool: the workers have drained, so the scheduler must reach idle."""
        deadline = time.monotonic() + 300
        while True:
            s = self.stats()
            if s["active_requests"] == 0 and s["idle_checked_released"] == s["requests_released"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"not idle-checked 300 s after {done} jobs: {s}")
            time.sleep(0.5)
        held = s.get("radix", {}).get("snapshot_pages", 0)
        if s["free_pages"] + held != s["total_pages"] or s["requests_started"] != s["requests_released"]:
            raise RuntimeError(f"pool not clean after {done} jobs: {s}")
        return {
            "jobs": done,
            "free_pages": s["free_pages"],
            "snapshot_pages": held,
            "requests_released": s["requests_released"],
            "idle_checks": s["idle_checks"],
        }

    # -- jobs -----------------------------------------------------------------------------------
    def jobs(self) -> list[tuple[int, str, int]]:
        rng = random.Random(self.config.seed)
        kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=self.config.requests)
        return [(i, kind, rng.randrange(1 << 30)) for i, kind in enumerate(kinds)]

    def run_job(self, job) -> None:
        i, kind, seed = job
        rng = random.Random(seed)
        t0 = time.monotonic()
        try:
            getattr(self, f"_{kind}")(job, rng)
        except (
            Exception
        ) as e:  # a job's failure is recorded; the run goes on (a dead server fails every later job)
            self.fail(job, f"{type(e).__name__}: {e}")
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.monotonic() - t0

    def retractions(self) -> int | None:
        if not self.server_log:
            return None
        with open(self.server_log, errors="replace") as f:
            return f.read().count("Retract requests")

    def run(self) -> dict:
        start = time.monotonic()
        retracted0 = self.retractions()
        probe_before = self.probe()
        checkpoints = [self.checkpoint(0)]
        jobs = self.jobs()
        step = self.config.checkpoint_every
        ran = 0
        with ThreadPoolExecutor(self.config.concurrency) as pool:
            for lo in range(0, len(jobs), step):
                if self.config.time_budget_s and time.monotonic() - start > self.config.time_budget_s:
                    break
                list(pool.map(self.run_job, jobs[lo : lo + step]))
                ran = min(lo + step, len(jobs))
                checkpoints.append(self.checkpoint(min(lo + step, len(jobs))))
                print(
                    json.dumps(
                        {
                            "t_s": round(time.monotonic() - start, 1),
                            **checkpoints[-1],
                            "failures": len(self.failures),
                        }
                    ),
                    flush=True,
                )
        probe_after = self.probe()
        checkpoints.append(self.checkpoint(ran))
        if probe_after != probe_before:
            self.failures.append(f"probe changed: {probe_before} -> {probe_after}")
        wall = time.monotonic() - start
        retracted = self.retractions()
        return {
            "config": asdict(self.config),
            "jobs": ran,
            "http_requests": self.http_requests,
            "counts": dict(sorted(self.counts.items())),
            "wall_s": round(wall, 1),
            "mean_job_s": {k: round(self.seconds[k] / self.counts[k], 2) for k in sorted(self.counts)},
            "jobs_per_s": round(ran / wall, 3),
            "retractions": None if retracted is None else retracted - retracted0,
            "probe_equal": probe_after == probe_before,
            "checkpoints": checkpoints,
            "final_stats": {k: v for k, v in self.stats().items() if not k.endswith("per_layer_head")},
            "failures": self.failures,
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--server-log", default=None, help="count SGLang's retractions in this log")
    p.add_argument("--out", default=None, help="summary JSON")
    for field, default in asdict(SoakConfig()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    a = p.parse_args()
    config = SoakConfig(**{f: getattr(a, f) for f in asdict(SoakConfig())})
    summary = Soak(a.url, config, a.server_log).run()
    summary["command"] = "python -m sglang_wgkv.testing.soak " + " ".join(sys.argv[1:])
    print(json.dumps({k: v for k, v in summary.items() if k != "checkpoints"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
    raise SystemExit(1 if summary["failures"] else 0)


if __name__ == "__main__":
    main()
