"""SnapKV-style post-write eviction of the global cache under a per-head token budget (paper App. K.1).

Admission (the write gate) decides what enters the global cache; this evictor bounds what stays.
Per stream (request slot r, layer l, KV head h) with global length ``g > budget``:

1. score every global entry j against the request's last ``window`` (256) queries of layer l::

       A(q) = softmax_keys(q K^T / sqrt(d))            for each query head q of h's GQA group
       raw_j = sum_{window i} max_{q in group} A_{i,j}(q)
       score = MaxPool1d(raw, kernel 5, stride 1, same padding) along the global cache order

   The softmax normalizes over the keys attention read for that query, restricted to what is still
   cached: every global entry of the stream (each one precedes every window query, because the
   window is no longer than W_local and global entries left the ring) plus the ring entries at
   positions ``<= pos_i``. Keys evicted earlier, or dropped unadmitted from the ring, are gone and
   take no mass. Max-pooling runs over cache order; after earlier evictions neighbours in the cache
   need not be neighbours in position.
2. evict the ``max(floor(ratio * g), 1, g - T)`` lowest-scored entries, ``T = budget - lead``
   (ratio 0.1: the paper's "bottom 10%"; the ``g - T`` term only matters after an extend admitted
   many tokens at once, so the budget holds after every step), ties going to the older entry; at
   the end of a prompt (below) exactly ``g - T``, scored by the prompt's last ``prompt_window``
   queries (32) and max-pooled over ``prompt_kernel`` (13);
3. the pool compacts the survivors in order to the front of the stream's global pages
   (:meth:`DualCachePool.compact_global`: now-empty trailing pages released, pages shared with
   another owner, e.g. a prefix snapshot, copied before being rewritten).

The ring (the last W_local tokens) is never evicted, so a stream holds at most ``budget + W_local``
tokens. ``--kv-budget N`` is the paper's "average global tokens per head per request" (4096 in
App. K); it is enforced as a cap of N on every (layer, head), which implies the average and is
stricter than it: the paper triggers when the average exceeds N, so single heads may pass N there.
Counters: a request's ``eviction_triggers`` counts the steps in which any of its streams was
evicted from; ``stream_triggers`` counts per stream.

Prompt-end scoring (SnapKV's observation window). A prompt is scored by its own end, the part that
holds the question, not by whichever chunk of it is being prefilled: once the backend declares the
requests of an extend with :meth:`mark_extend`, a request whose prompt is still being prefilled is
not evicted from (its global cache grows with the admitted part of the prompt), and at the first
step boundary after its last prompt chunk each of its streams is compressed to exactly ``budget``
entries, scored by the prompt's last ``prompt_window`` queries (kept across chunks: the window is a
ring indexed by position; SnapKV's 32 queries, not the decode window: scored by the last 256, the
few queries of the question drown among the haystack's and needles are lost; see config.py).
From then on (decode) the bottom-10% rule above applies. ``prompt_cap`` bounds
the deferral: a stream that passes ``prompt_cap`` global entries while its prompt is still open is
compressed to ``budget`` early, scored by the latest chunk's last queries (logged once per request), so a
request's pages stay within ``W_local + prompt_cap`` plus one extend per stream. Requests never
declared (``mark_extend`` not called) are evicted at every step boundary, prompt or not.

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
Memory: the query window holds ``max_requests x layers x window x q_heads x head_dim`` elements of the
pool dtype (Qwen3-4B, 64 request slots, window 256: 4.8 GB in bf16); create an evictor only when a
budget is set.

Host syncs: observing never syncs. :meth:`maybe_evict` keeps a host upper bound of each request's
longest global cache (the last exact value plus the tokens that left the ring since, known from the
pool's host lengths) and looks at the device only when some request's bound exceeds the budget;
evicting syncs. ``lead`` (default 0) amortizes the looks: a look takes every active request whose
bound is above ``T = budget - lead`` and evicts from each of its streams longer than ``T`` (rule 2),
so afterwards no bound is above ``T`` and, since a bound grows by at most one token per step, the next
look is at least ``lead + 1`` steps away, for all requests at once. The cap still holds after every
step; a stream is cut up to ``lead`` tokens under the budget. Serving sets ``lead`` (one look and one
host sync per ~``lead`` decode steps instead of nearly every step once streams sit at the budget).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from sglang_wgkv.config import DEFAULT_EVICTOR_WINDOW, DEFAULT_PROMPT_KERNEL, DEFAULT_PROMPT_WINDOW, PAGE_SIZE
from sglang_wgkv.memory.dual_pool import DualCachePool
from sglang_wgkv.memory.snapkv_score import snapkv_scores

logger = logging.getLogger(__name__)


@dataclass
class SnapKVEvictor:
    """Parameters
    ----------
    pool : the dual-cache pool whose global caches are bounded.
    budget : global tokens allowed per (request, layer, KV head) (``--kv-budget``).
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
    """

    pool: DualCachePool
    budget: int
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
    # Counters (read them with request_stats): per request slot, reset when the slot changes owner.
    triggers: np.ndarray = field(init=False)  # [R] maybe_evict calls that evicted from r
    evicted_tokens: np.ndarray = field(init=False)  # [R] global entries evicted from r
    stream_triggers: torch.Tensor = field(init=False)  # [R, L, H] evictions per stream
    checks: int = field(init=False, default=0)  # device looks (host bound exceeded)
    early_compressions: np.ndarray = field(init=False)  # [R] compressions before the prompt's end

    def __post_init__(self):
        pool = self.pool
        H = pool.num_kv_heads
        if self.budget < 1:
            raise ValueError(f"budget must be positive, got {self.budget}")
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
        if not 0 <= self.lead < self.budget:
            raise ValueError(f"lead must be in [0, budget={self.budget}), got {self.lead}")
        if self.prompt_cap is not None and self.prompt_cap < self.budget:
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
        self.q_buf = torch.zeros(
            R, L, self.window, self.num_q_heads, pool.head_dim, dtype=pool.dtype, device=dev
        )
        # Position of each window slot's query, shared by the layers: written once per forward
        # (all layers observe the same tokens), read only at step boundaries.
        self.q_pos = torch.full((R, self.window), -1, dtype=torch.int64, device=dev)
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
        self.triggers[stale] = 0
        self.evicted_tokens[stale] = 0
        self.early_compressions[stale] = 0
        self._prompt_open[stale] = False
        self._prompt_end[stale] = False
        self._exact_max[stale] = 0
        self._left_at_exact[stale] = 0
        idx = torch.as_tensor(stale, device=self.pool.device)
        self.q_pos.index_fill_(0, idx, -1)
        self.stream_triggers.index_fill_(0, idx, 0)

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
        undeclared at that boundary, it was cut to the budget by the decode rule, scored by no query
        of its own, and its prompt-end compression came second (seen on the H200, 2026-12-03)."""
        slots = list(req_slots)
        self.mark_extend(slots, [False] * len(slots))

    def observe_extend(self, layer: int, q: torch.Tensor) -> None:
        """Record the queries of the pool's current extend for ``layer``.

        q : ``[N, Hq, D]`` packed like the ``k`` given to :meth:`DualCachePool.write_extend`
        (post-RoPE, as attention uses them). Only each request's last ``window`` tokens are kept.
        """
        plan = self.pool._extend
        if plan is None:
            raise RuntimeError("observe_extend without pool.begin_extend")
        if self._extend_idx[0] is not plan:
            self._refresh_slots()
            req, src, pos = self._extend_index(plan)
            self.q_pos[req, pos % self.window] = pos
            self._extend_idx = (plan, (req, src, pos % self.window))
        req, src, slot = self._extend_idx[1]
        if src.numel():
            self.q_buf[req, layer, slot] = q[src].to(self.q_buf.dtype)

    def _extend_index(self, plan):
        """``(req, src, pos)`` of each request's last ``window`` new tokens (packed index ``src``)."""
        req, src, pos = [], [], []
        off = 0
        for r, S, n in zip(plan.req_slots, plan.prefix_lens, plan.extend_lens):
            t = np.arange(max(0, n - self.window), n)
            req.append(np.full(t.size, r))
            src.append(off + t)
            pos.append(S + t)
            off += n
        dev = self.pool.device
        return tuple(
            torch.as_tensor(np.concatenate(x), dtype=torch.int64, device=dev) for x in (req, src, pos)
        )

    def observe_decode(self, layer: int, q: torch.Tensor) -> None:
        """Record the queries ``[B, Hq, D]`` of the pool's current decode step for ``layer`` (no sync).
        Under CUDA graphs the split kernel records them instead (:meth:`decode_window`)."""
        plan = self.pool._decode
        if plan is None:
            raise RuntimeError("observe_decode without pool.begin_decode")
        if self._decode_idx[0] is not plan:
            slot = plan.pos % self.window
            self.q_pos[plan.req, slot] = plan.pos
            self._decode_idx = (plan, slot)
        self.q_buf[plan.req, layer, self._decode_idx[1]] = q.to(self.q_buf.dtype)

    def decode_window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window buffers the decode kernel writes in place of :meth:`observe_decode` (device
        indexing only, so it can be captured; a graph's padded rows point at a slot no request owns):
        ``layer``'s queries ``[R, window, Hq, D]`` and the positions ``[R, window]`` (shared by the
        layers). Row b of a step goes to slot ``pos[b] % window`` of ``req[b]``, as there."""
        return self.q_buf[:, layer], self.q_pos

    # -- eviction -------------------------------------------------------------------------------
    def over_budget_candidates(self) -> np.ndarray:
        """Active request slots whose host bound of the longest global cache exceeds their limit:
        the budget, or ``prompt_cap`` while their prompt is being prefilled."""
        return np.nonzero(self.pool.active & (self._bounds() > self._limits()))[0]

    def _bounds(self) -> np.ndarray:
        """``[R]`` host upper bound of each slot's longest global cache (no sync)."""
        self._refresh_slots()
        return self._exact_max + self._left_ring() - self._left_at_exact

    def _limits(self, lead: int = 0) -> np.ndarray:
        """``[R]`` the global length each slot's streams may keep at this step boundary; with
        ``lead``, what they are cut to once looked at (``lead`` under the budget; prompt caps as is)."""
        open_cap = np.iinfo(np.int64).max if self.prompt_cap is None else self.prompt_cap
        return np.where(self._prompt_open, open_cap, self.budget - lead)

    def maybe_evict(self) -> int:
        """Enforce the budget on every active request; call at a step boundary. Returns the number
        of streams evicted from (0 without touching the device when no bound exceeds its limit)."""
        bound, active = self._bounds(), self.pool.active
        if not (active & (bound > self._limits())).any():
            self._prompt_end[:] = False
            return 0
        # A look serves every request within `lead` of its limit, not only the one that forced it:
        # after it no bound is above budget - lead, so the next look is at least lead + 1 steps away.
        cut = self._limits(self.lead)
        cand = np.nonzero(active & (bound > cut))[0]
        self.checks += 1
        pool = self.pool
        req = torch.as_tensor(cand, device=pool.device)
        glen = pool.global_len[req].long()  # [C, L, H]
        limit = torch.as_tensor(cut[cand], device=pool.device)
        over = torch.nonzero(glen > limit[:, None, None])  # [S, 3] (syncs)
        if over.numel():
            rows = over[:, 0].cpu().numpy()
            exact = self._prompt_end[cand] | self._prompt_open[cand]  # [C] compress to budget
            self._evict_streams(req[over[:, 0]], over[:, 1], over[:, 2], exact[rows])
            hit = np.unique(cand[rows])
            self.triggers[hit] += 1
            early = hit[self._prompt_open[hit]]
            for r in early[self.early_compressions[early] == 0]:
                logger.warning(
                    "SnapKV: request slot %d passed %d global tokens per head before the end of its "
                    "prompt; compressed early to the budget %d, scored by the latest chunk",
                    r,
                    self.prompt_cap,
                    self.budget,
                )
            self.early_compressions[early] += 1
        self._exact_max[cand] = pool.global_len[req].flatten(1).amax(1).cpu().numpy()
        self._left_at_exact[cand] = self._left_ring()[cand]
        self._prompt_end[:] = False
        return int(over.shape[0])

    def _evict_streams(self, r: torch.Tensor, l: torch.Tensor, h: torch.Tensor, exact: np.ndarray) -> None:
        """Evict from the streams ``(r[s], l[s], h[s])`` (all over budget), in chunks of streams;
        ``exact [S]`` host bool: cut to the budget exactly, scored by the prompt window (a prompt's end
        or an early compression), else the bottom-ratio rule scored by the decode window (split on the
        host: no device round trip)."""
        pool = self.pool
        freed = []
        for prompt in (True, False):
            idx = np.nonzero(exact == prompt)[0]
            if not idx.size:
                continue
            sel = torch.as_tensor(idx, device=pool.device)
            rs, ls, hs = r[sel], l[sel], h[sel]
            ng = int(pool.global_len[rs, ls, hs].max())
            window = self.prompt_window if prompt else self.window
            # the torch scores hold [chunk, window, G, keys] float32 logits; the kernel only the keys
            per_stream = (ng + pool.window) * (pool.head_dim if self.triton_scores else self.group * window)
            chunk = max(1, self.max_score_elems // per_stream)
            for s in range(0, rs.numel(), chunk):
                freed.append(
                    self._evict_chunk(rs[s : s + chunk], ls[s : s + chunk], hs[s : s + chunk], prompt)
                )
        pool.release_pages(torch.cat(freed))
        self.stream_triggers[r, l, h] += 1

    def _window_queries(self, r: torch.Tensor, l: torch.Tensor, h: torch.Tensor, window: int):
        """The last ``window`` queries of streams ``(r[s], l[s], h[s])``: ``q [S, window, G, D]`` and
        their positions ``[S, window]`` (``-1``: empty)."""
        view = self.q_buf.view(*self.q_buf.shape[:3], self.pool.num_kv_heads, self.group, self.pool.head_dim)
        if window == self.window:
            return view[r, l, :, h], self.q_pos[r]
        pos = self.q_pos[r].amax(1, keepdim=True) - torch.arange(window - 1, -1, -1, device=r.device)
        slot = torch.remainder(pos, self.window)
        q_pos = torch.where(self.q_pos[r].gather(1, slot) == pos, pos, -1)
        return view[r[:, None], l[:, None], slot, h[:, None]], q_pos

    def stream_scores(self, r: torch.Tensor, l: torch.Tensor, h: torch.Tensor, prompt: bool = False):
        """Scores of the global entries of streams ``(r[s], l[s], h[s])``: by the decode window and
        kernel or, with ``prompt``, by the prompt window and kernel.

        Returns ``scores [S, Ng]`` (float32; ``-inf`` past each stream's length), ``glen [S]``,
        the global pages ``[S, Ng / 16]`` and the gathered global keys ``[S, Ng, D]``.
        """
        pool = self.pool
        W, D = pool.window, pool.head_dim
        R = pool.ring_cols
        glen = pool.global_len[r, l, h].long()
        gcols = -(-int(glen.max()) // PAGE_SIZE)
        gpages = pool.page_table[r, l, h, R : R + gcols].long()  # [S, gc]
        # a 1-D page index gathers whole pages (PyTorch's vectorized gather; a 2-D index took the
        # element-wise kernel on the H200: 2.4 ms against 0.19 ms for a quarter of the bytes)
        g_keys = pool.k_pages[gpages.reshape(-1)].reshape(r.numel(), gcols * PAGE_SIZE, D)
        r_keys = pool.k_pages[pool.page_table[r, l, h, :R].reshape(-1).long()].reshape(r.numel(), W, D)
        n = torch.as_tensor(pool.cached_len, device=pool.device)[r]  # [S]
        slot = torch.arange(W, device=pool.device)
        r_pos = n[:, None] - 1 - torch.remainder(n[:, None] - 1 - slot, W)  # <0: empty slot
        q, q_pos = self._window_queries(r, l, h, self.prompt_window if prompt else self.window)
        kernel = self.prompt_kernel if prompt else self.kernel_size
        scores = None
        if self.triton_scores:
            from sglang_wgkv.memory.triton_snapkv import snapkv_scores_triton

            try:
                scores = snapkv_scores_triton(q, q_pos, g_keys, glen, r_keys, r_pos, self.sm_scale, kernel)
                self._triton_built = True
            except Exception as exc:  # a kernel Triton cannot build here: the reference, for good
                if self._triton_built:
                    raise  # it ran before: not a build failure
                logger.warning(
                    "SnapKV: the Triton score kernel failed (%s: %s); scoring with torch",
                    type(exc).__name__,
                    exc,
                )
                self.triton_scores = False
        if scores is None:
            scores = snapkv_scores(q, q_pos, g_keys, glen, r_keys, r_pos, self.sm_scale, kernel)
        return scores, glen, gpages, g_keys

    def _evict_chunk(self, r, l, h, exact: bool) -> torch.Tensor:
        """Score and select one chunk of streams (``exact``: cut to ``budget - lead`` as scored by the
        prompt window; else the bottom-ratio rule), then have the pool compact them; returns the page
        ids to release."""
        pool = self.pool
        scores, glen, gpages, g_keys = self.stream_scores(r, l, h, prompt=exact)
        S, Ng = scores.shape
        j = torch.arange(Ng, device=pool.device)
        valid = j[None, :] < glen[:, None]
        target = self.budget - self.lead
        if exact:
            n_evict = glen - target
        else:
            n_evict = torch.maximum(torch.clamp((glen.double() * self.ratio).long(), min=1), glen - target)
        order = torch.argsort(scores.masked_fill(~valid, float("inf")), dim=1, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, j.expand(S, Ng).contiguous())
        keep = valid & (rank >= n_evict[:, None])
        freed = pool.compact_global(r, l, h, keep, gpages=gpages, g_keys=g_keys)
        evicted = np.bincount(r.cpu().numpy(), weights=n_evict.cpu().numpy(), minlength=pool.max_requests)
        self.evicted_tokens += evicted.astype(np.int64)
        return freed

    # -- reporting ------------------------------------------------------------------------------
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
