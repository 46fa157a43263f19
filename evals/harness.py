"""One forward of the frozen backbone under several KV policies at once (one per batch element)."""

import torch

from evals.policies import (
    EqualBudget,
    FullCache,
    RandomAdmission,
    SnapKV,
    StreamingLLM,
    WGKVAdmission,
    cache_count,
)
from sglang_wgkv.training.attention import masked_attention, visibility_mask
from sglang_wgkv.training.backbone import Backbone


class PolicyAttention:
    """Attention for :class:`Backbone`: element b attends under ``policies[b]``; aux = cache counts ``[B, Hkv]``."""

    def __init__(self, policies: list, prompt_len: int):
        self.policies, self.prompt_len = policies, prompt_len

    def __call__(self, layer, q, k_pre, k_post, v, scale):
        vis = [
            p.visibility(layer, q[b], k_pre[b], k_post[b], self.prompt_len)
            for b, p in enumerate(self.policies)
        ]
        mask = torch.stack([visibility_mask(x.kept[None], x.window, x.full_rows)[0] for x in vis])
        counts = torch.stack([cache_count(x, self.prompt_len) for x in vis])
        return masked_attention(q, k_post, v, mask, scale), counts


@torch.no_grad()
def policy_forward(
    backbone: Backbone,
    ids: torch.Tensor,
    policies: list,
    prompt_len: int,
    max_batch_tokens2: int = 6 * 8192 * 8192,
):
    """ids ``[T]`` -> (final hidden ``[B, T, hidden]``, cache counts ``[B, layers, Hkv]``) for B policies.

    Policies run in chunks so that ``chunk * T^2`` (the mask size) stays under ``max_batch_tokens2``.
    """
    T = ids.shape[0]
    chunk = max(1, max_batch_tokens2 // (T * T))
    hidden, counts = [], []
    for i in range(0, len(policies), chunk):
        part = policies[i : i + chunk]
        h, aux = backbone(ids[None].expand(len(part), -1), PolicyAttention(part, prompt_len))
        hidden.append(h)
        counts.append(torch.stack(aux, dim=1))
    return torch.cat(hidden), torch.cat(counts)


def matched_baselines(budget: float, prompt_len: int, local_window: int, seed: int, stats=None) -> list:
    """StreamingLLM, random admission and SnapKV holding ``budget`` keys per head after the prompt, and
    with calibrated query statistics ``stats`` (:class:`evals.query_stats.QueryStats`) the equal
    per-head budget policy."""
    b = max(int(round(budget)), 1)
    ring = min(local_window, prompt_len)
    p = min(max((budget - ring) / max(prompt_len - ring, 1), 0.0), 1.0)
    out = [StreamingLLM(b), RandomAdmission(p, local_window, seed), SnapKV(b)]
    if stats is not None:
        out.append(EqualBudget(b, local_window, stats))
    return out


def two_pass(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    gate_sets: list,
    tau: float,
    local_window: int,
    seed: int = 0,
    stats=None,
):
    """Full cache and WG-KV (one per gate set) first, then the baselines at each WG-KV's measured budget.

    Returns ``(records, hidden)``: records[i] = {method, lam, cache} aligned with hidden ``[N, T, hidden]``;
    ``cache`` is the mean number of keys per (layer, head) after ``prompt_len`` tokens.
    """
    first = [FullCache()] + [WGKVAdmission(g, tau, local_window) for g in gate_sets]
    h1, c1 = policy_forward(backbone, ids, first, prompt_len)
    records = [{"method": "full", "lam": None}] + [{"method": "wgkv", "lam": g.config.lam} for g in gate_sets]
    second, meta = [], []
    for j, g in enumerate(gate_sets):
        budget = c1[1 + j].float().mean().item()
        for pol in matched_baselines(budget, prompt_len, local_window, seed, stats):
            second.append(pol)
            meta.append({"method": pol.name, "lam": g.config.lam})
    h2, c2 = policy_forward(backbone, ids, second, prompt_len)
    counts = torch.cat([c1, c2]).float().mean(dim=(1, 2)).tolist()
    records += meta
    for r, c in zip(records, counts):
        r["cache"] = c
    return records, torch.cat([h1, h2])


@torch.no_grad()
def teacher_forced_logprobs(backbone: Backbone, ids: torch.Tensor, policy, start: int) -> list[float]:
    """Log-probabilities (float32 softmax) of ``ids[start:]``, each given the tokens before it, every
    key under ``policy`` as a served request sees it: with ``prompt_len = T`` nothing is exempt, so
    a WG-KV policy's key j is visible to a later query i iff ``i - j < W_local`` or it was admitted,
    prompt and generated tokens alike (the served ring and promotion; decode and prefill agree).

    ids ``[T]`` (prompt then generated tokens); returns ``T - start`` values, for the logprobs a
    server reports for its output tokens along the same ids.
    """
    T = ids.shape[0]
    hidden, _ = policy_forward(backbone, ids, [policy], prompt_len=T)
    logits = backbone.logits(hidden[0, start - 1 : T - 1]).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[start:, None]).squeeze(-1).tolist()
