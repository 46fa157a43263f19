"""FA3 for the local window of the vertical-slash prefill.

Every key ``0 <= dist < W`` behind its query is visible, admitted or not: that part of the mask is a
causal sliding window, which FA3 (``sgl_kernel``'s ``flash_attn_varlen_func``, Hopper) runs whole. The
band launch of :mod:`.triton_prefill` starts its online softmax from FA3's output and log-sum-exp and
adds the rest: the vertical range, and of the band only the admitted keys at least ``W`` behind
(``(p_lo - W, p_hi - W]``, at most ``block_m - 1`` keys a block where the one-pass band reads
``W + block_m - 1`` under the full mask).

| FA3 argument | the window pass |
| --- | --- |
| ``q``, ``k``, ``v`` | the forward's packed rows ``[N, Hq, D]``, and its packed keys ``[Nk, Hkv, D]`` (GQA inside FA3) |
| ``cu_seqlens_q``, ``cu_seqlens_k`` | ``qo_indptr`` and the layer's ``kv_indptr`` (int32) |
| ``causal``, ``window_size`` | on, ``(W - 1, 0)``: query ``i`` of ``n`` sees keys ``m - n + i - W + 1 .. m - n + i`` of its ``m`` |
| ``return_softmax_lse`` | on: ``[Hq, N]`` float32, natural log |

FA3's window counts key indices; the mask counts positions. They agree on the pool's layout
(``DualCachePool.extend_inputs``): a request's keys are its global entries (at ``FAR_POSITION``), then
its ring (the last ``min(S, W)`` cached positions, in order), then its new rows, so the last
``min(S, W) + n`` keys run position by position up to the last query, and a request with global
entries has a full ring (``S >= W``): the ``W`` keys before a query by index are the ``W`` before it by
position, never a global entry. :func:`window_safe` is that condition, which the backend checks
before each forward. :func:`~.fa3_dense.dense_reference` is the torch statement of the call (the CPU
checks run it in FA3's place).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# (flash_attn_varlen_func, cu_seqlens_q int32 [B + 1], cu_seqlens_k int32 [B + 1], most rows, most keys)
BandFA3 = tuple[Callable[..., tuple], torch.Tensor, torch.Tensor, int, int]


def window_safe(global_rows, ring_rows, window: int) -> bool:
    """Whether FA3's index window is the position window for requests of these context counts (per
    request, any layers: global rows read, ring rows read): each has no global row or a full ring."""
    return bool(((np.asarray(global_rows) == 0) | (np.asarray(ring_rows) >= window)).all())


def fa3_band(q, k, v, fn, cu_q, cu_k, max_q: int, max_k: int, scale: float, window: int):
    """FA3's causal window attention of the packed rows over the packed keys: ``(out [N, Hq, D],
    lse [Hq, N])``."""
    out, lse, *_ = fn(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=scale,
        causal=True,
        window_size=(window - 1, 0),
        return_softmax_lse=True,
    )
    return out, lse
