"""Which requests a prefill batch may take, by the capacity plan's mode (AROUND hooks on SGLang's
``PrefillAdder``; one hook per target, dispatching here):

=========  ==================================================================================
mode       guard
=========  ==================================================================================
overcommit the dual pool holds the request's whole prompt (:mod:`~.overcommit`)
bounded    the prompts of the batch fit in the room no request slot's bound covers (below)
dense      none (SGLang's own token and slot checks imply the dual pool's), but a request with its
           own ``kv_budget`` waits for a free query-window row (:mod:`~.long_requests`)
=========  ==================================================================================

Bounded prompt guard (:class:`~sglang_wgkv.integration.pools.capacity.PromptRule`, the capacity module's
docstring). Between steps a request holds at most one slot's bound of pages; while its prompt is
prefilled it may hold ``excess_tokens(prompt length)`` more per stream. A request joins a batch only
if the excess of the batch's prompts, its own included, fits in ``room(running + batch)``: the
pages of the slots no request holds plus the spare pages. SGLang's chunked request is continued
first in every batch of its chunks (``add_chunked_req``) and counts in each. Held in the adder
(``wgkv_prompt_excess``), which lives for one scheduling pass. Not fitting: ``OTHER`` (the batch
closes; the request is tried again in the next pass, when this batch's prompts have ended) if it
would fit once they end, else ``NO_TOKEN`` (SGLang tries no prefill until a request leaves).
"""

from __future__ import annotations

import functools

from sglang_wgkv.integration.requests.control import RequestAdmission
from sglang_wgkv.integration.scheduling import branch_split, overcommit
from sglang_wgkv.integration.scheduling.long_requests import release_row, reserve_row


def _runtime(adder):
    """The WG-KV runtime behind the adder's KV pool, or None (not a WG-KV pool)."""
    allocator = adder.token_to_kv_pool_allocator
    return getattr(allocator.get_kvcache(), "runtime", None) if allocator is not None else None


def _plan(adder):
    """The WG-KV capacity plan behind the adder's KV pool, or None (not a WG-KV pool)."""
    runtime = _runtime(adder)
    return None if runtime is None else runtime.plan


def _dense_add_one_req(original, adder, req, runtime, *args, **kwargs):
    """The dense plan: a request with its own ``kv_budget`` needs a free query-window row."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    evictor = runtime.evictor
    bounded = evictor is not None and not evictor.identity_rows and RequestAdmission.of_request(req).kv_budget
    if bounded and not reserve_row(adder, evictor):
        return AddReqResult.OTHER if adder.can_run_list else AddReqResult.NO_TOKEN
    result = original(adder, req, *args, **kwargs)
    if not (adder.can_run_list and adder.can_run_list[-1] is req):
        release_row(adder, bool(bounded))
    return result


def add_one_req(original, adder, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req``: the plan's guard, then SGLang's own checks, the chunk
    ending at the request's branch point if it has one (:mod:`~.branch_split`)."""
    return _guarded_add_one_req(
        functools.partial(branch_split.add_one_req, original), adder, req, *args, **kwargs
    )


def _guarded_add_one_req(original, adder, req, *args, **kwargs):
    plan = _plan(adder)
    if plan is not None and plan.mode == "overcommit":
        return overcommit.add_one_req(original, adder, req, *args, **kwargs)
    if plan is not None and plan.prompt is None:
        return _dense_add_one_req(original, adder, req, _runtime(adder), *args, **kwargs)
    if plan is None:
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    rule = plan.prompt
    excess = rule.excess_tokens(len(req.full_untruncated_fill_ids))
    held = getattr(adder, "wgkv_prompt_excess", 0)
    running = len(adder.running_batch.reqs) if adder.running_batch is not None else 0
    room = rule.room(running + len(adder.can_run_list) + 1)
    if held + excess > room:
        return AddReqResult.OTHER if excess <= room else AddReqResult.NO_TOKEN
    result = original(adder, req, *args, **kwargs)
    if adder.can_run_list and adder.can_run_list[-1] is req:
        adder.wgkv_prompt_excess = held + excess
    return result


def add_chunked_req(original, adder, req):
    """AROUND ``PrefillAdder.add_chunked_req``: the chunked request always runs (SGLang requires it);
    its reserve (overcommit) or its prompt's excess (bounded) counts before other requests join."""
    plan = _plan(adder)
    if plan is not None and plan.mode == "overcommit":
        return overcommit.add_chunked_req(original, adder, req)
    if plan is not None and plan.prompt is not None:
        adder.wgkv_prompt_excess = getattr(adder, "wgkv_prompt_excess", 0) + plan.prompt.excess_tokens(
            len(req.full_untruncated_fill_ids)
        )
    return original(adder, req)
