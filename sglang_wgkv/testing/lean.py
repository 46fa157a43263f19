"""Less start-up work in the test suite's CPU subprocesses (the servers, the interpreter checks), through
``lean_site/sitecustomize.py`` on their ``PYTHONPATH``; what they compute is unchanged.

=======================  ===================================================================
variable                 effect in every Python process of the subprocess
=======================  ===================================================================
``WGKV_TEST_HIDDEN_``    the packages named are blocked (``None`` in ``sys.modules``): the
``MODULES``              libraries that import them only when installed skip them
``WGKV_TEST_FORK_``      a process started with the ``spawn`` method (SGLang's scheduler and
``CHILDREN=1``           detokenizer) is forked instead on the CPU engine from a single-threaded
                         parent: it keeps the launcher's imports instead of repeating them
=======================  ===================================================================
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# Imported by every SGLang process through transformers, SGLang or tvm_ffi only when installed, used by
# no CPU test server or interpreter check: scikit-learn (transformers' candidate generator), SciPy (its
# object-detection loss), torchao (its quantizer registry), FlashInfer (SGLang's FP4 helpers, CUDA
# kernels) and ml_dtypes (tvm_ffi's NumPy dtypes, under xgrammar): ~3.5 CPU-s of each process's start.
HIDDEN_MODULES = ("sklearn", "scipy", "torchao", "flashinfer", "ml_dtypes")
LEAN_SITE = Path(__file__).resolve().parent / "lean_site"


def hidden_modules_env(pythonpath: str | None = None) -> dict[str, str]:
    """:data:`HIDDEN_MODULES` blocked in a subprocess whose ``PYTHONPATH`` would be ``pythonpath``
    (default: this process's)."""
    rest = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(LEAN_SITE), rest) if p),
        "WGKV_TEST_HIDDEN_MODULES": ",".join(HIDDEN_MODULES),
    }


@functools.cache
def lean_server_env() -> dict[str, str]:
    """A CPU test server's lean start: :data:`HIDDEN_MODULES` blocked, its scheduler and detokenizer
    forked from the launcher. Empty where CUDA is available (the GPU servers use FlashInfer, and a
    process that touched CUDA cannot fork)."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {**hidden_modules_env(), "WGKV_TEST_FORK_CHILDREN": "1"}
