"""One SGLang server process (``sglang_wgkv.launch_server`` or upstream ``sglang.launch_server``),
started in its own process group, polled until healthy, stopped with its whole tree.

Shared by the serving tests (``sglang_wgkv/testing/serving.py``), the served evaluation
(``evals/served.py``) and the H200 speed benchmark (``benchmarks/served_speed.py``). It imports
neither SGLang nor torch, so a client process stays light: the server is a separate interpreter.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = (sys.executable, "-m", "sglang_wgkv.launch_server")


# Ports handed out by this process: a server binds its port only after its imports (tens of seconds).
_HANDED_OUT: set[int] = set()
# Listening ports are taken below the kernel's ephemeral range: SGLang's NCCL/gloo port and every client
# connection come from that range, and one of them took a port in the window before its server bound it.
LISTEN_PORTS = range(20000, 32000)


def _ephemeral_range() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, outside the ephemeral range and not handed out before by this process
    (so that two servers starting side by side never get the same one)."""
    ephemeral = _ephemeral_range()
    candidates = [p for p in LISTEN_PORTS if p not in ephemeral and p not in _HANDED_OUT]
    rng = random.Random()
    for port in rng.sample(candidates, min(len(candidates), 200)):
        if _bindable(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # every candidate taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _HANDED_OUT.add(port)
    return port


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
