"""Run a check script under the Triton interpreter on CPU, in its own process: ``TRITON_INTERPRET=1``
must be set before Triton is imported, so the tests cannot flip it in their own interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def interp_env() -> dict[str, str]:
    """The environment of an interpreter check: Triton interpreted, no GPU visible (CPU even on a GPU
    host), this checkout's packages first on the path, the unused packages of
    :data:`~sglang_wgkv.testing.lean.HIDDEN_MODULES` blocked (the checks that import SGLang)."""
    from sglang_wgkv.testing.lean import hidden_modules_env

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", **hidden_modules_env(path)}


INTERPRETER_STANDS_IN = (
    "the Triton interpreter is the CPU CI stand-in; the GPU runs the compiled kernel (gpu marker)"
)


def cpu_only(reason: str = INTERPRETER_STANDS_IN):
    """A pytest mark skipping a test where CUDA is available: the interpreter checks run on CPU only."""
    import pytest
    import torch

    return pytest.mark.skipif(torch.cuda.is_available(), reason=reason)


def run_interp_check(script: str | os.PathLike, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python script args...`` under :func:`interp_env`, output captured as text."""
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        env=interp_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def check_seeds(check, seeds) -> int:
    """In a check script: ``check(seed)`` for each seed (one process, one Triton import), printing
    ``ok seed S[: note]`` or ``FAIL seed S: error`` per seed (a failure does not stop the others);
    the exit code: 1 if any failed."""
    failed = 0
    for seed in seeds:
        try:
            note = check(seed)
        except (Exception, SystemExit) as e:  # SystemExit: the scripts' way of naming a difference
            print(f"FAIL seed {seed}: {type(e).__name__}: {e}", flush=True)
            failed += 1
        else:
            print(f"ok seed {seed}" + (f": {note}" if note else ""), flush=True)
    return 1 if failed else 0


def seed_lines(stdout: str) -> dict[str, str]:
    """``{seed: its line}`` of a :func:`check_seeds` run's output."""
    lines = {}
    for line in stdout.splitlines():
        verdict, _, rest = line.partition(" seed ")
        if verdict in ("ok", "FAIL") and rest:
            lines[rest.split(":")[0]] = line
    return lines


def assert_seed_ok(run: subprocess.CompletedProcess, seed) -> str:
    """``seed``'s line of a :func:`check_seeds` run, asserted ``ok``; a run that exited non-zero without
    a ``FAIL`` line (it crashed) fails every seed."""
    line = seed_lines(run.stdout).get(str(seed))
    context = f"{line}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert line is not None and line.startswith(f"ok seed {seed}"), context
    assert run.returncode == 0 or "FAIL seed" in run.stdout, context
    return line


@dataclass(frozen=True)
class InterpCheck:
    """One run of a check script under :func:`interp_env`; a test module declares its checks as module
    constants, so the conftest can start them before the tests that read them."""

    script: str
    args: tuple[str, ...] = ()
    timeout: float = 600


class InterpRunner:
    """Runs interpreter checks in background threads, ``workers`` at a time in submission order (the
    checks are single-threaded, the test process keeps the other core), one more while the test
    process waits in :meth:`result` (its core is free then); :meth:`discard` drops one submitted
    ahead and no longer wanted; :meth:`close` ends the ones still running."""

    def __init__(self, workers: int = 1):
        self._executor = ThreadPoolExecutor(max_workers=workers + 1, thread_name_prefix="interp")
        self._futures: dict[InterpCheck, Future] = {}
        self._running: dict[InterpCheck, subprocess.Popen] = {}
        self._discarded: set[InterpCheck] = set()
        self._closed = False
        self._slots = threading.Condition()
        self._allowed, self._active = workers, 0

    def submit(self, check: InterpCheck) -> None:
        if check in self._discarded:
            raise RuntimeError(f"{check} was discarded")
        if check not in self._futures:
            self._futures[check] = self._executor.submit(self._run, check)

    def result(self, check: InterpCheck) -> subprocess.CompletedProcess:
        self.submit(check)
        future = self._futures[check]
        if future.done():
            return future.result()
        with self._slots:
            self._allowed += 1
            self._slots.notify_all()
        try:
            return future.result()
        finally:
            with self._slots:
                self._allowed -= 1

    def discard(self, check: InterpCheck) -> None:
        """Drop ``check`` for good (submitted ahead, then not wanted): it does not start, or is ended
        if it runs."""
        future = self._futures.pop(check, None)
        if future is None:
            return
        with self._slots:
            self._discarded.add(check)
            self._slots.notify_all()
        future.cancel()
        proc = self._running.get(check)
        if proc is not None:
            proc.kill()

    def _run(self, check: InterpCheck) -> subprocess.CompletedProcess | None:
        with self._slots:
            self._slots.wait_for(
                lambda: self._active < self._allowed or self._closed or check in self._discarded
            )
            if check in self._discarded:
                return None
            self._active += 1
        try:
            return self._run_process(check)
        finally:
            with self._slots:
                self._active -= 1
                self._slots.notify_all()

    def _run_process(self, check: InterpCheck) -> subprocess.CompletedProcess:
        command = [sys.executable, check.script, *check.args]
        proc = subprocess.Popen(
            command, env=interp_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._running[check] = proc
        try:
            if self._closed or check in self._discarded:
                proc.kill()
            stdout, stderr = proc.communicate(timeout=check.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\ntimed out after {check.timeout} s"
        finally:
            self._running.pop(check, None)
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)

    def close(self) -> None:
        with self._slots:
            self._closed = True
            self._slots.notify_all()
        for future in self._futures.values():
            future.cancel()
        for proc in list(self._running.values()):
            proc.kill()
        self._executor.shutdown(wait=True)
