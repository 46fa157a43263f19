"""WG-KV under SGLang's overlap scheduler (its default): what orders the scheduler's dual-pool work
against the forwards, and the prefix snapshot a prompt's end needs before the next forward moves it.

Under overlap the scheduler launches forward N on its forward stream and then, while N runs,
processes forward N-1's results and schedules N+1 on its schedule stream. SGLang 0.5.17 orders the two
streams (``managers/scheduler.py``) as follows:

=====================================================  ================================================
SGLang's ordering                                      covers
=====================================================  ================================================
launch: forward stream waits the schedule stream       every scheduler op issued before N's launch is
(``run_batch``)                                        done before N reads the pool
after launch: schedule stream waits forward N          an extend or mixed forward: all of it; a decode
(``_apply_war_barrier``)                               CUDA graph: only what precedes its replay (the
                                                       read-done event; ``SGLANG_FORCE_COARSE_WAR_BARRIER``
                                                       makes it all)
=====================================================  ================================================

A decode graph's replay writes ring-slot K/V, admission flags and the evictor's query rows of its rows,
among them a request that finished at N-1 and runs its overlap step in N (SGLang drops that step's
token). The scheduler-side ops below run on the schedule stream while that replay may still run; those
that write what a new owner reads, or read what the replay writes, first wait for the whole last
forward (the runtime's :class:`~sglang_wgkv.integration.plugin.forward_fence.ForwardFence`; the
forward stream needs nothing more: it waits the schedule stream at every launch):

=====================================  ==========================================  ==========================================
scheduler-side op                      GPU state it writes or reads                with a decode replay in flight
=====================================  ==========================================  ==========================================
request pool ``alloc``                 ``slot_tau`` row; the evictor's window row  waits: the replay of the slot's or row's
(``pools/req_pool.py``)                (``bound_request`` resets its positions)    previous owner may still write them
snapshot take (``radix_ext``)          copies the slot's ring pages; clones its    waits: the slot's overlap step writes its
                                       row, lengths and flags; allocator           ring page and flags
snapshot restore                       allocator; copies into fresh pages; the     waits: a fresh page may be one the replay
                                       slot's page-table row, lengths, flags       still writes (its owner freed meanwhile)
snapshot release                       allocator (refcounts, free stack)           waits (one rule for the store; nothing
                                                                                   in a replay reads snapshot-only pages)
request pool ``free`` / ``clear``      usage counts (the ledger's copy at the      no wait: the replay writes only the freed
                                       launch, ``requests/usage_ledger.py``);      request's dropped step (into its old
                                       allocator frees of the row; row, lengths,   pages, the dump page or flags a new owner
                                       flags reset; the evictor row returned       writes before reading); its pages and row
                                                                                   reach a new owner only through a forward
                                                                                   or an op above, which waits
=====================================  ==========================================  ==========================================

The forward's own pool work (``begin_extend`` / ``begin_decode`` / ``begin_mixed``, the evictor's
boundary pass, the allocator's reclaim of snapshots) runs on the forward stream, in launch order; a
snapshot released there is recorded on that stream (its rows were allocated on the schedule stream).
Page tables, lengths and the allocator change before a decode graph's replay, never in it: so a free
after SGLang's barrier (its read-done event) follows them; where that barrier is off,
:func:`fence_forward` makes the scheduler's stream wait for the whole forward.

Host mirrors. The dual pool's ``cached_len`` / ``active`` / ``generation`` and SGLang's
``Req.kv_committed_len`` advance when a forward is launched, so the scheduler reads them as of every
launched forward, which (after the fence) is also the GPU state its ops see:

======================================  ===========================================================
a cache call's radix path               against the slot's ``cached_len`` when the call runs
======================================  ===========================================================
``cache_finished_req``:                 equal (both as of every launched forward, the overlap step
``kv_committed_len``                    included): the snapshot at the finish is the slot's state
chunk stash (``cache_unfinished_req``,  equal: it runs before the next chunk is launched
chunked)
a prompt's end                          one decode step behind when the request's next forward was
(``cache_unfinished_req``)              launched before the prefill's results were processed (the
                                        overlap order): :func:`snapshot_ahead_of_launch` took the
                                        snapshot at the prompt's end before that launch
======================================  ===========================================================

A cache call never places a snapshot deeper than the path SGLang inserted (the radix cache counts a
slot found past it in ``snapshots_missed``).
"""

from __future__ import annotations


def _runtime_of(scheduler):
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    pool = getattr(scheduler, "req_to_token_pool", None)
    return pool.runtime if isinstance(pool, WGKVReqToTokenPool) else None


def fence_forward(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.run_batch``: under overlap, the forward just launched is what the scheduler's
    next pool ops wait for; where SGLang's WAR barrier is off (a GPU that is not CUDA, without
    ``SGLANG_ENABLE_WAR_BARRIER``) the scheduler's stream waits for all of it."""
    runtime = _runtime_of(scheduler)
    if runtime is None or not scheduler.enable_overlap:
        return None
    runtime.forward_fence.record(scheduler.device_module, scheduler.forward_stream)
    if not getattr(scheduler, "_war_barrier_enabled", True) and scheduler.device != "cpu":
        # request frees change the allocator, which the forward's own step allocates from
        scheduler.schedule_stream.wait_stream(scheduler.forward_stream)
    return None


def admission_headroom(dual, chunk_tokens: int | None) -> int:
    """Free pages the prefix cache leaves after each launch (:func:`refresh_free_pages`): a scheduling
    round's admissions (a chunk's worth of new prompt tokens), the forward in flight's and the next
    one's worst case, and a decode step of every slot; at most an eighth of the pool."""
    chunk = chunk_tokens or dual.max_context_len
    streams = dual.num_layers * dual.num_kv_heads
    need = 3 * dual.extend_bound(0, chunk) + streams * dual.max_requests
    return min(need, dual.allocator.num_pages // 8)


def refresh_free_pages(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.run_batch``, after :func:`fence_forward`: the allocator's free count queued
    to the host behind the forward just launched (on its stream: every allocation launched so far
    precedes it), then the prefix cache's least recently used snapshots dropped down to
    :func:`admission_headroom`, while the GPU runs that forward. The next round's admission checks
    then find room on the host's floor; a full pool of snapshots otherwise made each check reclaim
    with a host sync, and the host stopped running ahead of the GPU."""
    runtime = _runtime_of(scheduler)
    if runtime is None or not runtime.has_pool():
        return None
    dual = runtime.dual
    if scheduler.enable_overlap and dual.device.type == "cuda":
        with scheduler.device_module.stream(scheduler.forward_stream):
            dual.allocator.queue_refresh()
    else:  # one stream: the current one follows the forward
        dual.allocator.queue_refresh()
    cache = runtime.prefix_cache
    if cache is not None and not cache.disable:
        cache.keep_headroom(admission_headroom(dual, runtime.chunk_tokens))
    return None


def extend_rows(batch) -> list[tuple[int, int]]:
    """``(request slot, length it reaches)`` of the rows a forward extends (a mixed forward's prefill
    rows; none for a decode forward)."""
    from sglang_wgkv.integration.backend.batch_slots import mixed_decode_rows

    if not batch.forward_mode.is_extend():
        return []
    prefill = batch.reqs[: len(batch.reqs) - mixed_decode_rows(batch)]
    return [(req.req_pool_idx, req.extend_range.end) for req in prefill]


def record_usage_at_launch(scheduler, batch, *args, **kwargs):
    """BEFORE ``Scheduler.run_batch`` under overlap: every slot's usage counts as of the forward before
    (:class:`~sglang_wgkv.integration.requests.usage_ledger.UsageLedger`), for the frees of its results."""
    runtime = _runtime_of(scheduler)
    if runtime is not None and scheduler.enable_overlap and runtime.has_pool():
        runtime.usage_ledger.record(
            runtime.dual, runtime.evictor, scheduler.device_module, scheduler.forward_stream
        )
    return None


def count_processed(scheduler, *args, **kwargs):
    """BEFORE ``Scheduler.process_batch_result`` under overlap: one more forward's results handled."""
    runtime = _runtime_of(scheduler)
    if runtime is not None and scheduler.enable_overlap and runtime.has_pool():
        runtime.usage_ledger.processed += 1
    return None


def snapshot_ahead_of_launch(scheduler, batch, *args, **kwargs):
    """BEFORE ``Scheduler.run_batch``: the prefix cache snapshots the slots of this forward that sit
    at the end of an extend whose results are not processed yet (the forward moves them), then owes
    this forward's extend rows a cache call."""
    runtime = _runtime_of(scheduler)
    cache = runtime.prefix_cache if runtime is not None else None
    if cache is not None and not batch.is_empty():
        cache.before_forward([req.req_pool_idx for req in batch.reqs], extend_rows(batch))
    return None
