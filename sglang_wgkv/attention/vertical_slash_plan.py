"""Device-side work lists for vertical-slash prefill attention (no host sync, no loop over heads).

Query block ``i`` (``block_m`` consecutive queries of one sequence, positions ``p_lo .. p_hi``) sees
key ``j`` of KV head ``h`` iff ``pos_j <= pos_q`` and (``pos_q - pos_j < W`` or ``admitted[j, h]``).
The keys split into two disjoint ranges::

    keys of the sequence, in position order
    | pos <= p_lo - W                           | p_lo - W < pos <= p_hi      | pos > p_hi |
    | vertical: only admitted keys are visible, | band: exact mask per        | never      |
    |   and to *every* query of the block       |   (query, key)              | visible    |

so the vertical range is a dense, unmasked attention over the admitted keys of head ``h`` once they
are compacted (``k_compact[h, kv_start : kv_start + vertical_len[i, h]]``), and only the band, at most
``W + block_m - 1`` keys wide, needs a mask.
"""

from dataclasses import dataclass

import torch

_SEQ_SHIFT = 40  # composite sort key: sequence id * 2**40 + position (positions stay below 2**40)


@dataclass(frozen=True)
class VerticalSlashPlan:
    """Work lists for one forward (shared by the layers whose admission masks are the same)."""

    block_m: int
    q_start: torch.Tensor  # [NB] int32 first packed query row of block i (== q_end: no work)
    q_end: torch.Tensor  # [NB] int32
    kv_start: torch.Tensor  # [NB] int32 first packed key row of the block's sequence
    band_start: torch.Tensor  # [NB] int32 packed key rows [band_start, band_end) need the mask
    band_end: torch.Tensor  # [NB] int32
    vertical_len: torch.Tensor  # [NB, Hkv] int32 admitted keys fully visible to the block


def compact_admitted(
    k: torch.Tensor,
    v: torch.Tensor,
    admitted: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Admitted rows of each KV head moved to the front of their sequence's range, in position order.

    Parameters
    ----------
    k, v : ``[Nk, Hkv, D]`` packed keys and values; admitted : ``[Nk, Hkv]`` bool; kv_indptr : ``[B + 1]``.
    out : optional ``([Hkv, Nk + 1, D], [Hkv, Nk + 1, D])`` buffers whose rows are finite (e.g.
        zero-filled once).

    Returns ``(k_compact, v_compact)``, each ``[Hkv, Nk + 1, D]``: for sequence b and head h, rows
    ``kv_indptr[b] ..`` hold its admitted rows in order; the rest of its range keeps its old (finite)
    values, row ``Nk`` is scratch. The kernel reads whole tiles past the admitted count and masks
    their scores, so a NaN there would leak through ``0 * NaN`` in the value product.
    """
    Nk, H, D = k.shape
    dest = torch.where(admitted, admitted_rank(admitted, kv_indptr), Nk)
    if out is None:
        out = (k.new_zeros(H, Nk + 1, D), v.new_zeros(H, Nk + 1, D))
    heads = torch.arange(H, device=k.device)[None, :].expand(Nk, H)
    out[0][heads, dest] = k
    out[1][heads, dest] = v
    return out


def admitted_rank(admitted: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """``[Nk, Hkv]`` int64: kv_start of the key's sequence + admitted keys before it in that sequence."""
    Nk, H = admitted.shape
    excl = _exclusive_count(admitted)
    kv = kv_indptr.long()
    kseq = torch.searchsorted(kv[1:], torch.arange(Nk, device=admitted.device), right=True)
    start = kv[kseq]
    return start[:, None] + excl[:-1].long() - excl[start].long()


def _exclusive_count(admitted: torch.Tensor) -> torch.Tensor:
    """``[Nk + 1, Hkv]`` int32 (a transposed view), row n = admitted keys among rows < n (over the
    packed batch).

    One 1-D scan over the heads laid end to end (CUB on CUDA), then each head's running total before
    it is taken off: flat in the key count where torch's row scan of the transposed ``[Hkv, Nk]``
    grows with it, and far faster than scanning the outer dim of ``[Nk, Hkv]``
    (``benchmarks/results/kernels/kernel_prefill_compaction.json``)."""
    Nk, H = admitted.shape
    dtype = torch.int32 if H * Nk < 2**31 else torch.int64
    excl = torch.zeros(H, Nk + 1, dtype=dtype, device=admitted.device)
    if Nk:
        flat = torch.cumsum(admitted.t().reshape(-1), 0, dtype=dtype).view(H, Nk)
        excl[:, 1:] = flat
        excl[1:, 1:] -= flat[:-1, -1:]
    return excl.t()


def build_vertical_slash_plan(
    admitted: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    local_window: int,
    block_m: int,
) -> VerticalSlashPlan:
    """Per query block: its rows, the band key range and the admitted count per KV head.

    Positions must not decrease within each sequence (keys and queries), as in
    prefill, chunked prefill and extend after a cached prefix (global entries placed at one far
    position included). Only tensor shapes are read on
    the host; ``NB = ceil(Nq / block_m) + B`` blocks are listed (the unused ones have no rows).
    """
    dev = admitted.device
    B = qo_indptr.numel() - 1
    Nq, Nk = q_pos.numel(), k_pos.numel()
    qo, kv = qo_indptr.long(), kv_indptr.long()
    nq = qo[1:] - qo[:-1]
    nblk = (nq + block_m - 1) // block_m
    blk_end = torch.cumsum(nblk, 0)
    NB = -(-Nq // block_m) + B
    blk = torch.arange(NB, device=dev)
    b = torch.searchsorted(blk_end, blk, right=True)
    valid = b < B
    b = b.clamp(max=max(B - 1, 0))
    q_start = qo[b] + (blk - (blk_end[b] - nblk[b])) * block_m
    q_end = torch.minimum(q_start + block_m, qo[b + 1])
    q_start = torch.where(valid, q_start, 0)
    q_end = torch.where(valid, q_end, 0)
    p_lo = q_pos.long()[q_start.clamp(max=max(Nq - 1, 0))] if Nq else q_start
    p_hi = q_pos.long()[(q_end - 1).clamp(min=0)] if Nq else q_start

    kseq = torch.searchsorted(kv[1:], torch.arange(Nk, device=dev), right=True)
    key = (kseq << _SEQ_SHIFT) + k_pos.long()
    base = b << _SEQ_SHIFT
    lo, hi = kv[b], kv[b + 1]
    band_start = torch.searchsorted(key, base + p_lo - local_window, right=True).clamp(lo, hi)
    band_end = torch.searchsorted(key, base + p_hi, right=True).clamp(band_start, hi)
    excl = _exclusive_count(admitted)
    vertical = excl[band_start] - excl[lo]
    vertical = torch.where(valid[:, None], vertical, 0)
    i32 = torch.int32
    return VerticalSlashPlan(
        block_m,
        q_start.to(i32),
        q_end.to(i32),
        lo.to(i32),
        band_start.to(i32),
        band_end.to(i32),
        vertical.to(i32).contiguous(),
    )
