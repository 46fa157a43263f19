"""Which forward a scheduling pass builds while requests decode: whether its prefill may carry the
running decodes (SGLang's ``--enable-mixed-chunk``), and how many prefill tokens it takes
(``--wgkv-forward-tokens``). One AROUND hook on ``Scheduler._get_new_batch_prefill_raw`` sets the
scheduler's three per-pass inputs for the call and restores them after it:

==================  ===========================================  ==========================================
scheduler field     set to, while ``d`` requests decode           why
==================  ===========================================  ==========================================
is_mixed_chunk      False for a pass whose chunked prompt and     overcommit: the dual pool must hold the
                    decode rows the dual pool cannot both hold    chunk and the decode step (below)
chunked_prefill_    min(own, share(d) + d if mixed else 0)        a forward's prefill share; SGLang takes
size                                                              the d decode rows out of it when mixed
max_prefill_tokens  the same                                      (SGLang's ``num_mixed_decode_tokens``)
==================  ===========================================  ==========================================

with ``share(d) = max(T - d, T // 4)`` (:class:`ForwardBudget`). With no request decoding the pass is
SGLang's own (full chunks: the first wave's TTFT is unchanged). With ``--wgkv-running-knee`` the same
hook first asks :mod:`~.running_knee` whether the pass admits at all; a pass that does not still runs
a chunked prompt's next chunk, with the waiting queue out of SGLang's sight (a full chunk budget ends
in a chunked prompt nearly every pass of a burst, so holding only chunk-free passes would never hold).

Why a budget (docs/mixed-traffic.md). SGLang runs a prefill whenever one can be formed and decodes
only in between; the time a decoding request waits for its next token is the prefill work run
before it. Upstream's KV pool caps that work by accident: it admits no more than it can hold. WG-KV's
larger pool (``--wgkv-overcommit``) admits every request of a burst, so the running requests wait
through every prompt of it. Mixed batches advance every decoding request in each forward, and the
budget keeps each forward near the time of ``T`` tokens, so a token costs one such forward however
many prompts wait (Sarathi-Serve's stall-free batching). The budget limits neither the requests
admitted nor the decode batch: a memory-bound workload keeps its large decode batches, and its
prompts, short against its outputs, are prefilled in ``share(d)``-token forwards that also decode.

Pool guard (overcommit, :mod:`~.overcommit`). A chunked prompt in flight is continued by every pass
without a new admission check; its whole remaining prompt was reserved when it was admitted, and
without mixed batches nothing else allocates until its chunks end. A mixed pass also runs a decode
step, so it mixes only if the dual pool holds the prompt's remaining reserve plus that step
(:meth:`DualCachePool.extend_bound`, :meth:`DualCachePool.decode_worst_case`); otherwise the chunk
runs alone, which its reserve covers. New requests are admitted by the prefill guard, which counts a
decode step of every running request already.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from sglang_wgkv.integration.scheduling.running_knee import holds_new_requests, scheduler_runtime


@dataclass(frozen=True)
class ForwardBudget:
    """Tokens per forward while requests decode (``--wgkv-forward-tokens``).

    tokens : ``T``, a forward's prefill tokens plus its decode rows while requests decode; the
        prefill share never drops below ``T // 4`` (so a prompt always advances).
    """

    tokens: int

    def __post_init__(self):
        if self.tokens < 16:
            raise ValueError(f"the forward token budget must be at least 16 tokens, got {self.tokens}")

    def prefill_share(self, decoding: int) -> int:
        """Prefill tokens a forward may take beside ``decoding`` decode rows."""
        return max(self.tokens - decoding, self.tokens // 4)


@dataclass(frozen=True)
class PassInputs:
    """The scheduler's per-pass inputs (``chunked_prefill_size`` None: chunked prefill off)."""

    chunked_prefill_size: int | None
    max_prefill_tokens: int
    is_mixed_chunk: bool


def pass_inputs(
    own: PassInputs, decoding: int, budget: ForwardBudget | None, pool_holds_mixed: bool = True
) -> PassInputs:
    """What a pass runs with while ``decoding`` requests decode (module table); ``own``: SGLang's."""
    mixed = own.is_mixed_chunk and pool_holds_mixed
    if budget is None or decoding == 0 or own.chunked_prefill_size is None:
        return PassInputs(own.chunked_prefill_size, own.max_prefill_tokens, mixed)
    limit = budget.prefill_share(decoding) + (decoding if mixed else 0)
    return PassInputs(
        min(own.chunked_prefill_size, limit), min(own.max_prefill_tokens, limit), is_mixed_chunk=mixed
    )


def pool_holds_mixed(runtime, chunked_req, running_reqs) -> bool:
    """Overcommit only (else True): the dual pool holds the chunked prompt's remaining reserve and a
    decode step of ``running_reqs`` (module docstring)."""
    if runtime.plan is None or runtime.plan.mode != "overcommit" or chunked_req is None or not running_reqs:
        return True
    dual = runtime.dual
    cached = int(dual.cached_len[chunked_req.req_pool_idx])
    need = dual.extend_bound(cached, max(0, len(chunked_req.full_untruncated_fill_ids) - cached))
    need += dual.decode_worst_case(dual.cached_len[[r.req_pool_idx for r in running_reqs]])
    return dual.allocator.fits(need)


@contextlib.contextmanager
def _waiting_hidden(scheduler):
    """The pass sees no waiting request (the hidden ones yielded); any queued during it (a grammar
    ready, a preemption) stay queued behind them."""
    hidden = scheduler.waiting_queue
    scheduler.waiting_queue = []
    try:
        yield hidden
    finally:
        scheduler.waiting_queue = hidden + scheduler.waiting_queue


@contextlib.contextmanager
def _overridden(obj, inputs: PassInputs):
    fields = ("chunked_prefill_size", "max_prefill_tokens", "is_mixed_chunk")
    before = {name: getattr(obj, name) for name in fields}
    try:
        for name in fields:
            setattr(obj, name, getattr(inputs, name))
        yield
    finally:
        for name, value in before.items():
            setattr(obj, name, value)


def schedule_prefill(original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler._get_new_batch_prefill_raw`` (module docstring)."""
    runtime = scheduler_runtime(scheduler)
    running = kwargs["running_batch"] if "running_batch" in kwargs else args[1]
    if runtime is None or not running.reqs:
        return original(scheduler, *args, **kwargs)
    if holds_new_requests(runtime, scheduler, running.reqs):
        if scheduler.chunked_req is None:
            return None, running  # the running batch decodes; the waiting requests wait (running_knee.py)
        runtime.running_knee.held_chunk_passes += 1
        with _waiting_hidden(scheduler) as hidden:  # the chunked prompt's next chunk, no new request
            batch, running = _budgeted(original, scheduler, runtime, running, args, kwargs)
        _count_hidden_pending(batch, hidden)
        return batch, running
    return _budgeted(original, scheduler, runtime, running, args, kwargs)


def _count_hidden_pending(batch, hidden) -> None:
    """The pass's prefill stats (SGLang's ``#pending-token`` log field and gauge) counted the waiting
    requests' tokens from the queue it saw, empty: add the hidden ones'."""
    stats = getattr(batch, "prefill_stats", None)
    if stats is not None and hidden:
        stats.num_pending_tokens += sum(req.seqlen for req in hidden)


def _budgeted(original, scheduler, runtime, running, args, kwargs):
    """SGLang's pass under the forward-token budget (module table)."""
    own = PassInputs(scheduler.chunked_prefill_size, scheduler.max_prefill_tokens, scheduler.is_mixed_chunk)
    tokens = runtime.settings.forward_tokens
    inputs = pass_inputs(
        own,
        len(running.reqs),
        ForwardBudget(tokens) if tokens else None,
        pool_holds_mixed=not own.is_mixed_chunk
        or pool_holds_mixed(runtime, scheduler.chunked_req, running.reqs),
    )
    if inputs == own:
        return original(scheduler, *args, **kwargs)
    with _overridden(scheduler, inputs):
        return original(scheduler, *args, **kwargs)
