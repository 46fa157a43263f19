"""Device-side work lists for vertical-slash prefill attention (no host sync, no loop over heads).

Query block ``i`` (``block_m`` consecutive queries of one sequence, positions ``p_lo .. p_hi``) sees
key ``j`` of KV head ``h`` iff ``pos_j <= pos_q`` and (``pos_q - pos_j < W`` or ``admitted[j, h]``).
The keys split into two disjoint ranges::

    keys of the sequence, in position order
    | pos <= p_lo - W                           | p_lo - W < pos <= p_hi      | pos > p_hi |
    | vertical: only admitted keys are visible, | band: exact mask per        | never      |
    |   and to *every* query of the block       |   (query, key)              | visible    |

so the vertical range is a dense, unmasked attention over the admitted keys of head ``h`` once they
are compacted (``k_compact[h, compact_start : compact_start + vertical_len[i, h]]``), and only the
band, at most ``W + block_m - 1`` keys wide, needs a mask.

Compacted regions: each sequence's admitted keys start at a multiple of ``align`` rows (the previous
sequences' key counts rounded up), and the rows from its admitted count to the next multiple are
zero, so that whole tiles or pages of ``align`` rows read past the count meet finite values in
buffers that are otherwise not initialised.
"""

from dataclasses import dataclass

import torch

_SEQ_SHIFT = 40  # composite sort key: sequence id * 2**40 + position (positions stay below 2**40)
COMPACT_ALIGN = 64  # rows: the kernels' key tile and FA3's page (triton_prefill, fa3_vertical)


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
    compact_start: torch.Tensor  # [NB] int32 first compacted row of the block's sequence
    compact_align: int  # regions of the compacted keys start at multiples of this


def compacted_rows(num_keys: int, num_seqs: int, align: int = COMPACT_ALIGN) -> int:
    """Rows a head of the compacted buffers holds: every sequence's region rounded up to ``align``
    rows (at most ``num_keys + num_seqs * (align - 1)``), the total a multiple of ``align``."""
    return -(-(num_keys + num_seqs * (align - 1)) // align) * align


def region_starts(kv_indptr: torch.Tensor, align: int = COMPACT_ALIGN) -> torch.Tensor:
    """``[B]`` int64: the first compacted row of each sequence's region."""
    lens = kv_indptr[1:].long() - kv_indptr[:-1].long()
    rounded = (lens + align - 1) // align * align
    return torch.cumsum(rounded, 0) - rounded


def compact_admitted(
    k: torch.Tensor,
    v: torch.Tensor,
    admitted: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    align: int = COMPACT_ALIGN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Admitted rows of each KV head moved to the front of their sequence's region, in position order.

    Parameters
    ----------
    k, v : ``[Nk, Hkv, D]`` packed keys and values; admitted : ``[Nk, Hkv]`` bool; kv_indptr : ``[B + 1]``.
    out : optional ``[Hkv, compacted_rows(Nk, B, align), D]`` buffers, zero-filled.

    Returns ``(k_compact, v_compact)``: for sequence b and head h, rows ``region_starts(kv_indptr)[b]
    ..`` hold its admitted rows in order, every other row zero (the module's layout; the kernels read
    whole tiles past the admitted count and mask their scores, so a NaN there would leak through
    ``0 * NaN`` in the value product).
    """
    Nk, H, D = k.shape
    rows = compacted_rows(Nk, kv_indptr.numel() - 1, align)
    seq = _seq_of_keys(kv_indptr, Nk)
    shift = region_starts(kv_indptr, align)[seq] - kv_indptr.long()[seq]  # kv_start -> region start
    dest = admitted_rank(admitted, kv_indptr) + shift[:, None]
    if out is None:
        out = (k.new_zeros(H, rows, D), v.new_zeros(H, rows, D))
    n, h = admitted.nonzero(as_tuple=True)
    out[0][h, dest[n, h]] = k[n, h]
    out[1][h, dest[n, h]] = v[n, h]
    return out


def _seq_of_keys(kv_indptr: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[Nk]`` the sequence of each packed key."""
    return torch.searchsorted(
        kv_indptr.long()[1:], torch.arange(num_keys, device=kv_indptr.device), right=True
    )


def admitted_rank(admitted: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """``[Nk, Hkv]`` int64: kv_start of the key's sequence + admitted keys before it in that sequence."""
    Nk, H = admitted.shape
    excl = _exclusive_count(admitted)
    start = kv_indptr.long()[_seq_of_keys(kv_indptr, Nk)]
    return start[:, None] + excl[:-1].long() - excl[start].long()


def _exclusive_count(admitted: torch.Tensor) -> torch.Tensor:
    """``[Nk + 1, Hkv]`` int32 (a transposed view), row n = admitted keys among rows < n (over the
    packed batch).

    The heads laid end to end behind one zero each (``[Hkv, Nk + 1]``), one 1-D scan over all of it
    (CUB on CUDA), then each head's running total at its zero taken off: four launches, flat in the
    key count where torch's row scan of the transposed ``[Hkv, Nk]`` grows with it, and far faster than
    scanning the outer dim of ``[Nk, Hkv]`` (``benchmarks/results/kernels/kernel_prefill_compaction.json``)."""
    Nk, H = admitted.shape
    dtype = torch.int32 if H * (Nk + 1) < 2**31 else torch.int64
    flags = torch.zeros(H, Nk + 1, dtype=dtype, device=admitted.device)
    flags[:, 1:] = admitted.t()
    scan = torch.cumsum(flags.view(-1), 0, dtype=dtype).view(H, Nk + 1)
    return (scan - scan[:, :1]).t()


def build_vertical_slash_plan(
    admitted: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    local_window: int,
    block_m: int,
    compact_align: int = COMPACT_ALIGN,
) -> VerticalSlashPlan:
    """Per query block: its rows, the band key range, the admitted count per KV head and the start of
    its sequence's compacted region (regions rounded to ``compact_align`` rows).

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

    kseq = _seq_of_keys(kv_indptr, Nk)
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
        region_starts(kv_indptr, compact_align)[b].to(i32) if B else q_start.to(i32),
        compact_align,
    )
