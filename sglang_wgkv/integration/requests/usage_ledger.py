"""A finished request's usage counts without waiting for the forward in flight.

Under SGLang's overlap scheduler a request's slot is freed while the scheduler handles the results of
forward ``k`` and forward ``k + 1`` already runs, carrying the request's overlap step (whose token
SGLang drops). Reading the slot's global lengths then is a host sync behind forward ``k + 1`` (which
the scheduler's stream waits for) and counts that dropped step. The ledger instead copies every slot's
counts at each launch, on the forward stream behind forward ``k``, into host memory; a free reads the
copy made at the launch after the forward whose results it handles:

=================================  =================================  ================================
a slot freed while                 counts read                        the host waits for
=================================  =================================  ================================
a forward was launched after the   the copy made at that launch: the  that copy, queued right after
last one processed (overlap)       slot after the forward handled     the forward handled (done: its
                                                                      results are being processed)
none was (no overlap; or nothing   the slot itself                    nothing in flight
launched since); or the slot got
a new owner after that launch
=================================  =================================  ================================

So a request's usage is the same with and without overlap: as of the last token it was given.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SlotCounts:
    """What a request's usage is computed from (:func:`~.control.request_usage`)."""

    kept: int  # global tokens summed over the slot's (layer, KV head) streams
    max_global: int  # the longest stream's global tokens
    cached: int  # tokens in the slot (ring and global)
    triggers: int  # evictor passes that cut one of its streams
    evicted: int  # tokens the evictor dropped
    early: int  # evictor passes before the end of its prompt


def read_counts(dual, slot: int, evictor=None) -> SlotCounts:
    """The slot's counts now (syncs)."""
    glen = dual.global_len[slot]
    ev = (0, 0, 0) if evictor is None else tuple(int(x[slot]) for x in evictor.request_counters())
    return SlotCounts(int(glen.sum()), int(glen.max()), int(dual.cached_len[slot]), *ev)


class UsageLedger:
    """Every slot's counts as of the last launch under the overlap scheduler (module table).

    ``launched`` / ``processed``: forwards launched (with a copy) and results processed since start."""

    def __init__(self):
        self.launched = self.processed = 0
        self._table: torch.Tensor | None = None  # [slots, 2] int64 on the host: kept, max_global
        self._host: tuple[np.ndarray, ...] = ()  # cached, triggers, evicted, early, per slot
        self._generation: np.ndarray | None = None  # each slot's owner at the launch
        self._done = None

    def record(self, dual, evictor, device_module, stream) -> None:
        """At a launch: queue the copy of every slot's counts on ``stream`` (the forward stream),
        behind the forward before; the host counts as they are before this forward moves them."""
        glen = dual.global_len.flatten(1)
        if self._table is None:
            self._table = torch.empty((glen.shape[0], 2), dtype=torch.int64, pin_memory=glen.is_cuda)
        with device_module.stream(stream) if glen.is_cuda else contextlib.nullcontext():
            counts = torch.stack((glen.sum(1, dtype=torch.int64), glen.amax(1).long()), 1)
            self._table.copy_(counts, non_blocking=glen.is_cuda)
            if glen.is_cuda:
                self._done = device_module.Event()
                self._done.record(stream)
        counters = evictor.request_counters() if evictor is not None else ()
        self._host = (dual.cached_len.copy(), *(c.copy() for c in counters))
        self._generation = dual.generation.copy()
        self.launched += 1

    def in_flight(self) -> bool:
        """Whether a forward was launched after the last one whose results were processed."""
        return self.launched > self.processed

    def counts(self, slot: int) -> SlotCounts:
        """The slot's counts at the last launch (waits for that copy only)."""
        if self._done is not None:
            self._done.synchronize()
        cached, *ev = (int(x[slot]) for x in self._host)
        kept, max_global = (int(x) for x in self._table[slot])
        return SlotCounts(kept, max_global, cached, *(ev or (0, 0, 0)))

    def counts_for_free(self, dual, slot: int, evictor=None) -> SlotCounts:
        """A freed slot's counts (module table)."""
        if self.in_flight() and self._generation[slot] == dual.generation[slot]:
            return self.counts(slot)
        return read_counts(dual, slot, evictor)
