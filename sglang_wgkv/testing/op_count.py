"""What a piece of the served path launches, counted on CPU: the aten ops that become device kernels,
the ones that make the host wait for the device, and the Triton launches (run under
``TRITON_INTERPRET=1``). A forward bound by its host costs about a launch's host time per launch, so
these counts are its host work (``benchmarks/host_ops.py``).

| aten op | on a GPU | counted as |
| --- | --- | --- |
| views, reshapes of contiguous tensors, allocations without fill | no kernel | not counted |
| :data:`SYNC` (a scalar read, ``nonzero``, ``equal``...), an index by a boolean mask | a copy and a wait for the device | ``sync`` |
| ``copy_`` into a device tensor from a host one or a host scalar (``t[i] = x``, ``t`` 1-D), blocking; ``t[idx] = x`` (``index_put_`` of a host scalar) | a copy from pageable memory, then a wait for the stream | ``sync`` |
| any other | a kernel (a fill, an index op, a copy, a reduction) | ``torch`` |

Triton launches count as ``triton`` by kernel name; the torch ops an interpreted launch makes itself
are not counted. Host-to-device copies of host arrays (``to_device``) are no ops on CPU.

Reads to the host that dispatch no aten op on CPU are counted as ``sync`` too, by the Python method
(``tolist``, ``cpu``, ``numpy``, ``__array__``), when the tensor read would live on the device when
served. Where a tensor lives, as served:

| tensor | lives | its ops |
| --- | --- | --- |
| one of ``host_tensors`` (a batch's ``*_cpu`` fields), or made by an op on one and no device tensor | host | not counted (host work, no launch) |
| one of ``device_tensors`` (a batch's device fields, a pool's state), or made by an op on one | device | counted |
| made by a counted op from neither (``torch.zeros``, a host array's copy) | device | counted |
| a view of a tensor made outside the block from neither (``torch.from_numpy``) | host | |
"""

from __future__ import annotations

import weakref
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import torch
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


INDEX_PUT = ("index_put", "index_put_", "_index_put_impl_")


def _bool_index(name: str, args) -> bool:
    """``t[mask]`` / ``t[mask] = v``: a boolean index is turned into positions on the host (a wait)."""
    if (name != "index" and name not in INDEX_PUT) or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


def _flat(args):
    """An op's arguments, the members of list and tuple arguments in their place."""
    for a in args:
        yield from a if isinstance(a, (list, tuple)) else (a,)


# Tensor methods that read a tensor to the host without an aten op on CPU (each a wait on a GPU)
HOST_READS = ("tolist", "cpu", "numpy", "__array__")


class _Counter(TorchDispatchMode):
    def __init__(self, counts: Counter, device_tensors=(), host_tensors=()):
        super().__init__()
        self.counts = counts
        self.paused = 0
        self._where: dict[int, tuple] = {}  # id -> (weakref, on the device) (a WeakSet compares tensors)
        for tensors, on_device in ((device_tensors, True), (host_tensors, False)):
            for t in tensors:
                self.mark(t, on_device)

    def mark(self, t, on_device: bool) -> None:
        if isinstance(t, torch.Tensor):
            self._where[id(t)] = (weakref.ref(t), on_device)

    def lives(self, t) -> bool | None:
        """True on the device, False on the host, None if neither was seen."""
        got = self._where.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            name = func.overloadpacket.__name__
            seen = {self.lives(t) for t in _flat(args)}
            on_device = True if True in seen else False if False in seen else name not in FREE
            if on_device and name not in FREE:
                waits = name in SYNC or _bool_index(name, args) or self._host_copy(name, args, kwargs)
                self.counts[("sync" if waits else "torch", name)] += 1
            if on_device or False in seen:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    self.mark(t, on_device)
        return out

    def _from_host(self, t) -> bool:
        """Host memory: a host tensor, or a 0-dim one never seen (a Python scalar made a tensor)."""
        if not isinstance(t, torch.Tensor):
            return False
        where = self.lives(t)
        return where is False or (where is None and t.dim() == 0)

    def _host_copy(self, name: str, args, kwargs) -> bool:
        """A blocking copy into the device from host memory: a CUDA copy from pageable memory that
        then waits for the stream (and what it waits for). ``dst.copy_(src)``; ``t[i] = x`` on a 1-D
        device tensor (the 0-dim destination takes a copy of a host scalar, not a fill); ``t[idx] =
        x`` with an index tensor (``index_put_`` moves a host scalar value to the device first)."""
        if len(args) < 2 or self.lives(args[0]) is not True:
            return False
        if name == "copy_":
            blocking = not (args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False))
            return blocking and self._from_host(args[1])
        if name in INDEX_PUT and len(args) > 2:
            return self._from_host(args[2]) and args[2].dim() == 0
        return False

    def host_read(self, name: str, original):
        def read(tensor, *args, **kwargs):
            if self.paused or not self.lives(tensor):
                return original(tensor, *args, **kwargs)
            self.counts[("sync", name)] += 1
            self.paused += 1
            try:  # an alias the rest of the read sees as host memory (``.cpu().numpy()`` waits once)
                return original(tensor.detach().view_as(tensor) if name == "cpu" else tensor, *args, **kwargs)
            finally:
                self.paused -= 1

        return read


@contextmanager
def counting_ops(device_tensors=(), host_tensors=()):
    """``with counting_ops() as counts:`` a Counter of ``(kind, name)`` over the block: ``kind`` is
    ``torch``, ``sync`` or ``triton`` (see the module's tables). ``device_tensors`` / ``host_tensors``:
    tensors made before the block that live on the device / on the host when served."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counts: Counter = Counter()
    mode = _Counter(counts, device_tensors, host_tensors)
    patches = [
        mock.patch.object(torch.Tensor, n, mode.host_read(n, getattr(torch.Tensor, n))) for n in HOST_READS
    ]
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
