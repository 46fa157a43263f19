"""The plan of one extend forward (:meth:`~sglang_wgkv.memory.extend_step.ExtendStep.begin_extend`):
host-built index lists shared by all layers, and what the first layer's reads build for the others.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_wgkv.memory.context_index import ContextIndex


@dataclass
class ExtendPlan:
    """Host-built index lists for one extend forward, shared by all layers (device tensors)."""

    req: torch.Tensor  # [B] request slots
    prefix_lens: list  # host copy of S per request
    req_slots: list  # host copy of the request slots
    extend_lens: list  # host copy of n per request
    cand_b: torch.Tensor  # [C] batch index of each token leaving the ring (position order per b)
    cand_from_ring: torch.Tensor  # [C] bool: source is the old ring (else the new tokens)
    cand_slot: torch.Tensor  # [C] ring slot (ring source)
    cand_src: torch.Tensor  # [C] packed token index (new-token source)
    cand_bounds: torch.Tensor  # [B + 1] each request's first candidate, then C
    max_new_pages: int  # upper bound of new global pages per stream
    rw_b: torch.Tensor  # [M] batch index of each new token that lands in the ring
    rw_slot: torch.Tensor  # [M] its ring slot
    rw_src: torch.Tensor  # [M] its packed token index
    # () -> [B][L] host: global page columns gather_context reads (0 without a prefix), read from the
    # pool (one host sync) the first time context_gcols is asked for, before any write of the forward
    read_gcols: Callable[[], list]
    # the torch path's context rows of every layer, built by its first extend_inputs (None: no context)
    context: ContextIndex | None = None
    context_built: bool = False
    # every request of the plan keeps every token and holds only its own rows, or is inside its ring
    # (set before the first extend_inputs): its context's global rows are exactly its S - W_local
    # tokens past the ring, no page padding, so the keys are dense in position order (fa3_dense.py)
    exact_global: bool = False
    _gcols: list | None = None

    @property
    def context_gcols(self) -> list:
        """``[B][L]`` global page columns of each request's cached context (the longest KV head's);
        read once, on first use: a plan marked ``exact_global`` never needs them, and so never waits
        for the forward before it."""
        if self._gcols is None:
            self._gcols = self.read_gcols()
        return self._gcols

    # the Triton path's: [L, B, 7] segment rows on the device, and per layer the most rows a request
    # has and the rows in all (host ints), built by its first extend_inputs
    segments: torch.Tensor | None = None
    segment_rows: list | None = None
