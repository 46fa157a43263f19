"""Start-up of every Python process of a CPU test server or interpreter check: this folder is first on
their ``PYTHONPATH`` (:mod:`sglang_wgkv.testing.lean`), so ``site`` runs this module.

- The packages named in ``WGKV_TEST_HIDDEN_MODULES`` are blocked (``None`` in ``sys.modules``: an import
  raises ``ModuleNotFoundError``, ``importlib.util.find_spec`` answers ``None``), so the libraries that
  import them only when installed (transformers, SGLang, tvm_ffi) skip them.
- With ``WGKV_TEST_FORK_CHILDREN=1``, a process started with the ``spawn`` method (SGLang's scheduler
  and detokenizer) is forked instead while the starting process runs the CPU engine
  (``SGLANG_USE_CPU_ENGINE=1``) on a single OS thread: the child keeps the modules the launcher already
  imported instead of importing them again. With more threads (an OpenMP team, a tokenizer pool: not
  fork-safe) or on CUDA it is spawned, as SGLang asks.

Another ``sitecustomize`` further on ``sys.path``, if any, still runs.
"""

import os
import sys

for _name in os.environ.get("WGKV_TEST_HIDDEN_MODULES", "").split(","):
    if _name and _name not in sys.modules:
        sys.modules[_name] = None


def _fork_when_single_threaded() -> None:
    from multiprocessing import context

    spawn_popen = context.SpawnProcess._Popen

    def popen(process_obj):
        if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and len(os.listdir("/proc/self/task")) == 1:
            from multiprocessing.popen_fork import Popen

            return Popen(process_obj)
        return spawn_popen(process_obj)

    context.SpawnProcess._Popen = staticmethod(popen)


if os.environ.get("WGKV_TEST_FORK_CHILDREN") == "1" and os.path.isdir("/proc/self/task"):
    _fork_when_single_threaded()


def _run_next_sitecustomize() -> None:
    import importlib.util
    from importlib.machinery import PathFinder

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_next_sitecustomize()
