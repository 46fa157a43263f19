"""Packed variable-length batches for the vertical-slash prefill checks (GPU tests and the CPU
interpreter checks build the same cases)."""

from __future__ import annotations

import torch

from sglang_wgkv.config import FAR_POSITION

# lens_q, lens_k, W, p_admit, far_prefix
PREFILL_CASES = [
    ([700], [700], 64, 0.25, 0),
    ([1, 129, 300, 64], [1, 129, 300, 64], 32, 0.5, 0),
    ([50, 128, 0], [300, 128, 40], 16, 0.25, 0),  # extend after a cached prefix; empty query
    ([257], [257], 256, 0.0, 0),  # only the band
    ([400], [400], 16, 1.0, 0),  # everything admitted = dense causal
    ([96, 33], [200, 33], 48, 0.3, 37),  # pool layout: global entries at a far position
]


def packed_case(
    lens_q,
    lens_k,
    Hq,
    Hkv,
    D,
    p_admit,
    dtype,
    far_prefix=0,
    device="cpu",
    index_dtype=torch.int32,
    pos_dtype=None,
):
    """``(q, k, v, admitted, qo_indptr, kv_indptr, q_pos, k_pos)`` of a packed batch (torch's global
    generator); queries are the last lens_q positions of each sequence. far_prefix > 0 puts that many
    extra keys per sequence at ``FAR_POSITION`` (the pool's layout of global entries in
    ``gather_context``), admitted with probability p_admit. ``index_dtype``: of the indptrs (the
    served prefill's are int64) and, unless ``pos_dtype`` is given, of the positions (the served
    prefill's are int32)."""
    q_pos = [torch.arange(lk - lq, lk) for lq, lk in zip(lens_q, lens_k)]
    k_pos = [torch.cat([torch.full((far_prefix,), FAR_POSITION), torch.arange(lk)]) for lk in lens_k]
    return _pack(q_pos, k_pos, Hq, Hkv, D, p_admit, dtype, device, index_dtype, pos_dtype or index_dtype)


def pool_layout_case(
    lens_q,
    prefixes,
    far,
    window,
    Hq,
    Hkv,
    D,
    p_admit,
    dtype,
    device="cpu",
    index_dtype=torch.int32,
    pos_dtype=None,
):
    """:func:`packed_case`'s tuple in the layout ``DualCachePool.extend_inputs`` gives a chunk's keys:
    per sequence of ``n`` new rows after ``S`` cached tokens, ``far`` global entries at
    ``FAR_POSITION`` where tokens have left the ring (``S > window``, none otherwise), the ring (the
    last ``min(S, window)`` cached positions, in order), then the new rows at ``S .. S + n - 1``."""
    q_pos = [torch.arange(S, S + n) for n, S in zip(lens_q, prefixes)]
    k_pos = [
        torch.cat(
            [torch.full((far if S > window else 0,), FAR_POSITION), torch.arange(max(0, S - window), S + n)]
        )
        for n, S in zip(lens_q, prefixes)
    ]
    return _pack(q_pos, k_pos, Hq, Hkv, D, p_admit, dtype, device, index_dtype, pos_dtype or index_dtype)


def _pack(q_pos, k_pos, Hq, Hkv, D, p_admit, dtype, device, index_dtype, pos_dtype):
    """The packed tuple of sequences given by their query and key positions (lists of 1-D tensors):
    random q, k, v and admission flags drawn in that order."""
    qo = torch.tensor([0, *map(len, q_pos)]).cumsum(0).to(index_dtype).to(device)
    kv = torch.tensor([0, *map(len, k_pos)]).cumsum(0).to(index_dtype).to(device)
    Nq, Nk = int(qo[-1]), int(kv[-1])
    q = torch.randn(Nq, Hq, D, device=device).to(dtype)
    k = torch.randn(Nk, Hkv, D, device=device).to(dtype)
    v = torch.randn(Nk, Hkv, D, device=device).to(dtype)
    admitted = torch.rand(Nk, Hkv, device=device) < p_admit
    q_pos, k_pos = (torch.cat(p).to(pos_dtype).to(device) for p in (q_pos, k_pos))
    return q, k, v, admitted, qo, kv, q_pos, k_pos
