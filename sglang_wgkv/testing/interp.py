"""Run a check script under the Triton interpreter on CPU, in its own process: ``TRITON_INTERPRET=1``
must be set before Triton is imported, so the tests cannot flip it in their own interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def interp_env() -> dict[str, str]:
    """The environment of an interpreter check: Triton interpreted, no GPU visible (CPU even on a GPU
    host), this checkout's packages first on the path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}


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
