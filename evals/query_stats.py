"""Pre-RoPE query statistics calibrated on held-out text, and the key score they give (TriAttention-like).

In the pre-RoPE space each query head's queries cluster around a fixed non-zero center (Mao et al.,
2026, "TriAttention"). Written as complex RoPE pairs (HF's rotate-half convention: pair f is
``x[f] + i x[f + D/2]``), RoPE multiplies pair f by ``exp(i w_f pos)``, so a query at distance
``delta`` after key ``k`` scores ``Re sum_f q_f conj(k_f) exp(i w_f delta)``. Replacing ``q_f`` by the
calibrated center ``c_f`` predicts, without seeing the test prompt's queries, how much attention each
key will draw from future queries; the part of the query energy not captured by the center adds
``sum_f (E|q_f| - |c_f|) |k_f|``, a position-free norm term.

:func:`calibrate` runs the frozen backbone densely over calibration rows and averages the de-rotated
queries; :func:`key_scores` scores the keys of one layer for queries right after a prompt end.
"""

from dataclasses import dataclass

import torch

from sglang_wgkv.training.backbone import Backbone, dense_attention


@dataclass(frozen=True)
class QueryStats:
    """Per (layer, query head) statistics of pre-RoPE queries as complex RoPE pairs.

    center ``[L, Hq, D/2]`` complex64: mean query; mean_abs ``[L, Hq, D/2]`` float32: mean ``|q_f|``;
    inv_freq ``[D/2]`` float32: RoPE angle per position of each pair; tokens: calibration tokens seen.
    """

    center: torch.Tensor
    mean_abs: torch.Tensor
    inv_freq: torch.Tensor
    tokens: int

    def __post_init__(self):
        L, Hq, F = self.center.shape
        if (
            not self.center.is_complex()
            or tuple(self.mean_abs.shape) != (L, Hq, F)
            or tuple(self.inv_freq.shape) != (F,)
        ):
            raise ValueError(
                f"QueryStats shapes do not agree: center {tuple(self.center.shape)} "
                f"mean_abs {tuple(self.mean_abs.shape)} inv_freq {tuple(self.inv_freq.shape)}"
            )
        if self.tokens <= 0:
            raise ValueError("QueryStats needs at least one calibration token")


def as_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` real -> ``[..., D/2]`` complex64 RoPE pairs (rotate-half convention)."""
    half = x.shape[-1] // 2
    x = x.float()
    return torch.complex(x[..., :half], x[..., half:])


def _inv_freq(backbone: Backbone) -> torch.Tensor:
    inv = getattr(backbone.decoder.rotary_emb, "inv_freq", None)
    if inv is None:
        raise ValueError("the backbone's rotary embedding exposes no inv_freq")
    return inv.detach().float().cpu()


@torch.no_grad()
def calibrate(backbone: Backbone, rows: list[torch.Tensor]) -> QueryStats:
    """Average the de-rotated (pre-RoPE) queries of every layer and query head over ``rows`` (token ids ``[T]``)."""
    inv_freq = _inv_freq(backbone)
    shape = backbone.shape
    F = shape.head_dim // 2
    total = torch.zeros(shape.num_layers, shape.num_heads, F, dtype=torch.complex64)
    total_abs = torch.zeros(shape.num_layers, shape.num_heads, F)
    count = 0

    def record(layer, q, k_pre, k_post, v, scale):
        T = q.shape[2]
        angle = torch.arange(T, dtype=torch.float32, device=q.device)[:, None] * inv_freq.to(q.device)
        pre = as_pairs(q) * torch.polar(torch.ones_like(angle), -angle)  # [B, Hq, T, F], rotation undone
        total[layer] += pre.sum(dim=(0, 2)).cpu()
        total_abs[layer] += pre.abs().sum(dim=(0, 2)).cpu()
        return dense_attention(layer, q, k_pre, k_post, v, scale)

    for ids in rows:
        backbone(ids[None].to(backbone.device), record)
        count += ids.numel()
    if count == 0:
        raise ValueError("calibrate needs at least one calibration row")
    return QueryStats(total / count, total_abs / count, inv_freq, count)


def future_offsets(max_offset: int) -> torch.Tensor:
    """0, 1, 2, 4, ... up to ``max_offset``: distances past the prompt end at which keys are scored."""
    offsets, d = [0.0], 1
    while d <= max_offset:
        offsets.append(float(d))
        d *= 2
    return torch.tensor(offsets)


def key_scores(
    stats: QueryStats, layer: int, k_pre: torch.Tensor, prompt_len: int, max_offset: int = 512
) -> torch.Tensor:
    """Predicted attention logit of each key for queries just after ``prompt_len`` -> ``[Hkv, T]`` float32.

    k_pre ``[Hkv, T, D]``: the layer's pre-RoPE keys. A key's score is the largest over the query
    heads of its KV head's group of (trigonometric term averaged over the distances
    ``prompt_len - j + future_offsets(max_offset)`` + norm term).
    """
    Hkv, T, _ = k_pre.shape
    dev = k_pre.device
    center = stats.center[layer].to(dev)  # [Hq, F]
    group = center.shape[0] // Hkv
    inv_freq = stats.inv_freq.to(dev)
    k = as_pairs(k_pre)  # [Hkv, T, F]
    dist = (prompt_len - torch.arange(T, device=dev, dtype=torch.float32))[:, None] * inv_freq  # [T, F]
    offsets = future_offsets(max_offset).to(dev)[:, None] * inv_freq  # [O, F]
    # mean over offsets of exp(i w (P - j + d)) = exp(i w (P - j)) * mean_d exp(i w d)
    phase = torch.polar(torch.ones_like(dist), dist) * torch.polar(torch.ones_like(offsets), offsets).mean(0)
    kc = k.conj()[:, None] * phase  # [Hkv, 1, T, F]
    trig = torch.einsum("hgf,hgtf->hgt", center.view(Hkv, group, -1), kc.expand(-1, group, -1, -1)).real
    spread = (stats.mean_abs[layer].to(dev) - center.abs()).view(Hkv, group, -1)  # [Hkv, G, F]
    norm = torch.einsum("hgf,htf->hgt", spread, k.abs())
    return (trig + norm).amax(dim=1)
