"""Requests longer than the dense pool, and per-request KV budgets (``custom_params.wgkv.kv_budget``).

A request is *bounded* when the SnapKV evictor holds its global cache to a budget of its own
(:meth:`~sglang_wgkv.memory.evictor.SnapKVEvictor.bound_request`), for one of two reasons:

=========  ==========================================================================================
source     when
=========  ==========================================================================================
request    it set ``kv_budget`` (in ``[W_local, context length]``; at most the server's ``--kv-budget``)
pool       overcommit plan, admission on, prompt + output longer than the dense-equivalent pool
           (which the physical pool holds alone): the request gets what the free pages hold
=========  ==========================================================================================

A request's own budget is per stream, ``(budget, cap)`` global tokens per (layer, KV head): while
its prompt is prefilled a stream keeps up to ``cap = budget + max(budget, C)`` entries (then it is
compressed early to ``budget``, scored by the latest chunk's queries, logged); at the prompt's end
and while decoding it is held to ``budget`` (scored by the prompt's last queries, then the decode
window). ``C``: one prefill chunk.

A pool bound is summed over the request's streams, ``(total_budget, total_cap)``, because heads
admit very different amounts (a head that keeps every token beside heads that keep a few): a
compression cuts only the streams holding the most, to the common level that brings the sum to
``total_budget`` (:meth:`SnapKVEvictor.bound_request`). ``total_cap`` fills the pages free when the
request is admitted; ``total_budget = total_cap - max(one chunk per stream, total_cap / 8)`` leaves
room for the chunks after a compression. A request whose admitted KV stays under ``total_cap`` is
never compressed; one that outgrows it compresses its own global pages only (never another
request's), and the forward goes on. Either way the request's pages never exceed
:meth:`RequestBound.pages` (per stream the ring, one chunk, a partial page and ``begin_extend``'s
reserve, plus the capped global part), which is what the overcommit prefill guard reserves for it
instead of its dense prompt (:mod:`.overcommit`). A request that needs a bound but cannot get one
even with the whole pool free (W_local per stream on average would not fit) gets a 400 before any
work (:func:`~sglang_wgkv.integration.scheduling.overcommit.check_request_length`), as does a request with admission off that is longer than the
dense-equivalent pool (it keeps every token, so it must fit densely).

Window rows: a server without ``--kv-budget`` keeps query windows for :data:`LONG_REQUEST_ROWS`
bounded requests at once (capacity plan, :func:`long_request_rows`); a bounded request waits for a
free row like it waits for pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sglang_wgkv.config import DEFAULT_EVICTOR_LEAD, PAGE_SIZE

logger = logging.getLogger(__name__)

# Query-window rows of a server without --kv-budget: bounded requests that may run at once.
LONG_REQUEST_ROWS = 4
# At most this fraction of the KV budget goes to those rows (at least one row is always kept).
MAX_ROWS_FRACTION = 1 / 16
# Pages per stream beyond ring + cap + chunk: the partial pages and begin_extend's reserve.
BOUND_SLACK_PAGES = 3
# SGLang ``Req`` attribute: the bound the overcommit prefill guard chose when it admitted the request.
WGKV_BOUND = "wgkv_bound"
# SGLang ``PrefillAdder`` attribute: window rows its scheduling pass reserved for bounded requests.
WGKV_ROWS = "wgkv_reserved_rows"


def long_request_rows(budget_tokens: int, row_tokens: int) -> int:
    """Window rows a server without ``--kv-budget`` keeps (``row_tokens``: one row's memory in dense
    tokens): :data:`LONG_REQUEST_ROWS`, fewer where they would pass :data:`MAX_ROWS_FRACTION` of the
    budget, at least one."""
    if row_tokens <= 0:
        return LONG_REQUEST_ROWS
    return max(1, min(LONG_REQUEST_ROWS, int(budget_tokens * MAX_ROWS_FRACTION) // row_tokens))


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


@dataclass(frozen=True)
class RequestBound:
    """One request's bound (module docstring), in global tokens.

    budget, cap : per stream (None: none); total_budget, total_cap : summed over the request's
    streams (None: none); held to at the prompt's end and while decoding / while the prompt is
    prefilled. lead : the evictor's lead per stream; source : ``request`` (its ``kv_budget``) or
    ``pool`` (what the free pages held).
    """

    budget: int | None
    cap: int | None
    source: str
    total_budget: int | None = None
    total_cap: int | None = None
    lead: int = 0

    def __post_init__(self):
        pairs = [(self.budget, self.cap), (self.total_budget, self.total_cap)]
        if (
            self.source not in ("request", "pool")
            or all(b is None for b, _ in pairs)
            or any((b is None) != (c is None) or (b is not None and not self.lead < b <= c) for b, c in pairs)
        ):
            raise ValueError(f"invalid request bound {self}")

    def pages(self, streams: int, local_window: int, chunk_tokens: int) -> int:
        """Pages the request holds at most over its ``streams`` (layers x KV heads): per stream the
        ring, one chunk, a partial page and ``begin_extend``'s reserve, plus the capped global part."""
        fixed = streams * (local_window // PAGE_SIZE + _pages(chunk_tokens) + 1 + BOUND_SLACK_PAGES)
        held = []
        if self.cap is not None:
            held.append(streams * _pages(self.cap))
        if self.total_cap is not None:
            held.append(_pages(self.total_cap))
        return fixed + min(held)


def requested_bound(kv_budget: int, chunk_tokens: int) -> RequestBound:
    """The bound of a request's own ``kv_budget``: ``cap = budget + max(budget, C)`` (in pages)."""
    chunk = PAGE_SIZE * _pages(chunk_tokens)
    cap = PAGE_SIZE * _pages(kv_budget + max(kv_budget, chunk))
    return RequestBound(kv_budget, cap, "request", lead=min(DEFAULT_EVICTOR_LEAD, kv_budget // 8))


def pool_bound(
    *, kv_budget: int | None, local_window: int, chunk_tokens: int, room_pages: int, streams: int
) -> RequestBound | None:
    """The bound of a request longer than the dense pool that may take ``room_pages`` pages over its
    ``streams``: its own (``kv_budget``) where that fits, else a summed bound that fills the room
    (``total_cap``; ``total_budget`` less ``max(one chunk per stream, 1/8)``, and its own per-stream
    budget if it set one); None when even ``total_budget`` = W_local per stream does not fit.

    chunk_tokens : its largest prefill chunk (:func:`request_chunk`)."""
    want = None if kv_budget is None else requested_bound(kv_budget, chunk_tokens)
    if want is not None and want.pages(streams, local_window, chunk_tokens) <= room_pages:
        return want
    chunk = PAGE_SIZE * _pages(chunk_tokens)
    fixed = streams * (local_window // PAGE_SIZE + _pages(chunk_tokens) + 1 + BOUND_SLACK_PAGES)
    total_cap = PAGE_SIZE * (room_pages - fixed)
    total_budget = PAGE_SIZE * ((total_cap - max(streams * chunk, total_cap // 8)) // PAGE_SIZE)
    if total_budget < streams * local_window:
        return None
    lead = min(DEFAULT_EVICTOR_LEAD, total_budget // (8 * streams))
    return RequestBound(
        budget=None if want is None else want.budget,
        cap=None if want is None else want.cap,
        source="pool",
        total_budget=total_budget,
        total_cap=total_cap,
        lead=lead if want is None else min(lead, want.lead),
    )


def request_chunk(scheduler_chunk: int | None, prompt_len: int) -> int:
    """Tokens of the request's largest prefill chunk: SGLang's ``chunked_prefill_size``, or its whole
    prompt when chunked prefill is off (``None`` / ``<= 0``) or the prompt is shorter."""
    if scheduler_chunk is None or scheduler_chunk <= 0:
        return prompt_len
    return min(scheduler_chunk, prompt_len)


def length_error(
    *,
    length: int,
    admission: bool,
    dense_limit: int,
    local_window: int,
    chunk_tokens: int,
    room_pages: int,
    streams: int,
) -> str | None:
    """Why a request of ``length`` tokens (prompt + output) can never run on an overcommit plan whose
    dense-equivalent pool is ``dense_limit`` tokens and whose physical pool gives one request
    ``room_pages`` pages over its ``streams`` alone; None when it can."""
    if length <= dense_limit:
        return None
    if not admission:
        return (
            f"Request length ({length} tokens, prompt + max_new_tokens) exceeds the maximum allowed "
            f"length with admission off ({dense_limit} tokens): such a request keeps every token, so "
            f"it must fit the dense-equivalent pool; turn admission on to serve it longer"
        )
    if (
        pool_bound(
            kv_budget=None,
            local_window=local_window,
            chunk_tokens=chunk_tokens,
            room_pages=room_pages,
            streams=streams,
        )
        is None
    ):
        return (
            f"Request length ({length} tokens) exceeds the dense-equivalent pool ({dense_limit} tokens) "
            f"and cannot fit even compressed: its KV per layer and head would need at least the ring "
            f"(W_local = {local_window}) twice plus one prefill chunk ({chunk_tokens} tokens) and "
            f"{BOUND_SLACK_PAGES + 1} pages, more than the pool's {room_pages * PAGE_SIZE // streams} "
            f"tokens; lower --chunked-prefill-size or raise the KV memory"
        )
    return None


def reserve_row(adder, evictor) -> bool:
    """Take one of the evictor's free window rows for a request this prefill batch admits (counted
    on SGLang's adder, which lives for one scheduling pass); False when none is left."""
    taken = getattr(adder, WGKV_ROWS, 0)
    if evictor is None or evictor.free_rows() <= taken:
        return False
    setattr(adder, WGKV_ROWS, taken + 1)
    return True


def release_row(adder, reserved: bool) -> None:
    """Undo :func:`reserve_row` for a request the batch did not take after all."""
    if reserved:
        setattr(adder, WGKV_ROWS, getattr(adder, WGKV_ROWS) - 1)


def apply_bound(runtime, req, slot: int, kv_budget: int | None) -> RequestBound | None:
    """Bound request slot ``slot`` in the evictor as the prefill guard decided (``req``'s
    :data:`WGKV_BOUND`) or, on plans whose guard decides none, by the request's ``kv_budget``
    (with the server's ``--kv-budget``, under its prompt cap). Returns the bound (None: unbounded)."""
    evictor = runtime.evictor
    bound = getattr(req, WGKV_BOUND, None)
    if bound is None and kv_budget is not None:
        if evictor.budget is not None:
            cap = max(evictor.prompt_cap or kv_budget, kv_budget)
            bound = RequestBound(kv_budget, cap, "request", lead=min(evictor.lead, kv_budget // 8))
        else:
            chunk = request_chunk(runtime.chunk_tokens, len(req.origin_input_ids))
            bound = requested_bound(kv_budget, chunk)
    if bound is not None:
        evictor.bound_request(slot, bound.budget, bound.cap, bound.lead, bound.total_budget, bound.total_cap)
        if bound.source == "pool":
            logger.info(
                "wgkv: request %s (%d prompt tokens) is longer than the dense-equivalent pool: its "
                "global cache is held to %d tokens (all layers and heads) while prefilled, %d after "
                "(compressed only if it admits more)",
                req.rid,
                len(req.origin_input_ids),
                bound.total_cap,
                bound.total_budget,
            )
    return bound
