"""Import-only stand-in for ``sgl_kernel`` on a CPU-only machine.

SGLang 0.5.17's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports seven names from the CPU build of
``sgl_kernel`` at module load; the PyPI ``sglang-kernel`` wheel is CUDA-only and fails to import
without ``libcuda``. With the attention backends this project uses on CPU (``torch_native``,
``wgkv``), tensor parallel size 1 and no speculative decoding, none of the seven is ever called
(measured: a logging stand-in saw zero calls, ../shared/notes/sglang-0.5.17-facts.md), so a module
that only *defines* them lets the real server start. Each stand-in raises if it is ever called.

Where the names are imported::

    assign_req_to_token_pool_cpu     sglang/srt/mem_cache/allocation.py
    copy_all_layer_kv_cache_cpu      sglang/kernels/ops/kvcache/cache_move.py
    assign_extend_cache_locs_cpu     sglang/kernels/ops/speculative/cache_locs.py, srt/speculative/spec_utils.py
    fill_accept_out_cache_loc_cpu    sglang/kernels/ops/speculative/eagle.py
    fill_bonus_tokens_cpu            sglang/kernels/ops/speculative/eagle.py
    build_tree_kernel_efficient_cpu  sglang/srt/speculative/eagle_utils.py
    verify_tree_greedy_cpu           sglang/srt/speculative/eagle_utils.py

Activation: :func:`activate` is registered as an ``sglang.srt.platforms`` entry point. SGLang runs
platform entry points when ``sglang.srt.utils.common`` first resolves ``current_platform``, which is
before any of the modules above is imported, in the launcher and in every scheduler subprocess.
It returns ``None`` ("no platform of mine here"), so SGLang's own platform choice is unchanged. The
stand-in is installed only when the CPU engine is selected and the real package cannot be imported.
"""

from __future__ import annotations

import os
import sys
import types

CPU_BUILD_NAMES = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)
STANDIN_MARKER = "__sglang_wgkv_standin__"


def _unavailable(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but only an import stand-in is installed (the CPU build "
            "of sgl_kernel is not available). It is used by speculative decoding and by paths this "
            "CPU setup does not support; run without them or install sgl_kernel's CPU build."
        )

    op.__name__ = name
    return op


def build_standin() -> types.ModuleType:
    """A module named ``sgl_kernel`` defining :data:`CPU_BUILD_NAMES` (each raises when called)."""
    module = types.ModuleType("sgl_kernel", "sglang_wgkv import stand-in for sgl_kernel's CPU build")
    for name in CPU_BUILD_NAMES:
        setattr(module, name, _unavailable(name))
    setattr(module, STANDIN_MARKER, True)
    return module


def real_sgl_kernel_loads() -> bool:
    """True if the real ``sgl_kernel`` imports (or is already imported)."""
    if "sgl_kernel" in sys.modules:
        return True
    try:
        import sgl_kernel  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def install_if_needed() -> bool:
    """Install the stand-in when the CPU engine is selected and the real package cannot load.

    Returns True if the stand-in is (now) installed.
    """
    current = sys.modules.get("sgl_kernel")
    if current is not None:
        return bool(getattr(current, STANDIN_MARKER, False))
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1" or real_sgl_kernel_loads():
        return False
    sys.modules["sgl_kernel"] = build_standin()
    return True


def activate() -> None:
    """``sglang.srt.platforms`` entry point: install the stand-in if needed; select no platform."""
    install_if_needed()
    return None
