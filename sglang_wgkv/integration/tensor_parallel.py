"""Attention tensor parallelism: which KV heads a rank holds, and per-request usage summed over ranks."""

from __future__ import annotations

import torch


def rank_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads SGLang's ``QKVParallelLinear`` gives ``tp_rank``: a contiguous block, or one
    replicated head when there are more ranks than KV heads."""
    if tp_size >= total_kv_heads:
        return [tp_rank * total_kv_heads // tp_size]
    per_rank = total_kv_heads // tp_size
    return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def counts_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> bool:
    """Whether ``tp_rank``'s heads count in a sum over ranks: False where the rank before it holds the
    same (replicated) head, so each KV head counts once."""
    earlier = rank_kv_heads(total_kv_heads, tp_size, tp_rank - 1) if tp_rank else []
    return rank_kv_heads(total_kv_heads, tp_size, tp_rank) != earlier


def tp_usage_reducer(counts_heads: bool):
    """Under attention tensor parallelism, a ``reduce`` for
    :func:`~sglang_wgkv.integration.request_control.request_usage` that sums the per-rank counts over
    the ranks' CPU group (``counts_heads`` False on a rank whose KV head an earlier rank already
    holds, so each head counts once) and takes the maxima; None on one rank. Every rank frees the
    same requests in the same order (SGLang's TP schedulers run in lockstep), so the collective
    cannot deadlock."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    group = get_attn_tp_group()
    if group.world_size == 1:
        return None
    weight = 1 if counts_heads else 0

    def reduce(sums, maxes):
        s = torch.tensor(sums, dtype=torch.float64) * weight
        m = torch.tensor(maxes, dtype=torch.float64)
        torch.distributed.all_reduce(s, group=group.cpu_group)
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return [int(x) for x in s.tolist()], [int(x) for x in m.tolist()]

    return reduce
