"""An extend forward's key ranges on the device, built once on the host: every layer's query and key
indptrs, and the FA3 calls' arguments that go with them.

=====================  ==================================================================  =========================
part                   holds                                                                when
=====================  ==================================================================  =========================
``indptrs``            ``qo [B + 1]``, ``kv [L, B + 1]`` int64: each request's keys are     always
                       its gathered context (``gather_context`` with ``context_gcols``)
                       then its new rows
``dense``              ``(qo, kv [L, B + 1], most new rows)`` in int32, FA3's dtype          a dense plan
                                                                                            (``exact_global``)
``window``             ``(call, qo, kv [L, B + 1], most new rows)`` in int32                FA3's window call
                                                                                            chosen, the plan not
                                                                                            dense, and its index
                                                                                            window the position
                                                                                            window
``longest_keys``       ``[L]`` host ints: each layer's longest key range                    always
=====================  ==================================================================  =========================

One pinned copy a forward (``to_device_many``), so no layer waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglang_wgkv.attention.fa3_band import window_safe
from sglang_wgkv.memory.context_index import context_counts
from sglang_wgkv.memory.host_copy import to_device_many


@dataclass(frozen=True)
class ExtendIndptrs:
    indptrs: tuple[torch.Tensor, torch.Tensor]
    dense: tuple | None
    window: tuple | None
    longest_keys: list[int]


def extend_indptrs(plan, num_layers: int, local_window: int, device, window_call=None) -> ExtendIndptrs:
    """The table's parts for ``plan`` (an ``ExtendPlan``); ``window_call``: FA3's window call where
    ``--wgkv-prefill-band fa3`` chose it."""
    L = num_layers
    n = np.asarray(plan.extend_lens, dtype=np.int64)
    qo = np.concatenate([[0], np.cumsum(n)])
    g_rows, ring_rows = context_counts(plan, L, local_window)
    keys = g_rows + ring_rows + n[None]  # [L, B]
    kv = np.concatenate([np.zeros((L, 1), np.int64), np.cumsum(keys, 1)], 1)
    parts = [(qo, np.int64), (kv, np.int64)]
    window = (
        window_call is not None and not plan.exact_global and window_safe(g_rows, ring_rows, local_window)
    )
    if plan.exact_global or window:
        parts += [(qo, np.int32), (kv, np.int32)]
    dev = to_device_many(device, parts)
    most_rows = int(n.max(initial=0))
    return ExtendIndptrs(
        indptrs=(dev[0], dev[1].view(L, -1)),
        dense=(dev[2], dev[3].view(L, -1), most_rows) if plan.exact_global else None,
        window=(window_call, dev[2], dev[3].view(L, -1), most_rows) if window else None,
        longest_keys=keys.max(1, initial=0).tolist(),
    )
