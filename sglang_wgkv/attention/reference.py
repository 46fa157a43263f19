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

from sglang_wgkv.memory.kv_quant import dequantize, gather

# Attention scores (float32) computed at once by :func:`vertical_slash_attention` (4 MiB; the softmax
# runs in place on them, so one block is most of what a prefill layer holds on the CPU path). Larger
# blocks are no faster on CPU and glibc keeps freed blocks of their size in its heap, which raises the
# server's peak RSS (benchmarks/results/serving/memory_wgkv_readme_cpu.json).
SCORE_BLOCK_ELEMS = 1 << 20


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
    band = (dist >= 0) & (dist < local_window)
    vertical = (dist >= 0)[None] & admitted.t()[:, None, :]
    return band[None] | vertical


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
) -> torch.Tensor:
    """Hard vertical-slash attention over a packed variable-length batch.

    Parameters
    ----------
    q : ``[Nq, Hq, D]`` queries of all sequences, packed; sequence b is rows ``qo_indptr[b]:qo_indptr[b+1]``.
    k, v : ``[Nk, Hkv, D]`` keys/values, packed by ``kv_indptr`` (``[B + 1]``).
    admitted : ``[Nk, Hkv]`` bool, key j of head h is in the global cache (visible beyond the band).
    q_pos : ``[Nq]``, k_pos : ``[Nk]`` token positions (a prefill from scratch has both = arange).
    local_window : W_local; key j is always visible to query i when ``0 <= pos_i - pos_j < W_local``.

    Returns ``[Nq, Hq, D]`` in q's dtype. A query that sees no key (impossible when its own key is
    present) returns zeros. Queries are processed in blocks of at most :data:`SCORE_BLOCK_ELEMS`
    scores (each query's softmax is its own), so a long prompt on the CPU path needs temporaries of
    one block, not ``Hq x Nq x Nk`` floats several times over.
    """
    Nq, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros_like(q)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if qe == qs or ke == ks:
            continue
        nk = ke - ks
        # [Hkv, nk, D], contiguous once (bmm would copy a strided operand every block): a GQA group's
        # queries share their head's keys
        kb = k[ks:ke].transpose(0, 1).float().contiguous()
        vb = v[ks:ke].transpose(0, 1).float().contiguous()
        rows = max(1, SCORE_BLOCK_ELEMS // (Hq * nk))
        for q0 in range(qs, qe, rows):
            q1 = min(qe, q0 + rows)
            nq = q1 - q0
            mask = vertical_slash_mask(
                q_pos[q0:q1], k_pos[ks:ke], admitted[ks:ke], local_window
            )  # [Hkv, nq, nk]
            qb = q[q0:q1].float().view(nq, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * nq, D)
            scores = torch.bmm(qb, kb.transpose(1, 2)).view(Hkv, group, nq, nk)
            # softmax over the visible keys, in place (one score block of temporaries); a query that
            # sees no key gets zeros
            scores.mul_(scale).masked_fill_(~mask[:, None], float("-inf"))
            peak = scores.amax(-1, keepdim=True)
            scores.sub_(peak.nan_to_num_(0.0, posinf=0.0, neginf=0.0)).exp_()
            scores.div_(scores.sum(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny))
            o = torch.bmm(scores.view(Hkv, group * nq, nk), vb)  # [Hkv, group * nq, D]
            out[q0:q1] = o.view(Hkv, group, nq, D).permute(2, 0, 1, 3).reshape(nq, Hq, D).to(q.dtype)
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
    group = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    qg = q.view(B, Hkv, group, D).float()
    scores = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale
    valid = torch.arange(L, device=q.device)[None, None, :] < lengths[:, :, None]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgl,bhld->bhgd", probs, v.float())
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
    Hkv = S // B
    page_size = k_pages.shape[1]
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    max_pages = int(num_pages.max()) if S else 0
    col = torch.arange(max_pages, device=q.device)
    idx = kv_indptr[:-1, None].long() + col[None, :]
    valid_page = col[None, :] < num_pages[:, None]
    pages = torch.where(valid_page, kv_indices[idx.clamp(max=max(kv_indices.numel() - 1, 0))].long(), 0)
    lengths = torch.where(num_pages > 0, (num_pages - 1) * page_size + kv_last_page_len.long(), 0)
    k = dequantize(gather(k_pages, pages), k_scale, torch.float32).reshape(B, Hkv, max_pages * page_size, D)
    v = dequantize(gather(v_pages, pages), v_scale, torch.float32).reshape(B, Hkv, max_pages * page_size, D)
    return padded_decode_attention(q, k, v, lengths.view(B, Hkv), sm_scale)
