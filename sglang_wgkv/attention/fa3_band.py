"""FA3 for the local window of the vertical-slash prefill, when no sequence of the forward has a cached
prefix (a prompt prefilled in one chunk: short prompts, most of the traffic that does not bind memory).

Every key ``0 <= dist < W`` behind its query is visible, admitted or not: that part of the mask is a
causal sliding window, which FA3 (``sgl_kernel``'s ``flash_attn_varlen_func``, Hopper) runs whole. The
band launch of :mod:`.triton_prefill` starts its online softmax from FA3's output and log-sum-exp and
adds the rest: the vertical range, and of the band only the admitted keys at least ``W`` behind
(``(p_lo - W, p_hi - W]``, at most ``block_m - 1`` keys a block where the one-pass band reads
``W + block_m - 1`` under the full mask).

| FA3 argument | the window pass |
| --- | --- |
| ``q``, ``k``, ``v`` | the forward's packed rows, ``[N, Hq, D]`` and ``[N, Hkv, D]`` (GQA inside FA3) |
| ``cu_seqlens_q``, ``cu_seqlens_k`` | the same ``qo_indptr`` (int32): each sequence's keys are its queries |
| ``causal``, ``window_size`` | on, ``(W - 1, 0)``: query ``i`` sees keys ``i - W + 1 .. i`` of its sequence |
| ``return_softmax_lse`` | on: ``[Hq, N]`` float32, natural log |

Why only without a prefix: a chunk after cached tokens reads its context as global entries then the ring
(``DualCachePool.extend_inputs``), so key indices are not positions and FA3's index window would not be
the position window. :func:`window_reference` is the torch statement of the call (the CPU checks run it
in FA3's place).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (flash_attn_varlen_func, cu_seqlens int32 [B + 1], longest sequence)
BandFA3 = tuple[Callable[..., tuple], torch.Tensor, int]


def fa3_band(q, k, v, fn, cu_seqlens, longest: int, scale: float, window: int):
    """FA3's causal window attention over the packed rows: ``(out [N, Hq, D], lse [Hq, N])``."""
    out, lse, *_ = fn(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        softmax_scale=scale,
        causal=True,
        window_size=(window - 1, 0),
        return_softmax_lse=True,
    )
    return out, lse


def window_reference(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, **_
):
    """``flash_attn_varlen_func`` as :func:`fa3_band` calls it, in torch: per sequence (queries aligned to
    its last key), query ``i`` sees keys ``i - window_size[0] .. i``; returns ``(out, lse)``, the
    log-sum-exp ``[Hq, N]`` in float32."""
    if not causal or window_size[1] != 0:
        raise ValueError(f"the window pass is causal with window_size (left, 0), got {causal}, {window_size}")
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(Hq, N, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        n, m = q1 - q0, k1 - k0
        if n > max_seqlen_q or m > max_seqlen_k:
            raise ValueError(
                f"sequence {b}: {n} rows, {m} keys over max_seqlen {max_seqlen_q}, {max_seqlen_k}"
            )
        if not n:
            continue
        kk = k[k0:k1].float().repeat_interleave(G, 1)
        vv = v[k0:k1].float().repeat_interleave(G, 1)
        s = torch.einsum("thd,nhd->htn", q[q0:q1].float(), kk) * softmax_scale
        last = m - n + torch.arange(n, device=q.device)[:, None]  # each query's own key index
        j = torch.arange(m, device=q.device)[None, :]
        s = s.masked_fill(~((j <= last) & (j >= last - window_size[0]))[None], float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), vv).to(q.dtype)
    return out, lse
