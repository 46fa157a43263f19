"""Where an extend forward's cached context comes from, for every layer and request at once.

A request continuing after a cached prefix (a chunk of a long prompt, a prefix-cache hit) attends to
its cached context: its global entries (the longest head's page columns, padding not admitted, at
``FAR_POSITION``; without padding where the plan's requests keep every token, ``exact_global``) and its ring in position order, then its new rows. :class:`ContextIndex` lists, for
the whole forward, each context row's pool row per KV head, its admission flag and where it lands in
each layer's packed keys, so that a layer's attention inputs are a fixed handful of gathers and
scatters however many requests the batch holds (:meth:`ExtendStep.extend_inputs`); reading them one
request at a time took about twenty small launches per request and layer.

| per forward (``build_context_index``, by the first ``extend_inputs``) | per layer (``extend_inputs``) |
| --- | --- |
| host: every context row's (slot, layer, page column, offset), packed rows, key positions | K: one gather from the pages, two scatters (context rows, new rows); V the same |
| one copy to the device; page ids, global lengths and ring flags read in five launches | admission flags: two scatters; positions: a slice |

Valid for the forward it was built for: a layer's context is read before that layer's own write, and
no other layer's write touches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglang_wgkv.config import FAR_POSITION, PAGE_SIZE


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(n) for n in lengths])`` without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def context_counts(plan, num_layers: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(global rows [L, B], ring rows [L, B])`` of each request's cached context per layer, as
    :func:`~sglang_wgkv.memory.extend_step.context_rows` counts them, for a whole ``ExtendPlan``."""
    B = len(plan.prefix_lens)
    S = np.asarray(plan.prefix_lens, dtype=np.int64)
    if plan.exact_global:  # every token kept: each head holds the S - W tokens past the ring, no padding
        g = np.broadcast_to(np.maximum(S - window, 0), (num_layers, B))
    else:
        g = np.asarray(plan.context_gcols, dtype=np.int64).reshape(B, num_layers).T * PAGE_SIZE
    return g, np.broadcast_to(np.minimum(S, window), g.shape)


@dataclass(frozen=True)
class ContextIndex:
    """One extend forward's context rows (``R`` over all layers) and packed keys, on the device."""

    bounds: list  # [L] (start, end): layer l's rows of flat, admitted, dst
    key_bounds: list  # [L] (start, end): layer l's keys in k_pos
    flat: torch.Tensor  # [R, H] int64 row of pages.view(-1, D): page * PAGE_SIZE + offset
    admitted: torch.Tensor  # [R, H] bool
    dst: torch.Tensor  # [R] int64 row of the context row in its layer's packed keys
    new_dst: torch.Tensor  # [L, N] int64 row of each new token in each layer's packed keys
    k_pos: torch.Tensor  # [sum of keys over layers] int64 positions of each layer's packed keys


def build_context_index(pool, plan) -> ContextIndex | None:
    """The :class:`ContextIndex` of ``plan`` (an ``ExtendPlan`` of ``pool``), or None when no request
    of it has cached context (its keys are then its new rows)."""
    L, W, B = pool.num_layers, pool.window, len(plan.prefix_lens)
    S = np.asarray(plan.prefix_lens, dtype=np.int64)
    n = np.asarray(plan.extend_lens, dtype=np.int64)
    g, rings = context_counts(plan, L, W)  # [L, B]
    ring = np.minimum(S, W)  # [B]
    ctx = g + rings
    if not ctx.any():
        return None
    keys = ctx + n[None]
    kv_start = np.cumsum(keys, 1) - keys  # [L, B] first packed row of each request in each layer

    # context rows, (layer, request) pairs in layer-major order, each: global rows, then ring rows
    counts = ctx.reshape(-1)
    pair = np.repeat(np.arange(L * B), counts)
    i = ragged_arange(counts)
    pl, pb = pair // B, pair % B
    gp = g.reshape(-1)[pair]
    is_global = i < gp
    pos = S[pb] - ring[pb] + (i - gp)  # the ring row's position
    slot = np.where(is_global, 0, pos % W)
    col = np.where(is_global, pool.ring_cols + i // PAGE_SIZE, slot // PAGE_SIZE)
    off = np.where(is_global, i % PAGE_SIZE, slot % PAGE_SIZE)
    row = np.where(is_global, i, -1)  # a global row is admitted iff its row < the head's global length
    dst = kv_start.reshape(-1)[pair] + i

    t = ragged_arange(n)  # new rows
    tb = np.repeat(np.arange(B), n)
    new_dst = (kv_start + ctx)[:, tb] + t[None]  # [L, N]
    num_keys = keys.sum(1)
    key_base = np.cumsum(num_keys) - num_keys
    k_pos = np.empty(int(num_keys.sum()), dtype=np.int64)
    k_pos[key_base[pl] + dst] = np.where(is_global, FAR_POSITION, pos)
    k_pos[(key_base[:, None] + new_dst).reshape(-1)] = np.tile(S[tb] + t, L)

    slots = np.asarray(plan.req_slots, dtype=np.int64)[pb]
    host = np.concatenate([slots, pl, col, off, slot, row, is_global, dst, new_dst.reshape(-1), k_pos])
    dev = torch.from_numpy(host)
    if pool.device.type == "cuda":
        dev = dev.pin_memory().to(pool.device, non_blocking=True)
    R, N = len(pair), len(t)
    r_, l_, col_, off_, slot_, row_, glob_, dst_ = dev[: 8 * R].view(8, R)
    pages = pool.page_table[r_, l_, :, col_]  # [R, H]
    flat = pages.long() * PAGE_SIZE + off_[:, None]
    admitted = torch.where(
        glob_.bool()[:, None], row_[:, None] < pool.global_len[r_, l_], pool.ring_flag[r_, l_, :, slot_]
    )
    ends = np.cumsum(ctx.sum(1))
    key_ends = np.cumsum(num_keys)
    return ContextIndex(
        bounds=list(zip((ends - ctx.sum(1)).tolist(), ends.tolist())),
        key_bounds=list(zip((key_ends - num_keys).tolist(), key_ends.tolist())),
        flat=flat,
        admitted=admitted,
        dst=dst_,
        new_dst=dev[8 * R : 8 * R + L * N].view(L, N),
        k_pos=dev[8 * R + L * N :],
    )
