"""The SnapKV evictor's observation window: the last ``window`` queries of each request and layer,
recorded per forward (a ring indexed by position), that :class:`~sglang_wgkv.memory.evictor.SnapKVEvictor`
scores the global cache with.
"""

import numpy as np
import torch

from sglang_wgkv.memory.host_copy import to_device_many


class ObservationWindow:
    """Query recording of :class:`~sglang_wgkv.memory.evictor.SnapKVEvictor` (a mixin: the evictor owns
    ``pool``, ``window``, ``row``, ``q_buf`` ``[rows, L, window, Hq, D]``, ``q_pos`` ``[rows, window]``,
    ``identity_rows`` and the cached plan indices ``_extend_idx`` / ``_decode_idx``)."""

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
            row = self.row[req]
            self.q_pos[row, pos % self.window] = pos
            self._extend_idx = (plan, (row, src, pos % self.window))
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
        return tuple(to_device_many(self.pool.device, [(x, np.int64) for x in (req, src, pos)]))

    def observe_decode(self, layer: int, q: torch.Tensor) -> None:
        """Record the queries ``[B, Hq, D]`` of the pool's current decode step for ``layer`` (no sync).
        Under CUDA graphs the split kernel records them instead (:meth:`decode_window`)."""
        plan = self.pool._decode
        if plan is None:
            raise RuntimeError("observe_decode without pool.begin_decode")
        if self._decode_idx[0] is not plan:
            row, slot = self.row[plan.req], plan.pos % self.window
            self.q_pos[row, slot] = plan.pos
            self._decode_idx = (plan, (row, slot))
        row, slot = self._decode_idx[1]
        self.q_buf[row, layer, slot] = q.to(self.q_buf.dtype)

    def decode_window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The window buffers the decode kernel writes in place of :meth:`observe_decode` (device
        indexing only, so it can be captured; a graph's padded rows point at a slot no request owns):
        ``layer``'s queries ``[N, window, Hq, D]``, the positions ``[N, window]`` (shared by the
        layers) and the window row of each request slot ``[R]`` (None with one row per slot,
        :attr:`identity_rows`; unbound slots point at the scratch row nothing reads). Row b of a step
        goes to slot ``pos[b] % window`` of its request's row, as there."""
        return self.q_buf[:, layer], self.q_pos, None if self.identity_rows else self.row
