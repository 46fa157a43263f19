"""An extend forward's pool writes, staged per layer and written for several layers at once.

:meth:`~sglang_wgkv.memory.extend_step.ExtendStep.write_extend` costs a fixed run of small index ops
per layer (ring flags, per-stream ranks, page allocation, the row moves), whatever the chunk holds:
for a chunk of a few thousand tokens that host time exceeded the layer's GPU time. A layer's write
is needed by no later layer of the same forward (each layer reads only its own pages, and only its
cached context, before the write), so the rows are staged and written by
:meth:`~sglang_wgkv.memory.extend_step.ExtendStep.write_extend_layers`, which runs the same ops once
over a group of consecutive layers.

==========================  ==============================================================
invariant                   why
==========================  ==============================================================
layers staged in order      a group is ``first .. first + G - 1``; a gap or repeat raises
a group's K/V within        staged rows are transient GPU memory beside the forward's own
``budget_bytes``            activations (one layer is always allowed)
the last layer closes its   the pool is complete when the forward ends: the next forward,
group                       the evictor and prefix snapshots read it
==========================  ==============================================================
"""

from __future__ import annotations

import math

import torch

from sglang_wgkv.memory.wide_copy import wide_copy_

# Staged K/V per group at most: 8 layers of an 8K-token chunk of a Llama-3.1-8B shape (8 KV heads
# of 128), all 32 layers of a 2K-token one.
DEFAULT_BUDGET_BYTES = 256 << 20


class ExtendWrites:
    """Stages :meth:`stage` calls (one per layer, in order) and writes each full group to ``pool``.

    pool : a :class:`~sglang_wgkv.memory.dual_pool.DualCachePool` with a live extend plan.
    budget_bytes : staged K/V bytes per group (at least one layer is always staged).
    keep : keep the staging buffers between forwards (None: on CUDA, where a new size would allocate).
    """

    def __init__(self, pool, budget_bytes: int = DEFAULT_BUDGET_BYTES, keep: bool | None = None):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.pool = pool
        self.budget_bytes = budget_bytes
        self._first: int | None = None
        self._k: torch.Tensor | None = None  # [G, N, H, D] staging of the open group
        self._v: torch.Tensor | None = None
        self._admit: torch.Tensor | None = None  # [G, N, H]
        self._staged = 0
        self.groups_written = 0
        # CUDA: the staging kept between forwards (grown, never shrunk), so that a forward of a new
        # size allocates nothing: a new size's cudaMalloc stalled the host in layer 0 of the M1D pass
        # (launch/results/served_speed/M1D_M1P_h100_knee4, host_waits)
        self._kept: dict[str, torch.Tensor] = {}
        self.keep = keep

    def group_layers(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Layers per group for rows shaped like ``k``, ``v`` ``[N, H, D]``."""
        per_layer = k.numel() * k.element_size() + v.numel() * v.element_size()
        return max(1, min(self.pool.num_layers, self.budget_bytes // max(per_layer, 1)))

    def stage(self, layer: int, k: torch.Tensor, v: torch.Tensor, admit: torch.Tensor) -> None:
        """Layer ``layer``'s new rows (k, v ``[N, H, D]``, admit ``[N, H]`` bool), after its attention
        read its context; written when its group is full or ``layer`` is the last."""
        L = self.pool.num_layers
        if self._first is None:
            group = min(self.group_layers(k, v), L - layer)
            self._k, self._v, self._admit = (
                self._staging(name, x, group) for name, x in (("k", k), ("v", v), ("admit", admit))
            )
            self._first, self._staged = layer, 0
        if layer != self._first + self._staged:
            raise RuntimeError(
                f"extend writes staged out of order: layer {layer} after layers "
                f"{self._first}..{self._first + self._staged - 1}"
            )
        i = self._staged
        wide_copy_(self._k[i], k)
        wide_copy_(self._v[i], v)
        self._admit[i].copy_(admit)
        self._staged += 1
        if self._staged == self._k.shape[0] or layer == L - 1:
            self.flush()

    def _staging(self, name: str, like: torch.Tensor, group: int) -> torch.Tensor:
        """``[group, *like.shape]`` of ``like``'s dtype: a view of the kept buffer (the next group's
        staging is written after this one's write in stream order), or new when not keeping."""
        shape = (group, *like.shape)
        if not (like.device.type == "cuda" if self.keep is None else self.keep):
            return like.new_empty(shape)
        n = math.prod(shape)
        kept = self._kept.get(name)
        if kept is None or kept.numel() < n or kept.dtype != like.dtype or kept.device != like.device:
            kept = self._kept[name] = like.new_empty(n)
        return kept[:n].view(shape)

    def flush(self) -> None:
        """Write the staged layers (nothing when none is staged)."""
        if self._first is None:
            return
        n = self._staged
        first, k, v, admit = self._first, self._k[:n], self._v[:n], self._admit[:n]
        self._first, self._k, self._v, self._admit, self._staged = None, None, None, None, 0
        self.pool.write_extend_layers(first, k, v, admit)
        self.groups_written += 1

    @property
    def pending(self) -> int:
        """Layers staged and not yet written."""
        return self._staged
