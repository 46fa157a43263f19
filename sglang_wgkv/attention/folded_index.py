"""Folded-head paged indices: B requests x H_kv heads become B*H_kv ragged sequences.

FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (and :func:`reference.paged_decode_attention`)
take, for ``S = B * H_kv`` sequences with one KV head each::

    kv_indptr        [S + 1]  int32   sequence s owns kv_indices[kv_indptr[s] : kv_indptr[s+1]]
    kv_indices       [nnz]    int32   page ids in the physical pool
    kv_last_page_len [S]      int32   valid tokens in the last page (1..page_size)

Sequence ``s = b * H_kv + h`` pairs with query heads ``h*group .. (h+1)*group - 1`` of request b, so
q ``[B, Hq, D]`` is passed unchanged as ``[S, group, D]``.
"""

import torch


def build_folded_indices(
    rows: torch.Tensor,
    num_pages: torch.Tensor,
    last_page_len: torch.Tensor,
    out_indices: torch.Tensor | None = None,
):
    """Compact page-table rows into FlashInfer's paged layout without a host sync.

    Parameters
    ----------
    rows : ``[B, H, C]`` page-table rows; the first ``num_pages[b, h]`` entries are the pages.
    num_pages, last_page_len : ``[B, H]``.
    out_indices : optional preallocated ``[>= B*H*C + 1]`` int32 buffer (CUDA-graph friendly).

    Returns ``kv_indptr [S+1]``, ``kv_indices`` (a view of at least ``nnz`` entries; entries past
    ``kv_indptr[-1]`` are scratch), ``kv_last_page_len [S]``, all int32.
    """
    B, H, C = rows.shape
    S = B * H
    n = num_pages.reshape(S).to(torch.int32)
    indptr = torch.zeros(S + 1, dtype=torch.int32, device=rows.device)
    torch.cumsum(n, 0, out=indptr[1:])
    if out_indices is None:
        out_indices = torch.empty(S * C + 1, dtype=torch.int32, device=rows.device)
    col = torch.arange(C, device=rows.device)
    valid = col[None, :] < n[:, None]
    # Invalid entries all land on the buffer's last element, which no sequence reads.
    dest = torch.where(valid, indptr[:-1, None].long() + col[None, :], out_indices.numel() - 1)
    out_indices.scatter_(0, dest.reshape(-1), rows.reshape(S * C).to(torch.int32))
    return indptr, out_indices, last_page_len.reshape(S).to(torch.int32)
