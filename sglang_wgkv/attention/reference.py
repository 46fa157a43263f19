"""Torch reference attention for WG-KV: the test oracle for every kernel and the CPU execution path.

Three semantics, all GQA (query head ``qh`` reads KV head ``qh // group``):

* :func:`soft_gated_attention` -- training: dense causal attention with bias ``log(m_ij + eps)``,
  ``m_ij = 1`` if ``i - j < W_local`` else ``g_j``; differentiable in ``g``.
* :func:`vertical_slash_attention` -- prefill/extend: query ``i`` sees key ``j`` iff
  ``pos_j <= pos_i`` and (``pos_i - pos_j < W_local`` or ``admitted_j``), over packed var-length batches.
* :func:`paged_decode_attention` -- decode over the folded-head paged layout (one sequence per
  (request, KV head), see :mod:`sglang_wgkv.attention.folded_index`).
"""

import math

import torch
from torch.nn import functional as F

from sglang_wgkv.memory.kv_quant import dequantize, gather

# Queries a block of :func:`vertical_slash_attention` at least (and W_local where larger): a block
# reads the keys near it whole, so smaller blocks read fewer keys but launch more attentions.
QUERY_BLOCK = 256


def _expand_gqa(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=dim)


def soft_gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    local_window: int,
    eps: float = 1e-6,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Write-gated attention with the log-space gate bias (differentiable).

    Parameters
    ----------
    q : ``[B, Hq, T, D]``; k, v : ``[B, Hkv, T, D]``; g : ``[B, Hkv, T]`` gate values in [0, 1].

    Returns ``[B, Hq, T, D]`` in q's dtype.

    On CUDA (torch 2.11) the memory-efficient SDPA kernel's backward rejects this broadcast bias
    ("LSE is not correctly aligned"); the trainer selects the math kernel there.
    """
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    i = torch.arange(T, device=q.device)
    dist = i[:, None] - i[None, :]
    local = dist < local_window
    causal = dist >= 0
    log_g = torch.log(g.float() + eps)  # [B, Hkv, T]
    bias = torch.where(local, torch.zeros((), device=q.device), log_g[:, :, None, :])
    bias = bias.masked_fill(~causal, float("-inf"))  # [B, Hkv, T, T]
    bias = _expand_gqa(bias, group, 1).to(q.dtype)
    k, v = _expand_gqa(k, group, 1), _expand_gqa(v, group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def vertical_slash_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, admitted: torch.Tensor, local_window: int
) -> torch.Tensor:
    """Mask ``[Hkv, Nq, Nk]`` for one sequence: q_pos ``[Nq]``, k_pos ``[Nk]``, admitted ``[Nk, Hkv]``."""
    dist = q_pos[:, None] - k_pos[None, :]
    return (dist >= 0)[None] & ((dist < local_window)[None] | admitted.t()[:, None, :])


def _block_keys(q_pos, k_pos, admitted, local_window):
    """The keys a block of queries may see, per KV head: ``(idx [M, Hkv], mask [Hkv, nq, M])``.

    A key after every query of the block is never seen, and one at least ``local_window`` before
    every query ("far") is seen by all of them if admitted, by none otherwise. So the block reads the
    other ("near") keys, under :func:`vertical_slash_mask`, then each head's admitted far keys,
    unmasked but for the padding to the head with the most.
    """
    far = k_pos <= q_pos.min() - local_window
    near = torch.nonzero(~far & (k_pos <= q_pos.max()))[:, 0]
    far_kept = far[:, None] & admitted  # [Nk, Hkv]
    count = far_kept.sum(0)
    far_idx = torch.argsort((~far_kept).to(torch.uint8), dim=0, stable=True)[: int(count.max())]
    Hkv, nq = admitted.shape[1], q_pos.numel()
    idx = torch.cat([near[:, None].expand(-1, Hkv), far_idx])
    real = torch.arange(far_idx.shape[0], device=q_pos.device) < count[:, None]  # [Hkv, Mf]
    near_mask = vertical_slash_mask(q_pos, k_pos[near], admitted[near], local_window)
    return idx, torch.cat([near_mask, real[:, None, :].expand(-1, nq, -1)], dim=2)


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    admitted: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    local_window: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hard vertical-slash attention over a packed variable-length batch.

    Parameters
    ----------
    q : ``[Nq, Hq, D]`` queries of all sequences, packed; sequence b is rows ``qo_indptr[b]:qo_indptr[b+1]``.
    k, v : ``[Nk, Hkv, D]`` keys/values, packed by ``kv_indptr`` (``[B + 1]``).
    admitted : ``[Nk, Hkv]`` bool, key j of head h is in the global cache (visible beyond the band).
    q_pos : ``[Nq]``, k_pos : ``[Nk]`` token positions (a prefill from scratch has both = arange).
    local_window : W_local; key j is always visible to query i when ``0 <= pos_i - pos_j < W_local``.

    out : ``[Nq, Hq, D]`` in q's dtype: written and returned in place of a new tensor.

    Returns ``[Nq, Hq, D]`` in q's dtype. A query that sees no key (impossible when its own key is
    present) returns zeros. Queries go in blocks of at most ``max(local_window, QUERY_BLOCK)``, each
    over the keys it may see (:func:`_block_keys`: the admitted far keys and the near ones), through
    torch's fused attention with the block's mask, so a long prompt on the CPU path holds one block's
    keys and mask, and costs what its admitted keys cost rather than the whole causal square.
    """
    Nq, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros_like(q) if out is None else out.zero_()
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    rows = max(local_window, QUERY_BLOCK)
    heads = torch.arange(Hkv, device=q.device)  # each head's column of a block's key indices
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if qe == qs or ke == ks:
            continue
        kb, vb, adm, kp = k[ks:ke], v[ks:ke], admitted[ks:ke], k_pos[ks:ke]
        for q0 in range(qs, qe, rows):
            q1 = min(qe, q0 + rows)
            nq = q1 - q0
            idx, mask = _block_keys(q_pos[q0:q1], kp, adm, local_window)
            if idx.shape[0] == 0:  # every key after every query of the block: zeros
                continue
            keys = kb[idx, heads].float().transpose(0, 1)[:, None]  # [Hkv, 1, M, D]
            values = vb[idx, heads].float().transpose(0, 1)[:, None]
            qb = q[q0:q1].float().view(nq, Hkv, group, D).permute(1, 2, 0, 3)  # [Hkv, group, nq, D]
            # torch's fused attention; a query whose mask row is empty gets zeros (NaN on CUDA)
            o = F.scaled_dot_product_attention(
                qb, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=True
            ).nan_to_num_(0.0)
            out[q0:q1] = o.permute(2, 0, 1, 3).reshape(nq, Hq, D).to(q.dtype)
    return out


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None
) -> torch.Tensor:
    """Plain causal GQA attention for one sequence: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = _expand_gqa(k.transpose(0, 1), group, 0).unsqueeze(0)
    vt = _expand_gqa(v.transpose(0, 1), group, 0).unsqueeze(0)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def padded_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, sm_scale: float | None = None
) -> torch.Tensor:
    """Decode over padded per-(request, KV head) sequences.

    q : ``[B, Hq, D]``; k, v : ``[B, Hkv, L, D]`` (entries past ``lengths`` are ignored);
    lengths : ``[B, Hkv]``. Returns ``[B, Hq, D]``.
    """
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    valid = torch.arange(L, device=q.device)[None, None, :] < lengths[:, :, None]  # [B, Hkv, L]
    qg = q.view(B, Hkv, Hq // Hkv, D).float()  # a GQA group's queries as a sequence of queries
    out = F.scaled_dot_product_attention(
        qg, k.float(), v.float(), attn_mask=valid[:, :, None, :], scale=sm_scale
    ).nan_to_num_(0.0)  # a stream without keys: zeros (CUDA's kernels give NaN)
    return out.reshape(B, Hq, D).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    sm_scale: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
) -> torch.Tensor:
    """Decode over the folded-head paged layout (FlashInfer's ``BatchDecodeWithPagedKVCache`` with
    ``num_kv_heads = 1`` and the GQA group as query heads).

    Parameters
    ----------
    q : ``[B, Hq, D]``; sequence ``s = b * Hkv + h`` reads query heads ``h*group .. (h+1)*group-1``.
    k_pages, v_pages : ``[num_pages, page_size, D]`` physical pool (FP8 pages are dequantized:
        ``float(page) * k_scale``, :mod:`~sglang_wgkv.memory.kv_quant`).
    kv_indptr : ``[B*Hkv + 1]``; kv_indices : page ids; kv_last_page_len : ``[B*Hkv]`` (1..page_size).
    k_scale, v_scale : per-tensor scales of FP8 pages (float or 0-d float32 tensor); ignored otherwise.
    """
    B, Hq, D = q.shape
    S = kv_indptr.numel() - 1
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    max_pages = int(num_pages.max()) if S else 0
    col = torch.arange(max_pages, device=q.device)
    idx = kv_indptr[:-1, None].long() + col[None, :]
    pages = kv_indices[idx.clamp(max=max(kv_indices.numel() - 1, 0))].view(B, S // B, max_pages)
    return page_table_decode_attention(
        q,
        k_pages,
        v_pages,
        pages,
        num_pages.view(B, -1),
        kv_last_page_len.view(B, -1),
        sm_scale,
        k_scale,
        v_scale,
    )


def page_table_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    rows: torch.Tensor,
    num_pages: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
) -> torch.Tensor:
    """:func:`paged_decode_attention` over page-table rows instead of the folded indices (what the
    pool's ``decode_page_rows`` returns): rows ``[B, Hkv, C]`` whose first ``num_pages [B, Hkv]``
    entries are the stream's pages, the last holding ``last_page_len [B, Hkv]`` tokens."""
    B, Hkv, _ = rows.shape
    page_size, D = k_pages.shape[1], k_pages.shape[2]
    max_pages = int(num_pages.max()) if num_pages.numel() else 0
    valid_page = torch.arange(max_pages, device=q.device) < num_pages[..., None]
    pages = torch.where(valid_page, rows[..., :max_pages].long(), 0)  # past a stream's pages: page 0, masked
    lengths = torch.where(num_pages > 0, (num_pages - 1) * page_size + last_page_len.long(), 0)
    k = dequantize(gather(k_pages, pages), k_scale, torch.float32).view(B, Hkv, max_pages * page_size, D)
    v = dequantize(gather(v_pages, pages), v_scale, torch.float32).view(B, Hkv, max_pages * page_size, D)
    return padded_decode_attention(q, k, v, lengths, sm_scale)
