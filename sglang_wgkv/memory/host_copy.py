"""Host arrays to the device without a host sync: one pinned staging buffer and one non-blocking copy
per call, each array a view of the copied bytes; and a device count to the host the same way
(:class:`QueuedCount`: read once it has landed, never waited for).

``torch.as_tensor(array, device="cuda")`` copies from pageable memory, which waits for the stream: the
host stops running ahead of the GPU, and the GPU then idles while the host launches what follows.
"""

import numpy as np
import torch


def to_device(device: torch.device, parts, dtype=np.int64) -> torch.Tensor:
    """A host array (or a list of arrays, concatenated) as a tensor on ``device``, copied without a
    host sync on CUDA: pinned staging and a non-blocking copy (``torch.tensor(list, device=cuda)``
    waits for the stream, which stops the host from running ahead of the GPU)."""
    if isinstance(parts, list):
        parts = np.concatenate(parts) if parts else np.zeros(0)
    return to_device_many(device, [(parts, dtype)])[0].view(np.shape(parts))


# numpy dtypes a packed copy carries, as torch views them. Every part starts at a multiple of 16 bytes,
# as a tensor of its own would: Triton specializes its kernels on pointers' 16-byte alignment
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.bool_): torch.bool,
}


def to_device_many(device: torch.device, parts: list[tuple]) -> list[torch.Tensor]:
    """Host arrays ``[(array or list of arrays, dtype), ...]`` as flat tensors on ``device``, through
    one staging buffer and one copy: a forward's plan of ten index lists paid ten pinned allocations and
    copies while the GPU idled (``launch/results/served_speed/M1D_M1P_h100_knee4``)."""
    arrays = []
    for a, dtype in parts:
        if isinstance(a, list):
            a = np.concatenate(a) if a else np.zeros(0)
        arrays.append(np.ascontiguousarray(a, dtype=dtype).reshape(-1))
    sizes = [-(-a.nbytes // 16) * 16 for a in arrays]
    packed = np.zeros(sum(sizes), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for a, o in zip(arrays, offsets):
        packed[o : o + a.nbytes] = a.view(np.uint8)
    host = torch.from_numpy(packed)
    if torch.device(device).type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    return [dev[o : o + a.nbytes].view(_TORCH_DTYPES[a.dtype]) for a, o in zip(arrays, offsets)]


class QueuedCount:
    """A device scalar copied to the host behind the work queued on the current stream, without
    waiting: :meth:`value` is None until the copy has landed. On a CPU device it is there at once.
    ``reuse``: :meth:`queue` copies again into the same pinned buffer once the last copy has landed
    (a count taken over and over); without it the pinned buffer goes back to torch's cache as soon as
    the value is read (a count kept as long as what it counts: only copies in flight hold one)."""

    def __init__(self, count: torch.Tensor, reuse: bool = False):
        self._host, self._done, self._value, self._reuse = None, None, None, reuse
        self.queue(count)

    def queue(self, count: torch.Tensor) -> None:
        self._value = None
        if count.device.type != "cuda":
            self._value = int(count)
            return
        if self._done is not None and not self._done.query():
            raise RuntimeError("QueuedCount.queue: the last copy has not landed")
        if self._host is None:
            self._host = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._event = torch.cuda.Event()
        self._host.copy_(count, non_blocking=True)
        self._event.record()
        self._done = self._event

    def value(self) -> int | None:
        if self._value is None:
            if self._done is None or not self._done.query():
                return None
            self._value, self._done = int(self._host), None
            if not self._reuse:
                self._host = self._event = None
        return self._value
