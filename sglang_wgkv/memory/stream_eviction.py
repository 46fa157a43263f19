"""Scoring and compaction of the over-budget streams (request slot, layer, KV head) that
:meth:`~sglang_wgkv.memory.evictor.SnapKVEvictor.maybe_evict` selected: SnapKV scores from the
observation window (:mod:`~sglang_wgkv.memory.snapkv_score`, or its Triton kernel), then the pool
compacts the survivors.
"""

import logging

import numpy as np
import torch

from sglang_wgkv.config import PAGE_SIZE
from sglang_wgkv.memory.kv_quant import gather
from sglang_wgkv.memory.snapkv_score import snapkv_scores

logger = logging.getLogger(__name__)


class StreamEviction:
    """Per-stream eviction of :class:`~sglang_wgkv.memory.evictor.SnapKVEvictor` (a mixin: the evictor
    owns ``pool``, the windows and kernels, ``ratio``, ``sm_scale``, ``max_score_elems``,
    ``triton_scores``, the query window and the counters)."""

    def _evict_streams(
        self, r: torch.Tensor, l: torch.Tensor, h: torch.Tensor, exact: np.ndarray, target: torch.Tensor
    ) -> None:
        """Evict from the streams ``(r[s], l[s], h[s])`` (all over budget), in chunks of streams, to at
        most ``target [S]`` entries (their slot's budget less its lead);
        ``exact [S]`` host bool: cut to the target exactly, scored by the prompt window (a prompt's end
        or an early compression), else the bottom-ratio rule scored by the decode window (split on the
        host: no device round trip)."""
        pool = self.pool
        freed = []
        for prompt in (True, False):
            idx = np.nonzero(exact == prompt)[0]
            if not idx.size:
                continue
            sel = torch.as_tensor(idx, device=pool.device)
            rs, ls, hs, ts = r[sel], l[sel], h[sel], target[sel]
            ng = int(pool.global_len[rs, ls, hs].max())
            window = self.prompt_window if prompt else self.window
            # the torch scores hold [chunk, window, G, keys] float32 logits; the kernel only the keys
            per_stream = (ng + pool.window) * (pool.head_dim if self.triton_scores else self.group * window)
            chunk = max(1, self.max_score_elems // per_stream)
            for s in range(0, rs.numel(), chunk):
                freed.append(
                    self._evict_chunk(
                        rs[s : s + chunk], ls[s : s + chunk], hs[s : s + chunk], ts[s : s + chunk], prompt
                    )
                )
        pool.release_pages(torch.cat(freed))
        self.stream_triggers[r, l, h] += 1

    def _window_queries(self, r: torch.Tensor, l: torch.Tensor, h: torch.Tensor, window: int):
        """The last ``window`` queries of streams ``(r[s], l[s], h[s])``: ``q [S, window, G, D]`` and
        their positions ``[S, window]`` (``-1``: empty)."""
        view = self.q_buf.view(*self.q_buf.shape[:3], self.pool.num_kv_heads, self.group, self.pool.head_dim)
        row = self.row[r]
        if window == self.window:
            return view[row, l, :, h], self.q_pos[row]
        pos = self.q_pos[row].amax(1, keepdim=True) - torch.arange(window - 1, -1, -1, device=r.device)
        slot = torch.remainder(pos, self.window)
        q_pos = torch.where(self.q_pos[row].gather(1, slot) == pos, pos, -1)
        return view[row[:, None], l[:, None], slot, h[:, None]], q_pos

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
        # a 1-D page index gathers whole pages (PyTorch's vectorized gather; a 2-D index takes the
        # element-wise kernel, over ten times slower on a GPU)
        g_keys = gather(pool.k_pages, gpages.reshape(-1)).reshape(r.numel(), gcols * PAGE_SIZE, D)
        r_keys = gather(pool.k_pages, pool.page_table[r, l, h, :R].reshape(-1).long()).reshape(
            r.numel(), W, D
        )
        n = torch.as_tensor(pool.cached_len, device=pool.device)[r]  # [S]
        slot = torch.arange(W, device=pool.device)
        r_pos = n[:, None] - 1 - torch.remainder(n[:, None] - 1 - slot, W)  # <0: empty slot
        q, q_pos = self._window_queries(r, l, h, self.prompt_window if prompt else self.window)
        kernel = self.prompt_kernel if prompt else self.kernel_size
        scores = None
        if self.triton_scores:
            from sglang_wgkv.memory.triton_snapkv import snapkv_scores_triton

            # the kernel reads an FP8 pool's stored keys and dequantizes them in registers
            k_scale = pool.k_scale[l] if pool.quantized else None
            keys = (g_keys, r_keys) if pool.quantized else (g_keys.to(q.dtype), r_keys.to(q.dtype))
            try:
                scores = snapkv_scores_triton(
                    q, q_pos, keys[0], glen, keys[1], r_pos, self.sm_scale, kernel, k_scale=k_scale
                )
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
        if (
            scores is None
        ):  # the reference reads dequantized keys (an FP8 pool's); compaction moves the stored ones
            g_vals, r_vals = pool.read_keys(g_keys, l, q.dtype), pool.read_keys(r_keys, l, q.dtype)
            scores = snapkv_scores(q, q_pos, g_vals, glen, r_vals, r_pos, self.sm_scale, kernel)
        return scores, glen, gpages, g_keys

    def _evict_chunk(self, r, l, h, target, exact: bool) -> torch.Tensor:
        """Score and select one chunk of streams (``exact``: cut to ``target [S]`` as scored by the
        prompt window; else the bottom-ratio rule, at least down to ``target``), then have the pool
        compact them; returns the page ids to release."""
        pool = self.pool
        scores, glen, gpages, g_keys = self.stream_scores(r, l, h, prompt=exact)
        S, Ng = scores.shape
        j = torch.arange(Ng, device=pool.device)
        valid = j[None, :] < glen[:, None]
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
