"""Test tiers and the shared servers.

Cost markers, added here from what a test runs (its source, its fixtures' and the module functions
they call, transitively), beside the topic markers of its file:

=========  ===================================================  ===================================
marker     added where the test or one of its fixtures ...      tier
=========  ===================================================  ===================================
server     calls ``Server(`` / ``ServerProcess(``, launches     ``slow``
           ``sglang[_wgkv].launch_server`` or takes a
           ``shared_server`` (or carries the marker itself)
interp     runs a Triton-interpreter check subprocess          ``slow``
           (``run_interp_check(``, ``interp_env(``,
           ``interp_runner.result(``, or sets
           ``TRITON_INTERPRET`` to ``"1"`` itself)
soak       (set by the test file: long runs)                    ``slow``; left out of the default
                                                                run by ``addopts``
=========  ===================================================  ===================================

``pytest -q`` runs everything but ``soak``; ``pytest -m "not slow"`` is the development tier.

Modules run in four blocks: plain, with servers of their own, with ``shared_server`` fixtures
(modules sharing a server, directly or through another module, one after another), with interpreter
checks. The interpreter checks (:class:`~sglang_wgkv.testing.interp.InterpCheck` constants of the
selected modules) start as their modules are collected and run one at a time in the background
through the blocks before theirs; the session's :class:`~sglang_wgkv.testing.server_pool.ServerPool` starts each planned
server while the module before it runs.
"""

import inspect
import os
import re
import signal
import sys

import pytest

from sglang_wgkv.testing.interp import InterpCheck, InterpRunner
from sglang_wgkv.testing.server_pool import ServerPool, server_key, sharing_groups

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread per process (this one, and the servers and interpreter checks, which inherit it):
# the suite keeps both cores busy with several processes at once, and a process whose OpenMP team
# spans both cores waits at every parallel op for a thread another process holds (the core tests'
# small tensors ran up to 50x slower beside an interpreter check). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

STARTS_SERVER = re.compile(r"\b(?:Server|ServerProcess)\(|[\"']sglang(?:_wgkv)?\.launch_server[\"']")
RUNS_INTERPRETER = re.compile(
    r"\b(?:run_interp_check|interp_env)\(|\binterp_runner\.result\(|TRITON_INTERPRET[\"']?\s*[=:]\s*[\"']1"
)
CALLED_NAME = re.compile(r"\b([A-Za-z_]\w*)\(")
PLAN_KEY = pytest.StashKey[list]()
AHEAD_KEY = pytest.StashKey[str]()  # the module beside which the pool's first server starts
RUNNER_KEY = pytest.StashKey[InterpRunner]()
AHEAD_CHECKS_KEY = pytest.StashKey[set]()  # interpreter checks started while collecting
# Module blocks in run order. The interpreter modules come last: their checks run in the background
# through the server modules (whose waits leave a core idle), so the results are ready when read.
PLAIN, OWN_SERVERS, POOLED, INTERPRETER = range(4)


def _fixture_functions(item):
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info else None
        if defs:
            yield defs[-1].func


_SOURCES: dict = {}


def _source(obj) -> str | None:
    """``inspect.getsource``, once per object: the helpers and fixtures recur across a module's items."""
    if obj not in _SOURCES:
        try:
            _SOURCES[obj] = inspect.getsource(obj)
        except (OSError, TypeError):
            _SOURCES[obj] = None
    return _SOURCES[obj]


def _sources(item):
    """The source of the test, of its fixtures and of the module-level functions and classes they call
    (those of the module that defines the caller), transitively."""
    todo = [getattr(item, "obj", None), *_fixture_functions(item)]
    seen = set()
    while todo:
        obj = todo.pop()
        obj = inspect.unwrap(getattr(obj, "__func__", obj)) if obj is not None else None
        if obj is None or obj in seen or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        seen.add(obj)
        source = _source(obj)
        if source is None:
            continue
        yield source
        module = sys.modules.get(obj.__module__)
        for name in set(CALLED_NAME.findall(source)):
            callee = getattr(module, name, None)
            if (
                inspect.isfunction(callee) or inspect.isclass(callee)
            ) and callee.__module__ == obj.__module__:
                todo.append(callee)


def _shared_servers(item) -> list[tuple]:
    return [fn.server_args for fn in _fixture_functions(item) if hasattr(fn, "server_args")]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        shared = _shared_servers(item)
        sources = "\n".join(_sources(item))
        if shared or item.get_closest_marker("server") or STARTS_SERVER.search(sources):
            item.add_marker(pytest.mark.server)
        if RUNS_INTERPRETER.search(sources):
            item.add_marker(pytest.mark.interp)
        if any(item.get_closest_marker(m) for m in ("server", "interp", "soak")):
            item.add_marker(pytest.mark.slow)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    config.stash[RUNNER_KEY] = InterpRunner()
    config.stash[AHEAD_CHECKS_KEY] = set()
    config.pluginmanager.register(ModuleOrder(), "wgkv_module_order")
    # SIGTERM (a `timeout` wrapper, CI) as an interrupt: fixtures tear down and stop their servers,
    # which run in sessions of their own and would outlive the test process
    signal.signal(signal.SIGTERM, _interrupt)


class ModuleOrder:
    def pytest_itemcollected(self, item):
        _start_checks_ahead(item)

    @pytest.hookimpl(trylast=True)  # after -k/-m deselection: only what will run is planned and started
    def pytest_collection_modifyitems(self, config, items):
        _group_modules_by_shared_server(config, items)
        _start_interpreter_checks(config, items)

    def pytest_unconfigure(self, config):
        runner = config.stash.get(RUNNER_KEY, None)
        if runner is not None:
            runner.close()


def _start_checks_ahead(item) -> None:
    """Start the :class:`~sglang_wgkv.testing.interp.InterpCheck` constants of an item's module as it is
    collected: collecting the rest keeps one core busy for ~15 s, a check takes the other. The checks
    of modules whose interpreter tests are then deselected are dropped (``-m "not slow"``: one check
    cut short)."""
    config, module = item.config, getattr(item, "module", None)
    if config.option.collectonly or module is None or _skipped_outright(item):
        return
    ahead = config.stash[AHEAD_CHECKS_KEY]
    for value in vars(module).values():
        if isinstance(value, InterpCheck) and value not in ahead:
            ahead.add(value)
            config.stash[RUNNER_KEY].submit(value)


def _start_interpreter_checks(config, items) -> None:
    """Start the :class:`~sglang_wgkv.testing.interp.InterpCheck` constants of the modules whose
    interpreter tests were selected (most already run, see :func:`_start_checks_ahead`) and drop the
    others: they run one at a time beside the tests, which read their results."""
    runner = config.stash[RUNNER_KEY]
    if config.option.collectonly:
        return
    modules = {
        id(item.module): item.module
        for item in items
        if item.get_closest_marker("interp") and not _skipped_outright(item)
    }
    wanted = [
        value
        for module in modules.values()
        for value in vars(module).values()
        if isinstance(value, InterpCheck)
    ]
    for check in wanted:
        runner.submit(check)
    for check in config.stash[AHEAD_CHECKS_KEY].difference(wanted):
        runner.discard(check)


def _group_modules_by_shared_server(config, items) -> None:
    """Reorder whole modules (their items stay together and in order, so module fixtures start once):
    modules without servers or interpreter checks first, then those starting their own servers, those
    taking shared servers (modules sharing one adjacent), those reading interpreter checks; record the
    order of the leases as the pool's plan."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    component = sharing_groups(
        {
            path: [server_key(args) for item in its for args in _shared_servers(item)]
            for path, its in modules.items()
        }
    )
    groups: dict[tuple, list[str]] = {}
    for path, module_items in modules.items():
        if path in component:
            group = (POOLED, component[path])
        elif any(item.get_closest_marker("server") for item in module_items):
            group = (OWN_SERVERS, path)
        elif any(item.get_closest_marker("interp") for item in module_items):
            group = (INTERPRETER, path)
        else:
            group = (PLAIN, path)
        groups.setdefault(group, []).append(path)
    order = sorted(groups, key=lambda group: group[0])  # stable: file order within each kind
    items[:] = [item for group in order for path in groups[group] for item in modules[path]]
    before_pool = [path for group in order if group[0] < POOLED for path in groups[group]]
    if before_pool and any(group[0] == POOLED for group in order):
        config.stash[AHEAD_KEY] = before_pool[-1]
    plan, leased = [], set()  # one lease per module and server, in the order the modules take them
    for item in items:
        for args in _shared_servers(item):
            lease = (item.nodeid.split("::")[0], server_key(args))
            if lease not in leased:
                leased.add(lease)
                plan.append(args)
    config.stash[PLAN_KEY] = plan


def _skipped_outright(item) -> bool:
    """A ``skipif`` whose condition is already True (the interpreter checks skip on GPU hosts)."""
    return any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))


@pytest.fixture(scope="session")
def interp_runner(request):
    """The session's background interpreter checks (started after collection)."""
    return request.config.stash[RUNNER_KEY]


@pytest.fixture(scope="module", autouse=True)
def _first_pooled_server_ahead(request):
    """Beside the last module before the pooled ones, the pool starts its first server."""
    if request.node.nodeid.split("::")[0] == request.config.stash.get(AHEAD_KEY, None):
        request.getfixturevalue("server_pool").start_ahead()


@pytest.fixture(scope="session")
def server_pool(request, tmp_path_factory):
    """The session's shared servers (see :mod:`sglang_wgkv.testing.server_pool`)."""
    pool = ServerPool(tmp_path_factory.mktemp("server_pool"), plan=request.config.stash.get(PLAN_KEY, []))
    try:
        yield pool
    finally:
        pool.close()
