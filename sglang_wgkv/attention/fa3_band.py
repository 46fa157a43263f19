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
the position window. :func:`~.fa3_dense.dense_reference` is the torch statement of the call (the CPU
checks run it in FA3's place).
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
