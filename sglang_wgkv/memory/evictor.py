"""SnapKV-style post-write eviction of the global cache under a per-head token budget (paper App. K.1).

Admission decides what enters the global cache; this evictor bounds what stays: every stream (request
slot r, layer l, KV head h) whose global length passes the budget loses its lowest-scored entries
(attention mass from the request's last ``window`` queries, max-pooled along the cache; the ring is
never evicted), and the pool compacts the survivors (:meth:`DualCachePool.compact_global`). A prompt
is scored once by its own end (``prompt_window`` queries, ``prompt_kernel``), not while it is
prefilled; ``prompt_cap`` bounds that deferral. ``lead`` amortizes the device looks: a look cuts
streams to ``budget - lead``. The scoring formula, the eviction rule, prompt-end scoring and the host
syncs are written out in docs/design.md ("The evictor").

Per-request bounds (:meth:`bound_request`): a request slot may carry its own budget, prompt cap and
lead (a request's ``kv_budget``, or what the physical pool leaves a request longer than it,
:mod:`sglang_wgkv.integration.scheduling.long_requests`); the others keep the server's (``budget`` None: not
bounded). With ``rows`` set, only bound slots get a query-window row (plus a scratch row that unbound
slots write into); ``rows`` None: one row per slot.

Call protocol (the attention backend; every call is cheap when nothing is evicted)::

    evictor.open_prompts(slots)       |
    evictor.maybe_evict()             | evictor.maybe_evict()     # the step boundary before it
    pool.begin_extend(...)            | pool.begin_decode(...)
    evictor.mark_extend(slots, ends)  |
    per layer: evictor.observe_extend |   per layer: evictor.observe_decode(layer, q)
               (layer, q)             |     (or the split kernel, into evictor.decode_window(layer))
    (a mixed forward, SGLang's --enable-mixed-chunk: the left column for its prefill rows, with
    pool.begin_mixed; its decode rows are observed as in the right column)
    ... forward ends ...
    evictor.maybe_evict()             # at a step boundary: after the last layer, or before the
                                      # next begin_* (outside a CUDA graph)

Every forward of a request must be observed in every layer (the window is a ring indexed by position).
The query window holds ``max_requests x layers x window x q_heads x head_dim`` elements of the pool
dtype, or ``rows`` (plus one) instead of ``max_requests``: without a server budget, give it a few rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sglang_wgkv.config import DEFAULT_EVICTOR_WINDOW, DEFAULT_PROMPT_KERNEL, DEFAULT_PROMPT_WINDOW
from sglang_wgkv.memory.dual_pool import DualCachePool
from sglang_wgkv.memory.host_copy import to_device
from sglang_wgkv.memory.observation_window import ObservationWindow
from sglang_wgkv.memory.stream_eviction import StreamEviction

logger = logging.getLogger(__name__)

# A slot's bound when it has none (no server budget, no request budget): never reached.
UNBOUNDED = np.iinfo(np.int64).max // 4


@dataclass
class SnapKVEvictor(ObservationWindow, StreamEviction):
    """Parameters
    ----------
    pool : the dual-cache pool whose global caches are bounded.
    budget : global tokens allowed per (request, layer, KV head) (``--kv-budget``); None: no server
        budget, only the slots bound by :meth:`bound_request` are evicted from.
    num_q_heads : query heads of the model (a multiple of the pool's KV heads).
    window : observation window W_obs, the last queries kept per (request, layer); at most W_local.
    kernel_size : max-pool kernel along the cache (odd).
    prompt_window, prompt_kernel : the window (the last queries, at most ``window``; None:
        ``min(DEFAULT_PROMPT_WINDOW, window)``) and kernel of the compressions to the budget at the end
        of a prompt (or early, past ``prompt_cap``).
    ratio : fraction of a stream's global cache evicted per trigger.
    sm_scale : softmax scale (default ``1/sqrt(head_dim)``).
    max_score_elems : bound on the elements scored at once: float32 attention scores (torch), or
        gathered keys (Triton); streams are scored in chunks below it.
    prompt_cap : global entries a stream may hold while its prompt is being prefilled (requests
        declared by :meth:`mark_extend`) before it is compressed early; None: no cap (compress only
        at the prompt's end).
    triton_scores : score with the Triton kernel (:mod:`~sglang_wgkv.memory.triton_snapkv`: the
        reference's result without its float32 logits; streams are then chunked by their gathered
        keys); None: on the pool's kernels path (``triton_decode`` on CUDA) when ``head_dim`` is a
        power of two >= 16.
    rows : query-window rows (None: one per request slot); see "Per-request bounds" above.
    """

    pool: DualCachePool
    budget: int | None
    num_q_heads: int
    window: int = DEFAULT_EVICTOR_WINDOW
    kernel_size: int = 5
    prompt_window: int | None = None
    prompt_kernel: int = DEFAULT_PROMPT_KERNEL
    ratio: float = 0.1
    sm_scale: float | None = None
    max_score_elems: int = 1 << 28
    prompt_cap: int | None = None
    lead: int = 0
    triton_scores: bool | None = None
    rows: int | None = None
    # Counters (read them with request_stats): per request slot, reset when the slot changes owner.
    triggers: np.ndarray = field(init=False)  # [R] maybe_evict calls that evicted from r
    evicted_tokens: np.ndarray = field(init=False)  # [R] global entries evicted from r
    stream_triggers: torch.Tensor = field(init=False)  # [R, L, H] evictions per stream
    checks: int = field(init=False, default=0)  # device looks (host bound exceeded)
    early_compressions: np.ndarray = field(init=False)  # [R] compressions before the prompt's end

    def __post_init__(self):
        pool = self.pool
        H = pool.num_kv_heads
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget must be positive, got {self.budget}")
        if self.rows is not None and self.rows < 1:
            raise ValueError(f"rows must be positive, got {self.rows}")
        if self.num_q_heads <= 0 or self.num_q_heads % H:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of {H} KV heads")
        if not 1 <= self.window <= pool.window:
            raise ValueError(
                f"window must be in [1, W_local={pool.window}], got {self.window}: global "
                "entries must precede every window query"
            )
        if self.prompt_window is None:
            self.prompt_window = min(DEFAULT_PROMPT_WINDOW, self.window)
        if not 1 <= self.prompt_window <= self.window:
            raise ValueError(f"prompt_window must be in [1, window={self.window}], got {self.prompt_window}")
        for name in ("kernel_size", "prompt_kernel"):
            if getattr(self, name) < 1 or getattr(self, name) % 2 == 0:
                raise ValueError(f"{name} must be odd and positive, got {getattr(self, name)}")
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio}")
        if not 0 <= self.lead < (self.budget or 1):
            raise ValueError(f"lead must be in [0, budget={self.budget}), got {self.lead}")
        if self.prompt_cap is not None and self.prompt_cap < (self.budget or UNBOUNDED):
            raise ValueError(f"prompt_cap {self.prompt_cap} is below the budget {self.budget}")
        if self.sm_scale is None:
            self.sm_scale = 1.0 / math.sqrt(pool.head_dim)
        if self.triton_scores is None:
            D = pool.head_dim
            self.triton_scores = (
                pool.triton_decode and pool.device.type == "cuda" and D >= 16 and not D & (D - 1)
            )
        R, L, dev = pool.max_requests, pool.num_layers, pool.device
        self.group = self.num_q_heads // H
        # window rows: one per slot (row r = slot r), or `rows` plus a scratch row (the last) that
        # the slots without one write into and nothing reads
        n_rows = R if self.rows is None else self.rows + 1
        self.q_buf = torch.zeros(
            n_rows, L, self.window, self.num_q_heads, pool.head_dim, dtype=pool.compute_dtype, device=dev
        )
        # Position of each window slot's query, shared by the layers: written once per forward
        # (all layers observe the same tokens), read only at step boundaries.
        self.q_pos = torch.full((n_rows, self.window), -1, dtype=torch.int64, device=dev)
        self.row = (  # [R] window row of each slot (device: indexed by the step's device rows)
            torch.arange(R, device=dev)
            if self.rows is None
            else torch.full((R,), self.rows, dtype=torch.int64, device=dev)
        )
        self._row_of = np.arange(R) if self.rows is None else np.full(R, -1, dtype=np.int64)
        self._free_rows = [] if self.rows is None else list(range(self.rows - 1, -1, -1))
        # per-slot bounds (bound_request): the server's unless a request sets its own
        server_cap = UNBOUNDED if self.prompt_cap is None else self.prompt_cap
        self._server = (self.budget or UNBOUNDED, server_cap, self.lead)
        self._budget, self._cap, self._lead = (np.full(R, v, dtype=np.int64) for v in self._server)
        # per-slot bounds of the request's global tokens summed over its streams (bound_request)
        self._tbudget = np.full(R, UNBOUNDED, dtype=np.int64)
        self._tcap = np.full(R, UNBOUNDED, dtype=np.int64)
        self._exact_total = np.zeros(R, dtype=np.int64)
        self.triggers = np.zeros(R, dtype=np.int64)
        self.evicted_tokens = np.zeros(R, dtype=np.int64)
        self.stream_triggers = torch.zeros(R, L, H, dtype=torch.int64, device=dev)
        self.early_compressions = np.zeros(R, dtype=np.int64)
        # Prompt state of slots declared by mark_extend: still prefilling (not evicted from, up to
        # prompt_cap), or prompt just ended (compressed exactly to the budget at the next boundary).
        self._prompt_open = np.zeros(R, dtype=bool)
        self._prompt_end = np.zeros(R, dtype=bool)
        self._generation = np.zeros(R, dtype=np.int64)
        # Host bound of max_{l,h} global_len[r]: exact_max + left_ring(now) - left_ring(at exact).
        self._exact_max = np.zeros(R, dtype=np.int64)
        self._left_at_exact = np.zeros(R, dtype=np.int64)
        self._triton_built = False  # the Triton score kernel has run once (later failures are raised)
        # (pool plan, index) per step kind: the extend plan's (req, src, slot) and the decode plan's
        # slots, each built once per plan (a mixed forward observes both in every layer)
        self._extend_idx = (None, None)
        self._decode_idx = (None, None)

    # -- per-slot state -------------------------------------------------------------------------
    def _refresh_slots(self) -> None:
        """Reset the state of slots the pool has handed to a new request since we last looked."""
        stale = np.nonzero(self._generation != self.pool.generation)[0]
        if stale.size == 0:
            return
        self._generation[stale] = self.pool.generation[stale]
        self.release_request(stale)
        self.triggers[stale] = 0
        self.evicted_tokens[stale] = 0
        self.early_compressions[stale] = 0
        self._prompt_open[stale] = False
        self._prompt_end[stale] = False
        self._exact_max[stale] = 0
        self._exact_total[stale] = 0
        self._left_at_exact[stale] = 0
        idx = to_device(self.pool.device, stale)
        if self.rows is None:
            self.q_pos.index_fill_(0, idx, -1)
        self.stream_triggers.index_fill_(0, idx, 0)

    @property
    def identity_rows(self) -> bool:
        """Window row = request slot (``rows`` None): what the decode kernel's observation writes."""
        return self.rows is None

    def free_rows(self) -> int:
        """Window rows no bound slot holds (request slots, without ``rows``)."""
        return self.pool.max_requests if self.rows is None else len(self._free_rows)

    def bound_request(
        self,
        slot: int,
        budget: int | None,
        cap: int | None = None,
        lead: int = 0,
        total_budget: int | None = None,
        total_cap: int | None = None,
    ) -> None:
        """Bound request slot ``slot`` (just allocated to a request) by its own ``budget`` global
        tokens per stream, ``cap`` while its prompt is prefilled (default: the budget) and ``lead``,
        and/or by ``total_budget`` / ``total_cap`` global tokens summed over its streams (the streams
        holding the most are cut to a common level, the others untouched; ``lead`` per stream);
        gives it a window row. RuntimeError when no row is free (the scheduler checks
        :meth:`free_rows` before it admits such a request)."""
        self._refresh_slots()
        budget = UNBOUNDED if budget is None else budget
        cap = budget if cap is None else cap
        total_budget = UNBOUNDED if total_budget is None else total_budget
        total_cap = total_budget if total_cap is None else total_cap
        if not 0 <= lead < min(budget, total_budget) or budget > cap or total_budget > total_cap:
            raise ValueError(
                f"bound needs 0 <= lead < budget <= cap, got {lead}, {budget}, {cap}, {total_budget}, {total_cap}"
            )
        if self._row_of[slot] < 0:
            if not self._free_rows:
                raise RuntimeError(f"SnapKV: no free query-window row for request slot {slot}")
            row = self._free_rows.pop()
            self._row_of[slot] = row
            self.row.narrow(0, slot, 1).fill_(row)  # not `row[slot] = row`: a host scalar copy syncs
            self.q_pos[row] = -1
        self._budget[slot], self._cap[slot], self._lead[slot] = budget, cap, lead
        self._tbudget[slot], self._tcap[slot] = total_budget, total_cap

    def release_request(self, slots) -> None:
        """Give the slots' window rows back and their bounds back to the server's (a slot's owner
        changes or leaves; idempotent)."""
        slots = np.atleast_1d(np.asarray(slots, dtype=np.int64))
        budget, cap, lead = self._server
        self._budget[slots], self._cap[slots], self._lead[slots] = budget, cap, lead
        self._tbudget[slots], self._tcap[slots] = UNBOUNDED, UNBOUNDED
        if self.rows is None:
            return
        held = slots[self._row_of[slots] >= 0]
        if held.size:
            self._free_rows.extend(self._row_of[held].tolist())
            self._row_of[held] = -1
            self.row.index_fill_(0, to_device(self.pool.device, held), self.rows)  # `row[idx] = n` syncs

    def _total_bounds(self) -> np.ndarray:
        """``[R]`` host upper bound of each slot's global tokens summed over its streams (no sync)."""
        streams = self.pool.num_layers * self.pool.num_kv_heads
        return self._exact_total + (self._left_ring() - self._left_at_exact) * streams

    def _total_limits(self, cut: bool = False) -> np.ndarray:
        """``[R]`` :meth:`_limits` of the summed bounds (the lead counts once per stream)."""
        streams = self.pool.num_layers * self.pool.num_kv_heads
        lead = self._lead * streams if cut else 0
        return np.where(self._prompt_open, self._tcap, self._tbudget - lead)

    def request_bound(self, slot: int) -> int | None:
        """The budget slot ``slot`` is held to (its own or the server's), None when unbounded."""
        self._refresh_slots()
        budget = int(self._budget[slot])
        return None if budget >= UNBOUNDED else budget

    def _left_ring(self) -> np.ndarray:
        """``[R]`` tokens that have left each request's ring (host; bounds its global lengths)."""
        return np.maximum(self.pool.cached_len - self.pool.window, 0)

    # -- observation ----------------------------------------------------------------------------
    def mark_extend(self, req_slots, prompt_ends) -> None:
        """Declare the requests of the current extend: ``prompt_ends[b]`` True when this extend
        writes the last token of request ``req_slots[b]``'s prompt (it is then compressed to the
        budget at the next step boundary), False while its prompt is still being prefilled."""
        self._refresh_slots()
        slots = np.asarray(list(req_slots), dtype=np.int64)
        ends = np.asarray(list(prompt_ends), dtype=bool)
        if slots.shape != ends.shape:
            raise ValueError(f"{slots.size} request slots, {ends.size} prompt-end flags")
        self._prompt_open[slots] = ~ends
        self._prompt_end[slots] = ends

    def open_prompts(self, req_slots) -> None:
        """Declare, before the step boundary ahead of an extend, that requests ``req_slots`` are
        prefilling their prompt: that boundary caps them at ``prompt_cap`` (as :meth:`mark_extend`'s
        open prompts) instead of evicting them as decoding requests. A slot handed to a new request
        can hold a global cache before its first forward (a prefix restored from the radix cache):
        undeclared at that boundary, it would be cut to the budget by the decode rule, scored by no
        query of its own, before its prompt-end compression (``tests/test_evictor_serving.py``)."""
        slots = list(req_slots)
        self.mark_extend(slots, [False] * len(slots))

    # -- eviction -------------------------------------------------------------------------------
    def over_budget_candidates(self) -> np.ndarray:
        """Active request slots whose host bound of the longest global cache exceeds their limit:
        the budget, or ``prompt_cap`` while their prompt is being prefilled."""
        return np.nonzero(self.pool.active & (self._bounds() > self._limits()))[0]

    def _bounds(self) -> np.ndarray:
        """``[R]`` host upper bound of each slot's longest global cache (no sync)."""
        self._refresh_slots()
        return self._exact_max + self._left_ring() - self._left_at_exact

    def _limits(self, cut: bool = False) -> np.ndarray:
        """``[R]`` the global length each slot's streams may keep at this step boundary; with
        ``cut``, what they are cut to once looked at (their lead under the budget; prompt caps as is)."""
        return np.where(self._prompt_open, self._cap, self._budget - (self._lead if cut else 0))

    def maybe_evict(self) -> int:
        """Enforce the budget on every active request; call at a step boundary. Returns the number
        of streams evicted from (0 without touching the device when no bound exceeds its limit)."""
        bound, active, total = self._bounds(), self.pool.active, self._total_bounds()
        if not (active & ((bound > self._limits()) | (total > self._total_limits()))).any():
            self._prompt_end[:] = False
            return 0
        # A look serves every request within `lead` of its limit, not only the one that forced it:
        # after it no bound is above budget - lead, so the next look is at least lead + 1 steps away.
        cut, total_cut = self._limits(cut=True), self._total_limits(cut=True)
        cand = np.nonzero(active & ((bound > cut) | (total > total_cut)))[0]
        self.checks += 1
        pool = self.pool
        req = torch.as_tensor(cand, device=pool.device)
        glen = pool.global_len[req].long()  # [C, L, H]
        level = self._levels(cand, glen, total_cut[cand])  # [C] common level of a summed bound
        dev = lambda a: torch.as_tensor(a, device=pool.device)[:, None, None]
        trigger, level = dev(cut[cand]), dev(level)
        over_mask = glen > torch.minimum(trigger, level)
        over = torch.nonzero(over_mask)  # [S, 3] (syncs)
        if over.numel():
            rows = over[:, 0].cpu().numpy()
            exact = self._prompt_end[cand] | self._prompt_open[cand]  # [C] compress to budget
            own = dev((self._budget - self._lead)[cand])  # a stream's own target
            target = torch.where(glen > trigger, torch.minimum(own, level), level)[over_mask]
            self._evict_streams(req[over[:, 0]], over[:, 1], over[:, 2], exact[rows], target)
            hit = np.unique(cand[rows])
            self.triggers[hit] += 1
            early = hit[self._prompt_open[hit]]
            for r in early[self.early_compressions[early] == 0]:
                per_head = self._cap[r] < UNBOUNDED
                logger.warning(
                    "SnapKV: request slot %d passed %d global tokens %s before the end of its "
                    "prompt; compressed early to the budget %d, scored by the latest chunk",
                    r,
                    self._cap[r] if per_head else self._tcap[r],
                    "per head" if per_head else "(all layers and heads)",
                    self._budget[r] if per_head else self._tbudget[r],
                )
            self.early_compressions[early] += 1
        after = pool.global_len[req].flatten(1).long()
        self._exact_max[cand] = after.amax(1).cpu().numpy()
        self._exact_total[cand] = after.sum(1).cpu().numpy()
        self._left_at_exact[cand] = self._left_ring()[cand]
        self._prompt_end[:] = False
        return int(over.shape[0])

    def _levels(self, cand: np.ndarray, glen: torch.Tensor, total_cut: np.ndarray) -> np.ndarray:
        """``[C]`` per candidate, the highest level ``c`` at which cutting its streams to ``c`` brings
        their sum within its summed target (:data:`UNBOUNDED` where the sum is within its limit)."""
        levels = np.full(len(cand), UNBOUNDED, dtype=np.int64)
        bounded = np.nonzero(self._tbudget[cand] < UNBOUNDED)[0]
        if not bounded.size:
            return levels
        g = glen[torch.as_tensor(bounded, device=glen.device)].flatten(1).cpu().numpy()  # [B, L*H]
        streams = g.shape[1]
        targets = self._tbudget[cand[bounded]] - self._lead[cand[bounded]] * streams
        for i, (row, limit, target) in enumerate(zip(g, total_cut[bounded], targets)):
            if row.sum() <= limit:
                continue
            lo, hi = 0, int(row.max())  # sum(min(row, lo)) <= target < sum(min(row, hi + 1))
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if np.minimum(row, mid).sum() <= target else (lo, mid - 1)
            levels[bounded[i]] = lo
        return levels

    # -- reporting ------------------------------------------------------------------------------
    def request_counters(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per slot, on the host (no sync): eviction triggers, evicted tokens, early prompt compressions."""
        self._refresh_slots()
        return self.triggers, self.evicted_tokens, self.early_compressions

    def request_stats(self, r: int) -> dict:
        """Eviction counters and cache sizes of slot ``r`` (syncs; read before the slot is freed)."""
        self._refresh_slots()
        return {
            **self.pool.request_cache_sizes(r),
            "eviction_triggers": int(self.triggers[r]),
            "evicted_tokens": int(self.evicted_tokens[r]),
            "stream_eviction_triggers": int(self.stream_triggers[r].sum()),
            "max_stream_eviction_triggers": int(self.stream_triggers[r].max()),
            "early_prompt_compressions": int(self.early_compressions[r]),
        }
