"""The model shape a capacity plan serves and the per-request-slot memory of the WG-KV state besides
pages (page-table rows, ring flags, the evictor's query windows), in dense tokens."""

import math
from dataclasses import dataclass

from sglang_wgkv.config import PAGE_SIZE


@dataclass(frozen=True)
class FixedCosts:
    """Per-request-slot memory of the WG-KV state besides pages, in dense tokens (rounded up).

    slot_tokens : page-table row, ring flags, global lengths of one slot (every layer and head).
    window_tokens : the evictor's query window of one slot (0 without ``--kv-budget``).
    """

    slot_tokens: int
    window_tokens: int = 0

    @property
    def per_slot(self) -> int:
        return self.slot_tokens + self.window_tokens


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of this rank's share of the model and the served context."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    context_len: int
    dtype_bytes: int  # one K or V element in the pool (1 for FP8)
    query_bytes: int | None = None  # one query element (the model's dtype); default dtype_bytes

    @property
    def token_bytes(self) -> int:
        """One dense token: K and V of every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def fixed_costs(shape: ModelShape, local_window: int, evictor_window: int | None) -> FixedCosts:
    """:class:`FixedCosts` of one request slot of a dual pool serving ``shape`` with W_local
    ``local_window``; ``evictor_window`` queries per (slot, layer) when the evictor is on."""
    streams = shape.num_layers * shape.num_kv_heads
    cols = local_window // PAGE_SIZE + max(0, math.ceil((shape.context_len - local_window) / PAGE_SIZE)) + 1
    # page_table int32 + ring_flag bool + global_len int32 + evictor stream counters int64
    slot_bytes = streams * (4 * cols + local_window + 4 + 8)
    window = 0
    if evictor_window:
        window = -(
            -shape.num_layers
            * evictor_window
            * shape.num_q_heads
            * shape.head_dim
            * (shape.query_bytes or shape.dtype_bytes)  # the evictor's query window: model dtype
            // shape.token_bytes
        )
    return FixedCosts(slot_tokens=-(-slot_bytes // shape.token_bytes), window_tokens=window)
