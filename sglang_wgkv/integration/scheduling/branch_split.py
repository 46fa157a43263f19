"""Prefix snapshots at branch points: a request whose prompt shares more of the radix tree than the
deepest snapshot on its path ends its first chunk where the shared part ends, so that a snapshot is
taken there and every later request sharing that part resumes from it.

A snapshot can only be taken of a request at its own length (the ring's dropped tokens cannot be
recovered later), and the radix cache takes them at chunk boundaries, prompt ends and finishes. Two
requests that share a system prompt of P tokens, or the same prompt sent twice (SGLang matches at most
its first S - 1 tokens), therefore found no snapshot at P, where upstream SGLang's radix cache serves
those P tokens from its tree. The request that reveals the branch (its match in SGLang's tree reaches
at least one ring, W_local tokens, past the deepest snapshot: a restore copies the ring, so a shorter
gain does not pay for the extra pass) pays one chunk boundary there.

=============================================  =================================================
where                                          what
=============================================  =================================================
``SnapshotRadixCache.match_prefix``            :func:`note_branch`: the request's branch depth
                                               (0: none)
``PrefillAdder.add_one_req`` (AROUND, through  :func:`add_one_req`: the adder's chunk budget is at
:mod:`~.prefill_guard`)                        most the branch depth less the matched prefix
``SnapshotRadixCache.cache_unfinished_req``    the chunk's end is snapshotted (as every chunk's)
=============================================  =================================================
"""

from __future__ import annotations

REQ_ATTR = "wgkv_branch_depth"


def note_branch(req, matched: int, snapshot_depth: int, window: int) -> None:
    """Record on ``req`` the depth its first chunk should end at: ``matched`` (SGLang's match) when
    it lies ``window`` (W_local) tokens or more past ``snapshot_depth``, else none."""
    if req is not None:
        setattr(req, REQ_ATTR, matched if matched - snapshot_depth >= window else 0)


def add_one_req(original, adder, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req``: SGLang's call with the chunk budget cut to end the
    request's chunk at its branch depth, when that comes before the budget would end it."""
    budget = adder.rem_chunk_tokens
    prefix = len(req.prefix_indices)
    cap = getattr(req, REQ_ATTR, 0) - prefix
    if budget is None or not 0 < cap < min(budget, len(req.full_untruncated_fill_ids) - prefix):
        return original(adder, req, *args, **kwargs)
    adder.rem_chunk_tokens = cap
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        adder.rem_chunk_tokens = budget - (cap - adder.rem_chunk_tokens)
