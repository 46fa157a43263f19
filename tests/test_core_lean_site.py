"""The CPU test servers' start-up (``sglang_wgkv/testing/lean_site/sitecustomize.py``): the hidden packages
are blocked in every process, and a process started with the ``spawn`` method is forked only on the CPU
engine from a single-threaded parent (else spawned, as SGLang asks)."""

import json
import os
import subprocess
import sys

import pytest

from sglang_wgkv.testing.lean import HIDDEN_MODULES, LEAN_SITE, lean_server_env

pytestmark = pytest.mark.core

# Run as a script: a forked child keeps the parent's ``__main__`` (and its mark), a spawned one
# imports the script again as ``__mp_main__``, without it.
PROBE = r"""
import importlib.util
import json
import multiprocessing as mp
import sys
import threading

HIDDEN = sys.argv[2].split(",")


def blocked():
    return [n for n in HIDDEN if n in sys.modules and sys.modules[n] is None and importlib.util.find_spec(n) is None]


def child(queue):
    queue.put({"forked": globals().get("PARENT_MARK", False), "blocked": blocked()})


if __name__ == "__main__":
    PARENT_MARK = True
    mp.set_start_method("spawn", force=True)
    stop = threading.Event()
    if sys.argv[1] == "thread":  # a second OS thread in the parent
        threading.Thread(target=stop.wait).start()
    queue = mp.Queue()
    process = mp.Process(target=child, args=(queue,))
    process.start()
    result = queue.get(timeout=120)
    process.join()
    stop.set()
    try:
        import sklearn  # noqa: F401
        imported = True
    except ModuleNotFoundError:
        imported = False
    print(json.dumps({"parent_blocked": blocked(), "sklearn_imported": imported, **result}))
"""


def _probe(tmp_path, threads: str, **env) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    base = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH")}
    out = subprocess.run(
        [sys.executable, str(script), threads, ",".join(HIDDEN_MODULES)],
        env={**base, "PYTHONPATH": str(LEAN_SITE), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


LEAN = {"WGKV_TEST_HIDDEN_MODULES": ",".join(HIDDEN_MODULES), "WGKV_TEST_FORK_CHILDREN": "1"}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the fork decision reads /proc/self/task")
@pytest.mark.parametrize(
    "threads, env, forked",
    [
        ("one", {**LEAN, "SGLANG_USE_CPU_ENGINE": "1"}, True),
        ("thread", {**LEAN, "SGLANG_USE_CPU_ENGINE": "1"}, False),  # not fork-safe: spawned
        ("one", LEAN, False),  # not the CPU engine
        ("one", {**LEAN, "WGKV_TEST_FORK_CHILDREN": "0", "SGLANG_USE_CPU_ENGINE": "1"}, False),
    ],
)
def test_children_fork_only_on_the_cpu_engine_from_one_thread(tmp_path, threads, env, forked):
    result = _probe(tmp_path, threads, **env)
    assert result["forked"] is forked
    assert result["parent_blocked"] == list(HIDDEN_MODULES) == result["blocked"]
    assert result["sklearn_imported"] is False


def test_nothing_blocked_without_the_list(tmp_path):
    result = _probe(tmp_path, "one", SGLANG_USE_CPU_ENGINE="1")
    assert result["parent_blocked"] == [] == result["blocked"]


def test_lean_server_env_only_without_cuda():
    import torch

    env = lean_server_env()
    if torch.cuda.is_available():
        assert env == {}
    else:
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(LEAN_SITE)
        assert env["WGKV_TEST_HIDDEN_MODULES"].split(",") == list(HIDDEN_MODULES)
        assert env["WGKV_TEST_FORK_CHILDREN"] == "1"
