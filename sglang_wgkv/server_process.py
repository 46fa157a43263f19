"""One SGLang server process (``sglang_wgkv.launch_server`` or upstream ``sglang.launch_server``),
started in its own process group, polled until healthy, stopped with its whole tree.

Shared by the serving tests (``sglang_wgkv/testing/serving.py``), the served evaluation
(``evals/served.py``) and the H200 speed benchmark (``benchmarks/served_speed.py``). It imports
neither SGLang nor torch, so a client process stays light: the server is a separate interpreter.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = (sys.executable, "-m", "sglang_wgkv.launch_server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``command`` (its HTTP server on ``127.0.0.1:port``) running with stdout and stderr in
    ``log_path``; ``url`` answers once :meth:`wait_healthy` returned.

    The process gets a session of its own: SGLang's launcher spawns the scheduler and detokenizer,
    and :meth:`stop` must end them too, whatever state the launcher is in.
    """

    def __init__(
        self,
        command: list[str],
        log_path: Path,
        *,
        port: int,
        env: dict[str, str],
        cwd: Path | str,
        stop_timeout_s: float = 30.0,
    ):
        self.command = list(command)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.stop_timeout_s = stop_timeout_s
        self._log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_healthy(
        self,
        timeout_s: float,
        *,
        path: str = "/health_generate",
        probe_timeout_s: float = 60.0,
        poll_s: float = 2.0,
    ) -> float:
        """Poll ``path`` every ``poll_s`` seconds until it answers 200 (``/health_generate`` runs a one-token
        generation: the scheduler is up, not only the HTTP server). Returns the seconds since the
        process started. Raises RuntimeError if the process exits, TimeoutError after ``timeout_s``
        (both with the log's tail)."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + path, timeout=probe_timeout_s).status_code == 200:
                    return time.perf_counter() - self.started
            except requests.RequestException:
                pass
            time.sleep(poll_s)
        raise TimeoutError(
            f"server not healthy after {timeout_s:.0f} s (log: {self.log_path}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 60) -> str:
        """The log's last ``lines`` lines, each cut at 400 characters (a traceback's locals can be huge)."""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in text[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the process group; SIGKILL if it has not exited after ``stop_timeout_s``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
