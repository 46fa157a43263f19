"""Triton variants compiled while the server starts, for launches that its warm-up request (one short
prompt, one decode row) does not reach but served batches do. Each would otherwise compile in the
middle of a forward and stop the scheduler for seconds (``runs[].compiled_in_timed_run`` of
``benchmarks/served_speed.py``). Compiling is Triton's ``warmup``: nothing is launched, no state moves.

=================================  ==========================================  ====================================
kernel                             the variant the warm-up request misses      reached by
=================================  ==========================================  ====================================
promotion scans (``triton_pool``)  the block scan (count, alloc, take)         decode rows x layers x KV heads
                                                                               past ``PROMOTE_SCAN_BLOCK``
SGLang's                           ``out_cache_loc`` at an 8-byte offset       an extend batch whose slots start
``write_req_to_token_pool_triton`` (Triton specializes 16-byte alignment)      at an odd index of the free list
the extend moves (``triton_extend``, the only one: no warm-up token leaves   a prompt longer than ``W_local``
``extend_move``)                   the ring)                                   (a pool with ``triton_extend``)
the context read (``triton_extend``  the only one: the warm-up prompt has no    a chunk after a cached prefix
``extend_context``)                cached context                              (a pool with ``triton_extend``)
=================================  ==========================================  ====================================
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def compile_sglang_cache_writes(req_to_token_pool) -> None:
    """Both alignments of ``out_cache_loc`` in SGLang's ``write_cache_indices`` kernel."""
    from sglang.srt.mem_cache.allocation import write_req_to_token_pool_triton

    device = req_to_token_pool.req_to_token.device
    index = torch.zeros(2, dtype=torch.int64, device=device)
    pointers = torch.zeros(1, dtype=torch.uint64, device=device)
    for out_cache_loc in (index[:1], index[1:]):
        write_req_to_token_pool_triton.warmup(
            req_to_token_pool.req_to_token,
            index[:1],
            pointers,
            index[:1],
            index[:1],
            index[:1],
            out_cache_loc,
            req_to_token_pool.req_to_token.shape[1],
            grid=(1,),
        )


def compile_served_variants(pool, req_to_token_pool, dtype: torch.dtype) -> None:
    """The module table's variants for ``pool`` (a DualCachePool), SGLang's ``req_to_token_pool`` and
    the model's ``dtype``; a failure is logged, not raised (the forward that needs the variant then
    compiles it)."""
    from sglang_wgkv.memory.triton_extend import compile_extend_context, compile_extend_move
    from sglang_wgkv.memory.triton_pool import compile_decode_promote

    compiles = [
        ("promotion scans", lambda: compile_decode_promote(pool)),
        ("SGLang's cache-index writes", lambda: compile_sglang_cache_writes(req_to_token_pool)),
    ]
    if pool.triton_extend:
        compiles.append(("extend moves", lambda: compile_extend_move(pool, dtype)))
        compiles.append(("extend context read", lambda: compile_extend_context(pool, dtype)))
    for what, compile_ in compiles:
        try:
            compile_()
        except Exception as exc:  # a warm-up must not take the server down
            logger.warning(
                "wgkv: compiling the %s at start-up failed (%s: %s)", what, type(exc).__name__, exc
            )
