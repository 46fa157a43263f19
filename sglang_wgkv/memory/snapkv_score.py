"""SnapKV importance scores of global-cache entries (torch; the reference for any kernel).

See :mod:`sglang_wgkv.memory.evictor` for the policy these scores drive.
"""

import torch
import torch.nn.functional as F


def snapkv_scores(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    g_keys: torch.Tensor,
    g_len: torch.Tensor,
    r_keys: torch.Tensor,
    r_pos: torch.Tensor,
    sm_scale: float,
    kernel_size: int = 5,
) -> torch.Tensor:
    """Score the global entries of ``S`` streams (one KV head each) against their query windows.

    Parameters
    ----------
    q : ``[S, Wq, G, D]`` the last ``Wq`` queries of each of the stream's ``G`` GQA query heads.
    q_pos : ``[S, Wq]`` positions of those queries; ``< 0`` marks an empty slot (contributes nothing).
    g_keys : ``[S, Ng, D]`` global keys in cache order; entries ``>= g_len[s]`` are padding.
    g_len : ``[S]`` global lengths.
    r_keys : ``[S, Nr, D]`` ring keys; r_pos : ``[S, Nr]`` their positions (``< 0``: empty slot).
    sm_scale : softmax scale; kernel_size : odd max-pool kernel along the cache.

    Every global entry is visible to every query (global entries precede the window); ring entry
    ``k`` is visible to query ``i`` iff ``r_pos[k] <= q_pos[i]``. The softmax of query ``i`` runs
    over its visible keys, global and ring; then ``raw_j = sum_i max_g A[i, g, j]`` and the result
    is max-pooled (stride 1, same length) over the valid global entries.

    Returns ``[S, Ng]`` float32, ``-inf`` at padding.
    """
    S, Ng = g_keys.shape[:2]
    valid = torch.arange(Ng, device=g_keys.device)[None, :] < g_len[:, None]  # [S, Ng]
    keys = torch.cat([g_keys, r_keys], 1).float()  # [S, Ng+Nr, D]
    logits = torch.einsum("swgd,snd->swgn", q.float(), keys) * sm_scale  # [S, Wq, G, N]
    ring_vis = (r_pos[:, None, :] >= 0) & (r_pos[:, None, :] <= q_pos[:, :, None])  # [S, Wq, Nr]
    vis = torch.cat([valid[:, None, :].expand(-1, q.shape[1], -1), ring_vis], -1)
    vis = vis & (q_pos >= 0)[:, :, None]
    # in place: the logits are the largest tensor of an eviction, keep at most two of them alive
    logits.masked_fill_(~vis[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # an empty slot sees no key: all zero
    del logits
    return pool_raw_scores(probs[..., :Ng].amax(2).sum(1), g_len, kernel_size)  # raw [S, Ng]


def pool_raw_scores(raw: torch.Tensor, g_len: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """``raw [S, Ng]`` (the per-entry sums over the window) max-pooled (stride 1, same length) over
    each stream's valid global entries; ``-inf`` at padding."""
    valid = torch.arange(raw.shape[1], device=raw.device)[None, :] < g_len[:, None]
    raw = raw.masked_fill(~valid, float("-inf"))
    pooled = F.max_pool1d(raw[:, None, :], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]
    return pooled.masked_fill(~valid, float("-inf"))
