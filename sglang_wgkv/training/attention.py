"""Attentions the trainer and the evals plug into :class:`~sglang_wgkv.training.backbone.Backbone`.

* :class:`SoftGatedAttention` -- the student: bias ``log(m_ij + eps)`` with ``m_ij = 1`` inside the local
  window and ``g_j`` beyond (paper §3.2). ``backend="flex"`` fuses it with FlexAttention's ``score_mod``
  (GPU); ``backend="sdpa"`` materializes the bias (the core's CPU reference); ``backend="split"``
  (:func:`split_key_attention`) needs no bias tensor at all, so SDPA's fused kernels can run it;
  ``backend="flex_split"`` runs the same construction through FlexAttention with a block mask.
* :class:`HardGatedAttention` -- inference semantics: key ``j`` visible beyond the window iff
  ``g_j >= tau`` (vertical-slash), used for the hard-threshold validation loss and the evals.
* :func:`visibility_mask` / :func:`masked_attention` -- the hard mask shared with the eval policies.

Batch element ``b`` of the student uses gate set ``gates[b]``: the trainer runs one λ per element.
"""

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang_wgkv.attention.reference import soft_gated_attention
from sglang_wgkv.gate import WriteGates


def gate_values(
    gates: Sequence[WriteGates], layer: int, k_pre: torch.Tensor, k_post: torch.Tensor
) -> torch.Tensor:
    """Gate values ``[B, Hkv, T]`` (float32); element b uses ``gates[b]`` (or ``gates[0]`` for all)."""
    B = k_pre.shape[0]
    if len(gates) not in (1, B):
        raise ValueError(f"{len(gates)} gate sets for a batch of {B}")
    rows = []
    for b in range(B):
        gate = gates[b if len(gates) == B else 0].layers[layer]
        rows.append(gate(k_pre[b].transpose(0, 1), k_post[b].transpose(0, 1)).t())
    return torch.stack(rows)


BACKENDS = ("sdpa", "flex", "split", "flex_split")


def split_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, eps: float, scale: float, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The near/far key copies of :func:`split_key_attention`, channels zero-padded to ``width > D``.

    Returns q' ``[B, Hq, T, width]`` (channel D = 1), k' ``[B, Hkv, 2T, width]`` (keys ``0..T-1``: near
    copies, channel D = 0; keys ``T..2T-1``: far copies, channel D = ``log(g + eps) / scale``) and
    v' ``[B, Hkv, 2T, width]`` (v twice).
    """
    D = q.shape[-1]
    pad = width - D - 1
    bias = (torch.log(g.float() + eps) / scale).to(k.dtype)[..., None]  # [B, Hkv, T, 1]
    zeros = k.new_zeros(*k.shape[:-1], 1 + pad)
    q2 = torch.cat([q, q.new_ones(*q.shape[:-1], 1), q.new_zeros(*q.shape[:-1], pad)], dim=-1)
    near, far = torch.cat([k, zeros], -1), torch.cat([k, bias, zeros[..., 1:]], -1)
    v2 = torch.cat([v, v.new_zeros(*v.shape[:-1], width - D)], dim=-1).repeat(1, 1, 2, 1)
    return q2, torch.cat([near, far], dim=2), v2


def split_visible(qi, ki, T: int, local_window: int):
    """Query ``qi`` sees split key ``ki`` (``[0, T)`` near copies, ``[T, 2T)`` far copies); works on
    index tensors, also inside FlexAttention's ``mask_mod``."""
    near = (ki < T) & (qi >= ki) & (qi - ki < local_window)
    far = (ki >= T) & (qi - (ki - T) >= local_window)
    return near | far


def split_key_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    local_window: int,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """:func:`~sglang_wgkv.attention.reference.soft_gated_attention` without a bias tensor.

    The gate bias ``log(g_j + eps)`` applies to query i iff ``i - j >= W``: it depends on the key and
    on one distance threshold only. Each key therefore enters twice: a *near* copy, visible to
    ``0 <= i - j < W``, and a *far* copy, visible to ``i - j >= W``, whose extra channel holds
    ``log(g_j + eps) / scale`` against a query channel of ones, so ``scale * q'.k'_far`` is the biased
    score. The two copies partition the causal keys of every query, so one softmax over ``2T`` keys is
    the soft-gated softmax; the gate's gradient flows through ``k'`` (an ordinary input), and the mask
    is a constant boolean, which SDPA's fused CUDA kernels accept in backward where a bias requiring
    grad fails (see ``soft_gated_attention``).

    q ``[B, Hq, T, D]``, k/v ``[B, Hkv, T, D]``, g ``[B, Hkv, T]`` -> ``[B, Hq, T, D]`` in q's dtype.
    Channels are padded to a multiple of 8 (the fused kernels' alignment).
    """
    T, D = q.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    q2, k2, v2 = split_keys(q, k, v, g, eps, scale, -(-(D + 1) // 8) * 8)
    i = torch.arange(T, device=q.device)
    mask = split_visible(
        i[:, None], torch.arange(2 * T, device=q.device)[None, :], T, local_window
    )  # [T, 2T]
    k2, v2 = k2.repeat_interleave(group, 1), v2.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=scale)
    return out[..., :D]


def visibility_mask(kept: torch.Tensor, local_window: int, full_rows: int = 0) -> torch.Tensor:
    """``[B, Hkv, T, T]`` bool: query i sees key j iff j <= i and (i - j < W or kept[j] or i < full_rows).

    kept : ``[B, Hkv, T]`` bool, key j is in the global cache. ``full_rows`` queries (a prompt whose
    prefill attends densely, as in SnapKV) see every earlier key.
    """
    T = kept.shape[-1]
    i = torch.arange(T, device=kept.device)
    dist = i[:, None] - i[None, :]
    causal = dist >= 0
    visible = (causal & (dist < local_window)) | (causal & kept[:, :, None, :])
    if full_rows:
        visible[:, :, :full_rows] |= causal[:full_rows]
    return visible


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """GQA attention under a per-KV-head boolean mask ``visible [B, Hkv, T, T]`` -> ``[B, Hq, T, D]``.

    Each KV head's query group becomes the head axis of one batch row, so the mask broadcasts over
    the group instead of being copied per query head.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    qr = q.reshape(B * Hkv, group, T, D)
    kr = k.reshape(B * Hkv, 1, T, D).expand(-1, group, -1, -1)
    vr = v.reshape(B * Hkv, 1, T, D).expand(-1, group, -1, -1)
    mask = visible.reshape(B * Hkv, 1, T, -1)
    try:
        out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        # A fused kernel refused these strides at run time (see SoftGatedAttention.attend): use math.
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, T, D)


class SoftGatedAttention:
    """Differentiable write-gated attention; returns the gate values as aux for the sparsity loss."""

    def __init__(
        self, gates: Sequence[WriteGates], local_window: int, eps: float = 1e-6, backend: str = "sdpa"
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.gates, self.local_window, self.eps, self.backend = list(gates), local_window, eps, backend
        self._flex = None
        self._block_masks = {}

    def __call__(self, layer: int, q, k_pre, k_post, v, scale: float):
        g = gate_values(self.gates, layer, k_pre, k_post)
        return self.attend(q, k_post, v, g, scale), g

    def attend(self, q, k, v, g, scale: float) -> torch.Tensor:
        """q ``[B, Hq, T, D]``, k/v ``[B, Hkv, T, D]`` (post-RoPE), g ``[B, Hkv, T]`` -> ``[B, Hq, T, D]``."""
        if self.backend == "flex":
            return self._flex_attention(q, k, v, torch.log(g + self.eps), scale)
        if self.backend == "split":
            return split_key_attention(q, k, v, g, self.local_window, self.eps, scale)
        if self.backend == "flex_split":
            return self._flex_split_attention(q, k, v, g, scale)
        # On CUDA the memory-efficient kernel's backward with a bias that needs a gradient fails on sm_90
        # (torch 2.11: "LSE is not correctly aligned (strideH)"); the math kernel is exact.
        with sdpa_kernel(SDPBackend.MATH) if q.is_cuda else nullcontext():
            return soft_gated_attention(q, k, v, g, self.local_window, self.eps, sm_scale=scale)

    def _flex_attention(self, q, k, v, log_g, scale):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self._flex is None:
            # Uncompiled FlexAttention materializes the scores (fine for CPU tests); CUDA gets the fused kernel.
            self._flex = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
        T = q.shape[2]
        key = (T, q.device)
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(
                lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=q.device
            )
        group, window = q.shape[1] // k.shape[1], self.local_window

        def score_mod(score, b, h, qi, ki):
            return score + torch.where(qi - ki < window, 0.0, log_g[b, h // group, ki])

        return self._flex(
            q, k, v, score_mod=score_mod, block_mask=self._block_masks[key], scale=scale, enable_gqa=True
        )

    def _flex_split_attention(self, q, k, v, g, scale):
        """:func:`split_key_attention` through FlexAttention: its block mask skips the blocks no query sees
        (about a causal attention's work instead of ``T x 2T``), and no captured tensor needs a gradient."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self._flex is None:
            self._flex = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
        T, D = q.shape[2], q.shape[3]
        key = ("split", T, q.device)
        if key not in self._block_masks:
            window = self.local_window
            self._block_masks[key] = create_block_mask(
                lambda b, h, qi, ki: split_visible(qi, ki, T, window), None, None, T, 2 * T, device=q.device
            )
        width = 1 << D.bit_length()  # a power of two above D: every FlexAttention kernel takes it
        q2, k2, v2 = split_keys(q, k, v, g, self.eps, scale, width)
        out = self._flex(q2, k2, v2, block_mask=self._block_masks[key], scale=scale, enable_gqa=True)
        return out[..., :D]


class HardGatedAttention:
    """Vertical-slash attention with admission ``g >= tau``; returns the admitted mask ``[B, Hkv, T]``."""

    def __init__(self, gates: Sequence[WriteGates], local_window: int, tau: float):
        self.gates, self.local_window, self.tau = list(gates), local_window, tau

    def __call__(self, layer: int, q, k_pre, k_post, v, scale: float):
        kept = gate_values(self.gates, layer, k_pre, k_post) >= self.tau
        return masked_attention(q, k_post, v, visibility_mask(kept, self.local_window), scale), kept


def kv_fraction(kept: torch.Tensor, length: int, local_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache size after ``length`` tokens, as a fraction of ``length``, per batch element.

    kept : ``[B, Hkv, T]`` (T >= length). Returns ``(total, global_only)`` ``[B]``: total counts the
    union of admitted keys and the last ``local_window`` (the ring); global_only counts admitted keys
    older than the ring over the positions older than the ring.
    """
    k = kept[..., :length]
    old = max(length - local_window, 0)
    in_ring = min(local_window, length)
    global_kept = k[..., :old].float().sum(-1)  # [B, Hkv]
    total = (global_kept + in_ring).mean(-1) / length
    global_only = (global_kept / max(old, 1)).mean(-1)
    return total, global_only


def sparsity_penalty(g: torch.Tensor, local_window: int) -> torch.Tensor:
    """``mean(g + g(1-g))`` per batch element over positions that some query sees beyond the window."""
    T = g.shape[-1]
    g = g[..., : max(T - local_window, 0)]
    if g.shape[-1] == 0:
        return g.new_zeros(g.shape[0])
    return (g + g * (1 - g)).flatten(1).mean(-1)
