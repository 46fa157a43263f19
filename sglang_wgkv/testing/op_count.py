"""What a piece of the served path launches, counted on CPU: the aten ops that become device kernels,
the ones that make the host wait for the device, and the Triton launches (run under
``TRITON_INTERPRET=1``). A forward bound by its host costs about a launch's host time per launch, so
these counts are its host work (``benchmarks/host_ops.py``).

| aten op | on a GPU | counted as |
| --- | --- | --- |
| views, reshapes of contiguous tensors, allocations without fill | no kernel | not counted |
| :data:`SYNC` (a scalar read, ``nonzero``, ``equal``...) | a copy and a wait for the device | ``sync`` |
| any other | a kernel (a fill, an index op, a copy, a reduction) | ``torch`` |

Triton launches count as ``triton`` by kernel name; the torch ops an interpreted launch makes itself
are not counted. Host-to-device copies of host arrays (``to_device``) are no ops on CPU, nor are
``.tolist()`` reads of CPU tensors: on a GPU the latter are syncs, so their count here is a floor.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

FREE = {
    "alias",
    "as_strided",
    "detach",
    "empty",
    "empty_like",
    "empty_strided",
    "expand",
    "lift_fresh",
    "new_empty",
    "new_empty_strided",
    "permute",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "squeeze",
    "t",
    "transpose",
    "unbind",
    "unflatten",
    "unsqueeze",
    "view",
    "_reshape_alias",
    "_unsafe_view",
    "view_as_real",
    "view_as_complex",
}
SYNC = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2"}


class _Counter(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            if name not in FREE:
                self.counts[("sync" if name in SYNC else "torch", name)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_ops():
    """``with counting_ops() as counts:`` a Counter of ``(kind, name)`` over the block: ``kind`` is
    ``torch``, ``sync`` or ``triton`` (see the module's table)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counts: Counter = Counter()
    mode = _Counter(counts)
    patches = []
    for cls in (InterpretedFunction, JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            fn = getattr(self, "fn", None)
            counts[("triton", getattr(fn, "__name__", type(self).__name__))] += 1
            mode.paused += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                mode.paused -= 1

        patches.append(mock.patch.object(cls, "run", run))
    for p in patches:
        p.start()
    try:
        with mode:
            yield counts
    finally:
        for p in patches:
            p.stop()


def totals(counts: Counter) -> dict[str, int]:
    """``{kind: count}`` of :func:`counting_ops`'s Counter."""
    out: dict[str, int] = {}
    for (kind, _), n in counts.items():
        out[kind] = out.get(kind, 0) + n
    return out
