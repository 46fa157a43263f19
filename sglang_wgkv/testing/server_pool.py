"""Test servers shared across test files: one :class:`~sglang_wgkv.testing.serving.Server` per distinct
argument list, started ahead of its first use and kept for the next file that asks for the same
arguments.

A test module takes a server through a module-scoped :func:`shared_server` fixture (one
:meth:`ServerPool.lease` per module). ``tests/conftest.py`` orders the modules so that those sharing
arguments run one after another and gives the pool that order as its plan: a server stops after its
last planned lease, and the next one starts while the module before it runs.

Which servers may be shared
---------------------------
==========================================  ==========================================================
a test module that ...                      shares its server with other modules?
==========================================  ==========================================================
sends requests and checks their answers,    yes, where the arguments match
deltas of counters, or stats it drained
reads lifetime counters (admitted fraction  no: arguments no other module uses (a pooled server that
per head, metrics totals) as absolute       is still started ahead and stopped after use)
poisons or restarts the server              no: a ``Server`` of its own (the pool restarts nothing)
kills the server (a fault test)             yes, as ``shared_server(..., kills=True)``: the pool drops
                                            it at the end of that lease (a later lease, if any, gets a
                                            fresh start)
==========================================  ==========================================================

A pooled server that died (a leak found by the strict idle check kills the scheduler) is not restarted:
the next lease raises with its log, naming the modules that used it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sglang_wgkv.testing.serving import Server, save_head_gates, shipped_gates_at
from sglang_wgkv.testing.short_model import ShortModel


@dataclass(frozen=True)
class HeadGates:
    """``--wgkv-gates`` of :func:`~sglang_wgkv.testing.serving.save_head_gates`: per-KV-head fixed biases
    (+30 admits every token, -30 none) declared for ``local_window``, for a model of ``num_layers``."""

    head_bias: tuple[float, ...]
    local_window: int
    num_layers: int = 30

    def save(self, path: Path) -> Path:
        return save_head_gates(path, list(self.head_bias), self.local_window, num_layers=self.num_layers)

    def as_arg(self, folder: Path) -> str:
        return str(self.save(folder / "gates"))


@dataclass(frozen=True)
class ShippedGates:
    """``--wgkv-gates`` of :func:`~sglang_wgkv.testing.serving.shipped_gates_at`: the embedded model's
    trained gates declared for ``local_window`` (``num_layers``: its first layers' only)."""

    local_window: int
    num_layers: int | None = None

    def save(self, path: Path) -> Path:
        return shipped_gates_at(path, self.local_window, self.num_layers)

    def as_arg(self, folder: Path) -> str:
        return str(self.save(folder / "gates"))


@dataclass(frozen=True)
class ServerEnv:
    """Environment variables a pooled server starts with (beside the test settings of
    :class:`~sglang_wgkv.testing.serving.Server`): no command-line argument, but part of its key."""

    variables: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, **variables: str) -> ServerEnv:
        return cls(tuple(sorted(variables.items())))


ServerArg = str | int | float | HeadGates | ShippedGates | ShortModel | ServerEnv
# A module leasing two servers (a pair it compares) still lets the next planned one start beside them.
MAX_LEASED_TO_PREFETCH = 2
# Servers started ahead and not yet leased: a start is mostly imports, which fill the cores' idle time
# while the running module waits on its own server.
MAX_WAITING_AHEAD = 2


def command_args(args: Sequence[ServerArg], folder: Path) -> list[str]:
    """The command-line strings of ``args`` (:class:`ServerEnv` left out); gate specs and models are
    written under ``folder``."""
    return [
        a.as_arg(folder) if hasattr(a, "as_arg") else str(a) for a in args if not isinstance(a, ServerEnv)
    ]


def server_env(args: Sequence[ServerArg]) -> dict[str, str]:
    """The environment variables of the :class:`ServerEnv` entries of ``args``."""
    return {name: value for a in args if isinstance(a, ServerEnv) for name, value in a.variables}


def server_key(args: Sequence[ServerArg]) -> str:
    """A stable name of an argument list (gate specs included): equal arguments, one server."""
    text = json.dumps([a if isinstance(a, str) else repr(a) for a in args])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def sharing_groups(keys_by_module: dict[str, list[str]]) -> dict[str, str]:
    """``{module: its group}`` for the modules that take shared servers (``keys_by_module``: the server
    keys each module leases, modules in run order): modules sharing a server, directly or through
    others, form one group, named by its first module, so that they can run one after another and no
    server waits idle between its users."""
    order = {module: i for i, module in enumerate(keys_by_module)}
    parent: dict[str, str] = {}
    first_user: dict[str, str] = {}  # server key -> the first module taking it

    def root(module: str) -> str:
        while parent[module] != module:
            module = parent[module]
        return module

    for module, keys in keys_by_module.items():
        if not keys:
            continue
        parent[module] = module
        for key in keys:
            a, b = sorted((root(module), root(first_user.setdefault(key, module))), key=order.get)
            parent[b] = a  # the earlier module names the joined group
    return {module: root(module) for module in parent}


@dataclass
class _Entry:
    server: Server
    users: list[str] = field(default_factory=list)
    leases: int = 0


class ServerPool:
    """Servers by argument list under ``root`` (logs, gates); :meth:`close` stops them all.

    ``plan``: the argument lists in the order the session's modules will lease them, one entry per
    module lease. A server is stopped when its last planned lease ends (at once when it has none), and
    while at most :data:`MAX_LEASED_TO_PREFETCH` servers are leased and fewer than
    :data:`MAX_WAITING_AHEAD` wait unleased, the next planned ones are started in the background: their
    start-ups (mostly imports) overlap the current module's requests.
    """

    def __init__(self, root: Path, plan: Sequence[Sequence[ServerArg]] = (), launch=Server):
        self.root = Path(root)
        self.launch = launch  # (args, log_path[, env=...]) -> a started Server
        self._plan = [(server_key(args), tuple(args)) for args in plan]
        self._entries: dict[str, _Entry] = {}

    @contextmanager
    def lease(self, args: Sequence[ServerArg], user: str, kills: bool = False) -> Iterator[Server]:
        """The healthy server of ``args`` for the duration of the block (``user`` names the taker in
        error messages). ``kills``: the taker kills the server; it is dropped (stopped) at the block's
        end, whatever the plan says."""
        key = server_key(args)
        if key in (k for k, _ in self._plan):
            self._plan.remove(next(entry for entry in self._plan if entry[0] == key))
        entry = self._entries.get(key) or self._entries.setdefault(key, self._start(key, args))
        entry.leases += 1
        try:
            self._prefetch()  # before the wait: the next server starts while this one does
            self._wait_healthy(key, entry)
            entry.users.append(user)
            yield entry.server
        finally:
            entry.leases -= 1
            # a server that never got healthy was already removed (and stopped) by _wait_healthy
            planned = key in (k for k, _ in self._plan)
            if not entry.leases and (kills or not planned) and self._entries.get(key) is entry:
                self._entries.pop(key).server.stop()

    def _wait_healthy(self, key: str, entry: _Entry) -> None:
        if entry.users and not entry.server.alive():
            raise RuntimeError(
                f"shared server {key} ({entry.server.log_path}) died after use by {entry.users}:\n"
                f"{entry.server.log_tail()}"
            )
        try:
            entry.server.wait_healthy()
        except BaseException:
            self._entries.pop(key)
            entry.server.stop()
            raise

    def start_ahead(self) -> None:
        """Start the next planned server now (before its module's lease), if the rules allow one."""
        self._prefetch()

    def _prefetch(self) -> None:
        if sum(e.leases for e in self._entries.values()) > MAX_LEASED_TO_PREFETCH:
            return  # more servers in use would crowd the cores and the memory
        # more idle servers would hold memory and cores the running module needs
        while sum(not e.leases for e in self._entries.values()) < MAX_WAITING_AHEAD:
            upcoming = next(((k, args) for k, args in self._plan if k not in self._entries), None)
            if upcoming is None:
                return
            self._entries[upcoming[0]] = self._start(*upcoming)

    def _start(self, key: str, args: Sequence[ServerArg]) -> _Entry:
        """Launch (not awaited: :meth:`lease` waits until it is healthy)."""
        folder = self.root / key
        folder.mkdir(parents=True, exist_ok=True)
        command, env = command_args(args, folder), server_env(args)
        return _Entry(self.launch(command, folder / "server.log", **({"env": env} if env else {})))

    def close(self) -> None:
        for entry in self._entries.values():
            entry.server.stop()
        self._entries.clear()


def shared_server(*args: ServerArg, kills: bool = False):
    """A module-scoped fixture: the session pool's server of ``args`` (the ``server_pool`` fixture of
    tests/conftest.py), leased for the module; ``kills``: the module kills it (:meth:`ServerPool.lease`)."""
    import pytest

    def fixture(server_pool, request):
        with server_pool.lease(args, request.module.__name__, kills=kills) as server:
            yield server

    fixture.server_args = args  # read by the conftest to plan the pool and order the modules
    return pytest.fixture(scope="module")(fixture)
