"""Cross-compile our Triton kernels for the H200 (sm_90a) on a CPU machine.

Triton compiles to a cubin without a GPU (its bundled ptxas), so the CPU suite can check what only
the device used to show: that a kernel compiles for sm_90 at the specialization its launcher
builds, and that it fits sm_90's shared memory (a 64 x 64 x 3-stage tile of the prefill gate asks
for 320 KiB, which only the device would otherwise reveal). :func:`launches` runs a launcher with every
Triton launch captured instead of run (arguments by name, launch options); :func:`compile_sm90`
compiles one capture.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from unittest import mock

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

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
    """The compiled kernel (``.asm['ptx']``, ``.metadata.shared``) for the H200. A capture made with
    :func:`device_checks_off` asked for the interpreter's ``UPCAST``; the CUDA launch never does, so
    it is compiled as False here."""
    if "UPCAST" in bound:
        bound = {**bound, "UPCAST": False}
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        if param.is_constexpr:
            sig[name] = "constexpr"
            constexprs[(i,)] = bound[name]
            continue
        # As JITFunction.run specializes a launch: pointers 16-byte aligned and integers divisible by
        # 16 carry tt.divisibility (vector loads and the loop pipeliner depend on it), an integer 1
        # becomes a constant. Without these attributes every gather compiled to 2-byte scalar loads.
        kind, attr = native_specialize_impl(
            BaseBackend,
            bound[name],
            False,
            not param.do_not_specialize,
            not param.do_not_specialize_on_alignment,
        )
        sig[name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    return triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs), target=H200, options=options
    )


def split_kernel_launch(
    config,
    batch: int = 1,
    pos: int = 126975,
    splits: int | None = None,
    fused_write: bool = True,
    observe: bool = False,
    kv_dtype=None,
):
    """The decode split kernel's launch as the served step makes it at Llama-3.1-8B's layer shape (bf16,
    W_local 256; ``config`` a ``DecodeConfig``), captured: ``(kernel, args, options)``. Captured on CPU
    tensors, the launch lacks what only CUDA launches ask for (PDL, the register cap): the options are
    ``config.launch_options("cuda")`` here, as the CUDA launch sets them. ``kv_dtype``: the pages'
    dtype (an FP8 one with its scales), bf16 when None."""
    import torch

    from sglang_wgkv.attention import decode_config as dc
    from sglang_wgkv.attention import triton_decode as td
    from sglang_wgkv.config import PAGE_SIZE

    B, Hq, H, D, R, W = batch, 32, 8, 128, batch + 1, 256
    bf = dict(dtype=torch.bfloat16)
    q, pages = torch.zeros(B, Hq, D, **bf), torch.zeros(16, PAGE_SIZE, D, dtype=kv_dtype or torch.bfloat16)
    if kv_dtype is not None:
        extra_scales = dict(k_scale=torch.ones(()), v_scale=torch.ones(()))
    else:
        extra_scales = {}
    page_table, global_len = (
        torch.zeros(R, 2, H, 8, dtype=torch.int32),
        torch.zeros(R, 2, H, dtype=torch.int32),
    )
    req, positions = torch.arange(1, B + 1), torch.full((B,), pos)
    ring = torch.clamp(positions + 1, max=W)
    splits = splits or dc.choose_num_splits(B, H, 131072, "cpu")
    extra = dict(extra_scales)
    if fused_write:
        new_k = torch.zeros(B, H, D, **bf)
        extra.update(new_k=new_k, new_v=new_k.clone(), pos=positions, window=W)
    if observe:
        extra["observe"] = (
            torch.zeros(R + 1, 32, Hq, D, **bf),
            torch.zeros(R + 1, 32, dtype=torch.int64),
            torch.full((R,), R, dtype=torch.int64),  # every slot on the scratch row: the evictor's map
        )
    ws = dc.FoldedDecodeWorkspace(B, Hq, D, splits, "cpu", num_kv_heads=H)
    with device_checks_off():
        # the split kernel is the first launch (a merge kernel follows it where not config.fused_merge)
        (kernel, bound, options), *_ = launches(
            lambda: td.folded_decode(
                q,
                pages,
                pages,
                page_table,
                global_len,
                req,
                ring,
                1,
                num_splits=splits,
                workspace=ws,
                config=config,
                **extra,
            )
        )
    options = {**options, **config.launch_options("cuda")}
    return kernel, {**bound, "PDL": "launch_pdl" in options}, options
