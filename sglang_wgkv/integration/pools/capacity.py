"""The capacity plan: how the memory SGLang budgets for the KV cache is split between SGLang's
logical token pool, its request slots and the dual pool's pages (:func:`plan_capacity`).

SGLang's logical token slots carry no K/V here and are what the scheduler admits, retracts and checks;
the dual pool's 16-token pages hold the K/V (:mod:`~sglang_wgkv.integration.pools.kv_pool`). The physical
pool must never run out while the logical one has room. Budgets are in *dense tokens* (the K and V of
one token in every layer and KV head of this rank); the per-slot state (page-table rows, ring flags,
the evictor's query windows: :class:`~sglang_wgkv.integration.pools.slot_costs.FixedCosts`) comes out of the same budget. The splits, written
out with their reasons in docs/design.md ("The capacity plan")::

    mode        when                                  rule
    ----------  ------------------------------------  -----------------------------------------------
    dense       admission alone, or --kv-budget       physical = logical + SLACK_TOKENS x slots
                without chunked prefill               (n + 64 tokens of pages per request's streams)
    bounded     --kv-budget B with chunked prefill    physical >= R x S, S = W_local + 16 ceil(B/16)
                                                      + 32; logical = R x context length
    overcommit  --wgkv-overcommit F                   F x the dense logical pool and slots; the
                                                      scheduler checks the physical pool itself

Bounded mode: a prompt holds up to ``W_local + prompt_cap + C`` per stream until its end is scored
(``prompt_cap = 16 ceil(B/16) + P``, :func:`prompt_reserve`; ``C`` = ``chunked_prefill_size``), paid
from the pages of free slots (:class:`PromptRule`, :mod:`~sglang_wgkv.integration.scheduling.prefill_guard`)::

    sum over the batch's prompts of excess <= (R - running - batch) x S + spare

Prefix caching reserves a private ring copy (up to ``W_local + 16`` tokens per stream) for
``restore_slots`` restored requests; snapshot pages need no reserve (dropped when a step would not fit).
Bounded requests (a request's own ``kv_budget``, or one longer than the dense-equivalent pool,
:mod:`~sglang_wgkv.integration.scheduling.long_requests`): without ``--kv-budget`` the evictor keeps query windows
for ``long_request_rows`` of them at once, carved from the budget before the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sglang_wgkv.config import DEFAULT_PROMPT_WINDOW, PAGE_SIZE
from sglang_wgkv.integration.pools.slot_costs import ModelShape, fixed_costs

SLACK_TOKENS = 4 * PAGE_SIZE
# At most this fraction of the budget goes to per-request slack; past it, fewer request slots.
MAX_SLACK_FRACTION = 0.25
# At most this fraction of the budget is reserved for the ring copies of prefix-restored requests.
MAX_RESTORE_FRACTION = 0.125
# At most this fraction of the budget goes to the evictor's query windows; past it, fewer slots.
MAX_WINDOW_FRACTION = 0.25
# At most this fraction of the budget is reserved for the prompt being prefilled (bounded split).
MAX_PROMPT_FRACTION = 0.25


@dataclass(frozen=True)
class PromptRule:
    """What a prompt may hold while it is prefilled in bounded mode and where that room comes from
    (this module's docstring), in tokens per stream.

    local_window : W_local.
    slot_tokens : ``S``, the pages one request slot holds between steps (ring + budget + 2 pages).
    cap : ``prompt_cap``, the global entries a stream keeps until its prompt ends (budget + ``P``).
    chunk_tokens : ``C``, SGLang's ``chunked_prefill_size`` (new tokens of one extend at most).
    requests : ``R``, the request slots.
    spare_tokens : the dual pool's pages beyond ``R x S``.
    """

    local_window: int
    slot_tokens: int
    cap: int
    chunk_tokens: int
    requests: int
    spare_tokens: int

    def excess_tokens(self, prompt_len: int) -> int:
        """Tokens per stream beyond ``slot_tokens`` that a prompt of ``prompt_len`` tokens (prefix
        included) may hold while it is prefilled: at a boundary, or within an extend of up to
        ``chunk_tokens`` new tokens with what its step reserves. A chunk starts from at most ``cap``
        global entries and adds at most its own tokens, so the global part stays within
        ``min(prompt_len - W_local, cap + C)``; on top of the ring and those pages, one page for the
        two partial pages (the chunk's and the cache's) and the two that ``begin_extend`` reserves
        (:meth:`~sglang_wgkv.memory.DualCachePool.extend_bound`)."""
        held_global = min(max(0, prompt_len - self.local_window), self.cap + self.chunk_tokens)
        held = self.local_window + PAGE_SIZE * (-(-held_global // PAGE_SIZE) + 3)
        return max(0, held - self.slot_tokens)

    def room(self, holding: int) -> int:
        """Tokens per stream of the pages no request slot's bound covers while ``holding`` requests
        (running, and in the prefill batch) hold a slot: the other slots' and the spare pages."""
        return (self.requests - holding) * self.slot_tokens + self.spare_tokens


@dataclass(frozen=True)
class CapacityPlan:
    """What SGLang and the dual pool get out of SGLang's KV budget (dense tokens).

    logical_tokens : SGLang's ``max_total_num_tokens`` (logical token slots).
    max_requests : SGLang's ``max_running_requests`` (request slots, each with dual-pool streams).
    physical_tokens : dual-pool pages, in dense tokens (:func:`physical_pages`).
    restore_slots : prefix-restored requests that may run at once (radix cache).
    max_request_tokens : overcommit only: the longest request (prompt + output) with admission off
        and the length past which a request with admission on is bounded (``long_requests``).
    mode : ``dense``, ``bounded`` or ``overcommit``.
    fixed_tokens : the budget spent on per-slot state (page-table rows, flags, evictor windows).
    prompt : bounded only: the prompt rule (:class:`PromptRule`: ``prompt_cap``, prompt slots).
    long_request_rows : without ``--kv-budget``: evictor window rows, i.e. bounded requests at once.
    """

    logical_tokens: int
    max_requests: int
    physical_tokens: int
    restore_slots: int = 0
    max_request_tokens: int | None = None
    mode: str = "dense"
    fixed_tokens: int = 0
    prompt: PromptRule | None = None
    long_request_rows: int = 0

    @property
    def prompt_cap(self) -> int | None:
        """Bounded only: global tokens per stream a prompt may keep while it is prefilled."""
        return None if self.prompt is None else self.prompt.cap


def restore_reserve(budget_tokens: int, max_requests: int, local_window: int) -> tuple[int, int]:
    """``(restore_slots, reserved tokens)`` for prefix caching: at least one restored request, at
    most half the request slots, within :data:`MAX_RESTORE_FRACTION` of the budget where possible."""
    ring = local_window + PAGE_SIZE
    slots = max(1, min(max(1, max_requests // 2), int(budget_tokens * MAX_RESTORE_FRACTION) // ring))
    return slots, slots * ring


def dense_split(
    budget_tokens: int,
    max_running_requests: int,
    prefix_cache_window: int | None = None,
    slot_tokens: int = 0,
) -> CapacityPlan:
    """The dense-equivalent split of ``budget_tokens``; ``prefix_cache_window`` (W_local) when the
    radix cache is on; ``slot_tokens`` of fixed state per request slot, taken from both pools (the
    dual pool's pages and, so that the capacity rule holds, the logical pool).

    Raises ValueError when the budget cannot hold one request's slack plus a useful remainder.
    """
    requests = min(max_running_requests, int(budget_tokens * MAX_SLACK_FRACTION) // SLACK_TOKENS)
    if requests < 1:
        raise ValueError(
            f"WG-KV needs a KV budget of at least {int(SLACK_TOKENS / MAX_SLACK_FRACTION)} tokens "
            f"(got {budget_tokens}); raise --max-total-tokens or the memory fraction"
        )
    slots, reserve = 0, 0
    if prefix_cache_window is not None:
        slots, reserve = restore_reserve(budget_tokens, requests, prefix_cache_window)
    fixed = slot_tokens * requests
    logical = budget_tokens - fixed - SLACK_TOKENS * requests - reserve
    if logical < (budget_tokens - fixed) // 2:
        raise ValueError(
            f"WG-KV needs a larger KV budget than {budget_tokens} tokens for {requests} request "
            f"slots (W_local = {prefix_cache_window}, {slot_tokens} tokens of state per slot); "
            f"raise --max-total-tokens or pass --disable-radix-cache"
        )
    return CapacityPlan(logical, requests, budget_tokens - fixed, slots, fixed_tokens=fixed)


def request_bound_tokens(kv_budget: int, local_window: int) -> int:
    """Dense-token equivalent of one request's pages between steps in bounded mode (ring + budget)."""
    return local_window + PAGE_SIZE * -(-kv_budget // PAGE_SIZE)


def prompt_reserve(budget_tokens: int, *, kv_budget: int, local_window: int, context_len: int) -> int:
    """``P`` of the bounded split (module docstring): the global entries a stream of the longest
    prompt could hold beyond the budget while it is prefilled, in whole pages, at most
    :data:`MAX_PROMPT_FRACTION` of ``budget_tokens``."""
    want = max(0, context_len - request_bound_tokens(kv_budget, local_window))
    room = int(budget_tokens * MAX_PROMPT_FRACTION) // PAGE_SIZE
    return PAGE_SIZE * min(-(-want // PAGE_SIZE), room)


def bounded_split(
    budget_tokens: int,
    max_running_requests: int,
    *,
    kv_budget: int,
    local_window: int,
    chunk_tokens: int,
    context_len: int,
    window_tokens: int = 0,
    prefix_cache: bool = False,
) -> CapacityPlan | None:
    """The bounded split (module docstring) of SGLang's KV budget, or None when the budget cannot hold
    the longest prompt beside nothing else. ``window_tokens``: fixed state per request slot (evictor
    window, page-table row), also carved from the budget; ``physical_tokens`` is what is left for the
    dual pool. With ``prefix_cache``, snapshots pinned between a match and their restore (at most
    ``restore_slots``) get a reserve of one request bound each, a prompt's included (a snapshot may be
    taken before the prompt's end; unpinned snapshots are dropped when a step needs room)."""
    steady = request_bound_tokens(kv_budget, local_window)
    slot = steady + 2 * PAGE_SIZE
    per_request = slot + window_tokens
    prompt = prompt_reserve(
        budget_tokens, kv_budget=kv_budget, local_window=local_window, context_len=context_len
    )

    def fit(reserve: int) -> int:
        return min(max_running_requests, (budget_tokens - reserve) // per_request)

    requests, slots = fit(0), 0
    if prefix_cache and requests >= 1:
        restored = steady + prompt + PAGE_SIZE
        cap = max(1, int(budget_tokens * MAX_RESTORE_FRACTION) // restored)
        slots = max(1, min(requests // 2, cap))
        requests = fit(slots * restored)
    if requests < 1:
        return None
    chunk = PAGE_SIZE * -(-chunk_tokens // PAGE_SIZE)
    physical = budget_tokens - requests * window_tokens

    def rule(p: int) -> PromptRule:
        return PromptRule(
            local_window=local_window,
            slot_tokens=slot,
            cap=steady - local_window + p,
            chunk_tokens=chunk,
            requests=requests,
            spare_tokens=physical - requests * slot,
        )

    # the longest prompt must fit beside nothing else (its excess within room(1)), or it would wait
    # forever: P shrinks, in whole pages; None when even P = 0 (one chunk's excess) does not fit
    room = rule(prompt).room(1)
    if rule(prompt).excess_tokens(context_len) > room:
        prompt = min(prompt, PAGE_SIZE * ((room - chunk - PAGE_SIZE) // PAGE_SIZE))
        if prompt < 0 or rule(prompt).excess_tokens(context_len) > room:
            return None
    return CapacityPlan(
        logical_tokens=requests * context_len,
        max_requests=requests,
        physical_tokens=physical,
        restore_slots=slots,
        mode="bounded",
        fixed_tokens=requests * window_tokens,
        prompt=rule(prompt),
    )


def overcommit_split(
    budget_tokens: int,
    max_running_requests: int,
    factor: float,
    slot_tokens: int = 0,
    prefix_cache: bool = False,
) -> CapacityPlan:
    """``factor`` times the dense-equivalent logical pool and request slots (slots at most
    ``max_running_requests``); the physical pool keeps the budget less the slots' fixed state.
    With ``prefix_cache`` every request may be a restored one: the scheduler's prefill guard counts
    a hit's ring copy (:meth:`DualCachePool.restore_bound`), so no pages are set aside for it."""
    dense = dense_split(budget_tokens, max_running_requests, slot_tokens=slot_tokens)
    requests = min(max_running_requests, math.ceil(factor * dense.max_requests))
    fixed = slot_tokens * requests
    return CapacityPlan(
        logical_tokens=int(factor * dense.logical_tokens),
        max_requests=requests,
        physical_tokens=budget_tokens - fixed,
        restore_slots=requests if prefix_cache else 0,
        max_request_tokens=dense.logical_tokens,
        mode="overcommit",
        fixed_tokens=fixed,
    )


def physical_pages(physical_tokens: int, num_layers: int, num_kv_heads: int) -> int:
    """Pages that hold ``physical_tokens`` dense tokens of every layer and KV head."""
    return physical_tokens * num_layers * num_kv_heads // PAGE_SIZE


def plan_capacity(
    budget_tokens: int,
    max_running_requests: int,
    *,
    shape: ModelShape,
    local_window: int,
    kv_budget: int | None = None,
    evictor_window: int | None = None,
    overcommit: float | None = None,
    chunk_tokens: int | None = None,
    prefix_cache: bool = False,
) -> CapacityPlan:
    """The one capacity rule of a WG-KV server (module docstring).

    budget_tokens, max_running_requests : what SGLang derived from its memory budget (dense tokens)
        or ``--max-total-tokens`` / ``--max-running-requests``.
    kv_budget, evictor_window : ``--kv-budget`` and the evictor's query window (queries per slot
        and layer); the bounded split needs chunked prefill (``chunk_tokens`` > 0), else the
        dense-equivalent one with the windows carved from the budget.
    overcommit : ``--wgkv-overcommit`` (excludes ``kv_budget``).

    Without ``kv_budget``, the windows of :func:`~sglang_wgkv.integration.scheduling.long_requests.long_request_rows` bounded requests
    (``min(DEFAULT_PROMPT_WINDOW, local_window)`` queries each) come out of the budget first.

    Raises ValueError when the budget cannot hold one request.
    """
    if kv_budget is None:
        from sglang_wgkv.integration.scheduling.long_requests import long_request_rows

        row = fixed_costs(shape, local_window, min(DEFAULT_PROMPT_WINDOW, local_window)).window_tokens
        rows = long_request_rows(budget_tokens, row)
        plan = _plan_split(
            budget_tokens - rows * row,
            max_running_requests,
            shape=shape,
            local_window=local_window,
            overcommit=overcommit,
            prefix_cache=prefix_cache,
        )
        return replace(plan, long_request_rows=rows, fixed_tokens=plan.fixed_tokens + rows * row)
    return _plan_split(
        budget_tokens,
        max_running_requests,
        shape=shape,
        local_window=local_window,
        kv_budget=kv_budget,
        evictor_window=evictor_window,
        overcommit=overcommit,
        chunk_tokens=chunk_tokens,
        prefix_cache=prefix_cache,
    )


def _plan_split(
    budget_tokens: int,
    max_running_requests: int,
    *,
    shape: ModelShape,
    local_window: int,
    kv_budget: int | None = None,
    evictor_window: int | None = None,
    overcommit: float | None = None,
    chunk_tokens: int | None = None,
    prefix_cache: bool = False,
) -> CapacityPlan:
    """:func:`plan_capacity` of what is left after the bounded requests' windows."""
    costs = fixed_costs(shape, local_window, evictor_window if kv_budget is not None else None)
    if overcommit is not None:
        return overcommit_split(
            budget_tokens,
            max_running_requests,
            overcommit,
            slot_tokens=costs.per_slot,
            prefix_cache=prefix_cache,
        )
    if kv_budget is not None and chunk_tokens is not None and chunk_tokens > 0:
        plan = bounded_split(
            budget_tokens,
            max_running_requests,
            kv_budget=kv_budget,
            local_window=local_window,
            chunk_tokens=chunk_tokens,
            context_len=shape.context_len,
            window_tokens=costs.per_slot,
            prefix_cache=prefix_cache,
        )
        if plan is not None:
            return plan
    if costs.window_tokens:
        # the windows' share of the budget is capped: past it, fewer request slots
        max_running_requests = min(
            max_running_requests, max(1, int(budget_tokens * MAX_WINDOW_FRACTION) // costs.window_tokens)
        )
    return dense_split(
        budget_tokens,
        max_running_requests,
        local_window if prefix_cache else None,
        slot_tokens=costs.per_slot,
    )
