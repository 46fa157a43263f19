"""From gate values to admission flags."""

import torch


class GateOutputError(ValueError):
    pass


def check_gate_output(g: torch.Tensor, layer_id: int | None = None) -> None:
    """Raise GateOutputError if ``g`` holds NaN or values outside [0, 1] (syncs: use off the decode path)."""
    bad = ~((g >= 0) & (g <= 1))  # NaN compares False
    if bool(bad.any()):
        where = f" in layer {layer_id}" if layer_id is not None else ""
        raise GateOutputError(
            f"write gate produced {int(bad.sum())} NaN/out-of-range values{where}; "
            "the gate checkpoint or the model's keys are broken"
        )


class DeferredGateCheck:
    """:func:`check_gate_output` for the served prefill without a host sync per layer.

    On CUDA, :meth:`record` adds each layer's count of NaN/out-of-range gate values to a device
    counter; :meth:`end_forward` copies the counters to pinned host memory behind an event;
    :meth:`poll` raises :class:`GateOutputError` once that copy has landed and is not zero (it never
    waits, so the error surfaces at a later forward than the one that produced it). The counts
    accumulate, so a copy overtaken by the next one loses nothing. Elsewhere :meth:`record` checks at
    once (a sync costs nothing on the CPU), unless ``deferred`` asks for the CUDA behaviour (a CPU
    check of what the served path launches: the copy is then done when it is recorded).
    """

    def __init__(self, num_layers: int, device, deferred: bool | None = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.deferred = cuda if deferred is None else deferred
        self.num_layers = num_layers
        self.bad = torch.zeros(num_layers, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(num_layers, dtype=torch.int64, pin_memory=self.deferred and cuda)
        self._event = (torch.cuda.Event() if cuda else _DoneEvent()) if self.deferred else None
        self._pending = False
        self._values: torch.Tensor | None = None  # [L, rows padded, ...]: this forward's gate values
        self._shape: torch.Size | None = None  # the gate values' shape
        self._recorded = False  # values in the buffer not yet counted

    def slot(self, layer_id: int, shape) -> torch.Tensor:
        """A contiguous float32 ``shape`` buffer for layer ``layer_id``'s gate values, to be passed to
        :meth:`record` once written: on CUDA a row of this forward's buffer (no copy), else new."""
        if not self.deferred:
            return torch.empty(shape, dtype=torch.float32, device=self.device)
        self._buffer(torch.Size(shape), torch.float32)
        return self._values[layer_id, : shape[0]]

    def record(self, g: torch.Tensor, layer_id: int) -> None:
        if not self.deferred:
            check_gate_output(g, layer_id)
            return
        # one copy per layer (none for a slot's values); the check runs once over all layers in end_forward
        self._buffer(g.shape, g.dtype)
        row = self._values[layer_id, : g.shape[0]]
        if g.data_ptr() != row.data_ptr():
            row.copy_(g)
        self._recorded = True

    def _buffer(self, shape: torch.Size, dtype: torch.dtype) -> None:
        """This forward's ``[L, rows, ...]`` buffer, zeros where no gate wrote (in range: never counted),
        ``rows`` padded to a multiple of 16: every layer's row then starts 16-byte aligned, as the
        kernel writing it was compiled for (Triton specializes a pointer on that alignment)."""
        rows = -(-shape[0] // 16) * 16
        if self._values is None or self._shape != shape or self._values.dtype != dtype:
            self._flush()
            self._values = torch.zeros(self.num_layers, rows, *shape[1:], dtype=dtype, device=self.device)
            self._shape = shape

    def _flush(self) -> None:
        """Count the buffer's out-of-range values per layer, then clear it for the next forward."""
        if not self._recorded:
            return
        self.bad += (~((self._values >= 0) & (self._values <= 1))).flatten(1).sum(1)
        self._values.zero_()
        self._recorded = False

    def end_forward(self) -> None:
        if self.deferred:
            self._flush()
            self.host.copy_(self.bad, non_blocking=True)
            self._event.record()
            self._pending = True

    def poll(self) -> None:
        if not self._pending or not self._event.query():
            return
        self._pending = False
        bad = self.host.tolist()
        if any(bad):
            layer = next(i for i, c in enumerate(bad) if c)
            raise GateOutputError(
                f"write gate produced {sum(bad)} NaN/out-of-range values (first in layer "
                f"{layer}); the gate checkpoint or the model's keys are broken"
            )


class _DoneEvent:
    """A CUDA event's ``record``/``query`` where work completes as it is issued (the CPU)."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


def admission_flags(
    g: torch.Tensor,
    tau: float,
    random_admission: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``g >= tau`` (bool, same shape), or Bernoulli(``random_admission``) flags for profiling runs
    (the paper's protocol: the gate is still computed, its decision replaced)."""
    if random_admission is None:
        return g >= tau
    return torch.rand(g.shape, device=g.device, generator=generator) < random_admission
