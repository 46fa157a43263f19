"""Cross-compile our Triton kernels for the H200 (sm_90a) on a CPU machine.

Triton compiles to a cubin without a GPU (its bundled ptxas), so the CPU suite can check what only
the device used to show: that a kernel compiles for sm_90 at the specialization its launcher
builds, and that it fits sm_90's shared memory (a 64 x 64 x 3-stage tile of the prefill gate asked
for 320 KiB and failed on the H200 only, 2026-12-01). :func:`launches` runs a launcher with every
Triton launch captured instead of run (arguments by name, launch options); :func:`compile_sm90`
compiles one capture.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from unittest import mock

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

H200 = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


@contextmanager
def device_checks_off():
    """The launchers refuse CPU tensors unless TRITON_INTERPRET=1; set it for the call only (the
    kernels were created as compiled JIT functions at import, before it)."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        yield


def launches(call) -> list[tuple[JITFunction, dict, dict]]:
    """Run ``call()`` with each Triton launch recorded instead of run: ``(kernel, {arg name: value},
    {launch option: value})`` per launch."""
    got = []

    def record(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        got.append((self, bound, {k: v for k, v in kwargs.items() if k not in self.arg_names}))

    with mock.patch.object(JITFunction, "run", record):
        call()
    return got


def compile_sm90(kernel: JITFunction, bound: dict, options: dict):
    """The compiled kernel (``.asm['ptx']``, ``.metadata.shared``) for the H200."""
    sig, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        if param.is_constexpr:
            sig[name] = "constexpr"
            constexprs[(i,)] = bound[name]
        else:
            sig[name] = mangle_type(bound[name])  # Triton's own type of the value (*bf16, i32, tensordesc<...>)
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=H200,
                          options=options)
