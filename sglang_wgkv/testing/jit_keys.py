"""Which compiled variant of each Triton kernel a launch would need on a Hopper GPU, recorded on CPU.

Triton compiles a kernel once per *specialization*: the dtypes of its tensors, each pointer's 16-byte
alignment, each integer's ``== 1`` and ``% 16 == 0``, every ``tl.constexpr`` and the launch options
(``num_warps``, ``num_stages``), unless ``do_not_specialize`` / ``do_not_specialize_on_alignment``
say otherwise. A served forward whose variant was not compiled at start-up stops the scheduler for the
compile (seconds). :func:`recording_jit_keys` runs the launches as usual (the interpreter on CPU) and
computes, with Triton's own binder for an sm_90 target, the key each launch would compile under:

===================  ================================================================================
key part             from
===================  ================================================================================
signature            Triton's binder: ``("*bf16", "D")`` a 16-byte-aligned pointer, ``("i32", "D")``
                     an integer divisible by 16, ``("constexpr", 1)`` an integer equal to 1,
                     ``("i32", None)`` one left unspecialized
launch options       the keyword arguments that are not parameters (``num_warps``, ``num_stages``)
===================  ================================================================================
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from unittest import mock

_LAUNCH_ONLY = ("grid", "warmup")


def _binder(fn, cache: dict):
    """Triton's argument binder of ``fn`` (a JITFunction, or the InterpretedFunction of one) for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    key = id(fn)
    if key not in cache:
        jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        cache[key] = (fn, create_function_from_signature(jit.signature, jit.params, backend))
    return cache[key][1]


def launch_key(fn, args: tuple, kwargs: dict, cache: dict) -> tuple:
    """The variant a launch of ``fn`` with ``args`` / ``kwargs`` compiles under (module table)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in _LAUNCH_ONLY}
    _, specialization, options = _binder(fn, cache)(*args, **kwargs)
    return tuple(tuple(s) for s in specialization), tuple(sorted(options.items()))


@contextmanager
def recording_jit_keys():
    """``with recording_jit_keys() as keys:`` ``{kernel name: set of keys}`` of every Triton launch in
    the block (:func:`launch_key`)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    keys: dict[str, set] = defaultdict(set)
    cache: dict = {}
    patches = []
    for cls in (InterpretedFunction, JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            keys[self.fn.__name__].add(launch_key(self, args, kwargs, cache))
            return _original(self, *args, **kwargs)

        patches.append(mock.patch.object(cls, "run", run))
    for p in patches:
        p.start()
    try:
        yield keys
    finally:
        for p in patches:
            p.stop()


def differences(keys: set) -> list[int]:
    """Positions of the signature entries that differ between the keys of one kernel (where its
    variants come from); ``-1`` when the launch options differ."""
    sigs = [k[0] for k in keys]
    out = [i for i in range(len(sigs[0])) if len({s[i] for s in sigs}) > 1] if sigs else []
    if len({k[1] for k in keys}) > 1:
        out.append(-1)
    return out
