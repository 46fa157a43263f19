"""Overcommit capacity (``--wgkv-overcommit F``): admission alone, no evictor, runs more requests at
once than a dense pool of the same memory, because the scheduler guards the physical pool itself.

Split. :func:`~sglang_wgkv.integration.pools.capacity.plan_capacity` gives SGLang ``F`` times the
dense-equivalent logical pool and request slots (slots capped by SGLang's own
``max_running_requests``), and the dual pool the whole KV budget (less the slots' fixed state). SGLang then admits by logical
tokens as usual, so its own checks no longer imply that the physical pool can hold a step.

Guard. Before every forward SGLang checks memory in two places, and both also check the dual pool
(hooks below, host-side: the allocator's free-page floor, one host sync when it is too low):

* decode (``ScheduleBatch.check_decode_mem``, called by the scheduler's ``update_running_batch`` and
  by ``retract_decode``): the step fits only if the free pages cover
  :meth:`DualCachePool.decode_worst_case` of the batch (one page per stream of a request that
  promotes or whose ring crosses a page boundary). Otherwise SGLang retracts requests (fewest outputs
  first) until it fits; a retracted request frees its slot, hence its pages
  (:class:`~sglang_wgkv.integration.pools.req_pool.WGKVReqToTokenPool`), and is re-run from its prompt.
* prefill (``PrefillAdder.add_one_req`` / ``add_chunked_req``): a new request is admitted only if the
  free pages cover :meth:`DualCachePool.extend_bound` of its whole remaining prompt (every future
  chunk, not only this one) for it and for every request already in the batch, plus one decode step
  of every running request (so that admitting it does not force an immediate retraction). Otherwise
  the request waits: the batch is closed (``OTHER``) when the request would fit in a batch of its
  own, else the adder reports ``NO_TOKEN`` (SGLang then tries no prefill until a request leaves). A chunked request in flight is always
  continued (SGLang requires it); nothing but the requests of the same prefill batches allocates
  while it is chunked (a pass mixes in the running decodes only when the pool holds their step
  too, :mod:`~.mixed_batches`), and those were admitted only within the reserve of its whole
  prompt, so its later chunks fit.

Hence ``PoolExhausted`` cannot happen in a forward. Why not catch ``PoolExhausted`` in the backend
instead: the backend sees it inside ``init_forward_metadata``, after SGLang committed the batch
(logical slots allocated, outputs expected); SGLang cannot abort a forward midway.

Per-request limit (:mod:`~.long_requests`). A request with admission off keeps every token, so its
prompt plus output is capped at the dense-equivalent logical pool, which the physical pool always
holds alone (a 400 before any work otherwise). A request with admission on may be as long as the
context: one longer than the dense-equivalent pool is *bounded* (the evictor holds its global cache
to what the free pages held when it was admitted, compressing its own pages only if its admitted KV
outgrows them), and the guard below reserves its bound instead of its dense prompt; so is a request
with its own ``kv_budget``. Either way a request never waits forever for pages.

Prefix caching: a request admitted with a prefix is a radix-cache hit whose snapshot is restored into
its fresh slot before the forward (:mod:`radix_ext`), allocating a ring copy; the prefill guard counts
it (:meth:`DualCachePool.restore_bound`), and snapshot pages the tree holds are dropped by the
allocator's reclaimer whenever a check falls short.

Limits: excludes ``--kv-budget`` (its bounded split is a different capacity rule); under a workload whose
admitted KV exceeds the physical pool, requests are retracted and recomputed (throughput, not
correctness, suffers); SGLang's data-parallel and pipeline modes are rejected anyway.
"""

from __future__ import annotations

import logging

from sglang_wgkv.integration.requests.control import RequestAdmission
from sglang_wgkv.integration.scheduling.long_requests import (
    WGKV_BOUND,
    length_error,
    pool_bound,
    release_row,
    request_chunk,
    requested_bound,
    reserve_row,
)

logger = logging.getLogger(__name__)


def guarded_runtime(kv):
    """The WG-KV runtime of SGLang KV pool ``kv`` when it is planned for overcommit, else None."""
    runtime = getattr(kv, "runtime", None)
    return runtime if runtime is not None and runtime.plan.mode == "overcommit" else None


def _guarded_pool(token_to_kv_pool_allocator):
    """The :class:`WGKVTokenToKVPool` behind an allocator when overcommit is on, else None."""
    kv = token_to_kv_pool_allocator.get_kvcache() if token_to_kv_pool_allocator is not None else None
    return kv if guarded_runtime(kv) is not None else None


def check_decode_mem(result, batch, selected_indices=None):
    """AFTER ``ScheduleBatch.check_decode_mem``: also False when the dual pool cannot hold the step."""
    pool = _guarded_pool(batch.token_to_kv_pool_allocator)
    if not result or pool is None:
        return None
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    dual = pool.dual
    need = dual.decode_worst_case(dual.cached_len[[r.req_pool_idx for r in reqs]])
    return None if dual.allocator.fits(need) else False


def _extend_bound(dual, req, restore: bool = False, chunk: int | None = None) -> int:
    """Pages of the request's remaining prompt, or of its bound (:mod:`~.long_requests`) when it has
    one and that is smaller (``chunk``: SGLang's ``chunked_prefill_size``); with ``restore``, plus
    the ring copy of a prefix-cache hit (restored into its fresh slot before the forward,
    :mod:`radix_ext`)."""
    prefix = len(req.prefix_indices)
    remaining = len(req.full_untruncated_fill_ids) - prefix
    need = dual.extend_bound(prefix, remaining)
    bound = getattr(req, WGKV_BOUND, None)
    if bound is not None:
        streams = dual.num_layers * dual.num_kv_heads
        need = min(need, bound.pages(streams, dual.window, request_chunk(chunk, remaining)))
    return need + (dual.restore_bound(prefix) if restore and prefix else 0)


def _bound_of(runtime, req, room_pages):
    """``(needs a bound, the bound or None)`` for a request about to be admitted; ``room_pages()``:
    the free pages it may take (called only for a request longer than the dense pool: it syncs)."""
    admission = RequestAdmission.of_request(req)
    dual, plan = runtime.dual, runtime.plan
    prompt = len(req.full_untruncated_fill_ids) - len(req.prefix_indices)
    chunk = request_chunk(runtime.chunk_tokens, prompt)
    length = len(req.origin_input_ids) + (req.sampling_params.max_new_tokens or 0)
    if admission.admission and length > plan.max_request_tokens:
        return True, pool_bound(
            kv_budget=admission.kv_budget,
            local_window=dual.window,
            chunk_tokens=chunk,
            room_pages=room_pages(),
            streams=dual.num_layers * dual.num_kv_heads,
        )
    if admission.kv_budget is not None:
        return True, requested_bound(admission.kv_budget, chunk)
    return False, None


def add_one_req(original, adder, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req`` (through :mod:`~.prefill_guard`): ``NO_TOKEN`` unless the
    dual pool holds the request's whole remaining prompt on top of what this batch reserved, plus a
    decode step of every running request."""
    pool = _guarded_pool(adder.token_to_kv_pool_allocator)
    if pool is None:
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    runtime, dual = pool.runtime, pool.dual
    running = len(adder.running_batch.reqs) if adder.running_batch is not None else 0
    step = dual.num_layers * dual.num_kv_heads * (running + len(adder.can_run_list) + 1)
    reserved = getattr(adder, "wgkv_reserved_pages", 0)
    # NO_TOKEN marks SGLang's running batch full until a request leaves it; only right when the
    # request would not fit even as the batch's first one
    wait = AddReqResult.OTHER if reserved or adder.can_run_list else AddReqResult.NO_TOKEN
    setattr(req, WGKV_BOUND, None)
    room = lambda: dual.allocator.sync_free() - reserved - step
    bounded, bound = _bound_of(runtime, req, room)
    if bounded and bound is None:  # the prefix cache drops the snapshots it can spare, then once more
        dual.allocator.fits(dual.allocator.num_pages)
        bounded, bound = _bound_of(runtime, req, room)
    if bounded:
        if bound is None or not reserve_row(adder, runtime.evictor):
            return wait  # the free pages (or window rows) hold no bound yet: a request must leave
        setattr(req, WGKV_BOUND, bound)
    need = _extend_bound(dual, req, restore=True, chunk=runtime.chunk_tokens)  # a prefix: a cache hit
    if not dual.allocator.fits(reserved + need + step):
        release_row(adder, bounded)
        return AddReqResult.OTHER if reserved and dual.allocator.fits(need + step) else AddReqResult.NO_TOKEN
    result = original(adder, req, *args, **kwargs)
    if adder.can_run_list and adder.can_run_list[-1] is req:
        adder.wgkv_reserved_pages = reserved + need
    else:
        release_row(adder, bounded)
    return result


def add_chunked_req(original, adder, req):
    """AROUND ``PrefillAdder.add_chunked_req`` (through :mod:`~.prefill_guard`): the chunked request
    always runs; its whole remaining prompt is reserved before other requests join the batch."""
    pool = _guarded_pool(adder.token_to_kv_pool_allocator)
    if pool is not None:
        need = _extend_bound(pool.dual, req, chunk=pool.runtime.chunk_tokens)
        adder.wgkv_reserved_pages = getattr(adder, "wgkv_reserved_pages", 0) + need
    return original(adder, req)


def check_request_length(result, scheduler, req, *args, **kwargs):
    """AFTER ``Scheduler.init_req_max_new_tokens`` (each new request, before SGLang's length check):
    on an overcommit plan, a request longer than the dense-equivalent pool that cannot run
    (:func:`length_error`) is aborted with a 400 before any work."""
    runtime = guarded_runtime(getattr(scheduler.tp_worker.model_runner, "token_to_kv_pool", None))
    if runtime is None or req.to_finish is not None:
        return None
    try:
        admission = RequestAdmission.of_request(req)
    except ValueError:
        return None  # the tokenizer manager already refused it
    dual, plan = runtime.dual, runtime.plan
    streams = dual.num_layers * dual.num_kv_heads
    prompt = len(req.origin_input_ids)
    error = length_error(
        length=prompt + (req.sampling_params.max_new_tokens or 0),
        admission=admission.admission,
        dense_limit=plan.max_request_tokens,
        local_window=dual.window,
        chunk_tokens=request_chunk(runtime.chunk_tokens, prompt),
        room_pages=dual.allocator.num_pages - streams,  # alone: less one decode step
        streams=streams,
    )
    if error is not None:
        req.set_finish_with_abort(error)
    return None
