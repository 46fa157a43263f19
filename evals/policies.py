"""KV-cache policies compared at equal memory, expressed as hard attention masks over one forward.

A policy decides, per layer and KV head, which keys stay in the cache (``kept``, the global part) and
how wide the always-kept recent window is. Semantics follow the serving path: prefill queries see
the recent window plus kept keys (vertical-slash); the tokens after ``prompt_len`` (the answer being
decoded) are always visible to later tokens. SnapKV alone prefills densely and compresses once at the
end of the prompt (``full_rows``).

Cache size of a policy after ``prompt_len`` tokens, per (layer, head): kept keys older than the
window plus the window, as counted by :func:`cache_count`.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from sglang_wgkv.gate import WriteGates


@dataclass
class Visibility:
    """kept ``[Hkv, T]`` bool; window: always-visible recent keys; full_rows: densely-prefilled queries."""

    kept: torch.Tensor
    window: int
    full_rows: int = 0


def cache_count(vis: Visibility, prompt_len: int) -> torch.Tensor:
    """Keys cached per KV head ``[Hkv]`` right after ``prompt_len`` tokens."""
    old = max(prompt_len - vis.window, 0)
    return vis.kept[:, :old].sum(-1) + min(vis.window, prompt_len)


def _answer_visible(kept: torch.Tensor, prompt_len: int) -> torch.Tensor:
    kept = kept.clone()
    kept[:, prompt_len:] = True
    return kept


class FullCache:
    name = "full"

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        return Visibility(
            torch.ones(k_post.shape[0], k_post.shape[1], dtype=torch.bool, device=k_post.device),
            window=k_post.shape[1],
        )


class WGKVAdmission:
    """Learned admission: a key enters the global cache iff ``g >= tau``."""

    name = "wgkv"

    def __init__(self, gates: WriteGates, tau: float, local_window: int):
        self.gates, self.tau, self.window = gates, tau, local_window

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        g = self.gates.layers[layer](k_pre.transpose(0, 1), k_post.transpose(0, 1)).t()  # [Hkv, T]
        return Visibility(_answer_visible(g >= self.tau, prompt_len), self.window)


class StreamingLLM:
    """Attention sinks plus a sliding window; ``budget`` = sinks + window keys per head."""

    name = "streaming"

    def __init__(self, budget: int, sinks: int = 4):
        self.sinks, self.window = sinks, max(budget - sinks, 1)

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        Hkv, T = k_post.shape[:2]
        kept = torch.zeros(Hkv, T, dtype=torch.bool, device=k_post.device)
        kept[:, : self.sinks] = True
        return Visibility(_answer_visible(kept, prompt_len), self.window)


class RandomAdmission:
    """The local ring plus each older key admitted with probability ``p`` (seeded per layer)."""

    name = "random"

    def __init__(self, p: float, local_window: int, seed: int = 0):
        self.p, self.window, self.seed = p, local_window, seed

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        Hkv, T = k_post.shape[:2]
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1000 + layer)
        kept = (torch.rand(Hkv, T, generator=gen) < self.p).to(k_post.device)
        return Visibility(_answer_visible(kept, prompt_len), self.window)


class SnapKV:
    """Dense prefill, then keep per head the ``budget`` prompt keys most attended by the last
    ``obs_window`` prompt queries (attention summed over the head's query group, max-pooled over
    ``kernel`` positions), the observation window included (Li et al., 2024)."""

    name = "snapkv"

    def __init__(self, budget: int, obs_window: int = 32, kernel: int = 7):
        self.budget, self.obs_window, self.kernel = budget, obs_window, kernel

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        Hkv, T, D = k_post.shape
        P, obs = prompt_len, min(self.obs_window, self.budget, prompt_len)
        group = q.shape[0] // Hkv
        kept = torch.zeros(Hkv, T, dtype=torch.bool, device=k_post.device)
        kept[:, P - obs : P] = True
        n_select = min(self.budget - obs, P - obs)
        if n_select > 0:
            qo = q[:, P - obs : P].float()  # [Hq, obs, D]
            kk = k_post[:, : P - obs].float().repeat_interleave(group, 0)  # [Hq, P-obs, D]
            probs = torch.softmax(qo @ kk.transpose(1, 2) / D**0.5, dim=-1)
            score = probs.sum(1).view(Hkv, group, -1).sum(1)  # [Hkv, P-obs]
            score = F.max_pool1d(score[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
            kept.scatter_(1, score.topk(n_select, dim=-1).indices, True)
        return Visibility(_answer_visible(kept, prompt_len), window=1, full_rows=P)


class EqualBudget:
    """Every (layer, KV head) keeps the same number of keys: the local ring plus the ``budget - window``
    older prompt keys that calibrated query statistics predict will draw the most attention after the
    prompt (:func:`evals.query_stats.key_scores`; the statistics come from calibration text, not from
    the prompt). Same vertical-slash visibility as WG-KV, so against it only the per-head budgets and
    the choice of keys differ."""

    name = "equal_budget"

    def __init__(self, budget: int, local_window: int, stats, max_offset: int = 512):
        self.budget, self.window, self.stats, self.max_offset = budget, local_window, stats, max_offset

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        from evals.query_stats import key_scores

        Hkv, T = k_post.shape[:2]
        old = max(prompt_len - self.window, 0)
        kept = torch.zeros(Hkv, T, dtype=torch.bool, device=k_post.device)
        n_select = min(max(self.budget - min(self.window, prompt_len), 0), old)
        if n_select > 0:
            score = key_scores(self.stats, layer, k_pre[:, :old], prompt_len, self.max_offset)
            kept.scatter_(1, score.topk(n_select, dim=-1).indices, True)
        return Visibility(_answer_visible(kept, prompt_len), self.window)


class ServedPromptEnd:
    """What the served evictor (``--kv-budget B``, admission off) keeps after a prompt: dense prefill,
    then the W_local ring plus the ``keep`` older keys ranked by the evictor's own scoring
    (:func:`sglang_wgkv.memory.snapkv_score.snapkv_scores`: the prompt's last ``obs`` queries, max
    over the head's query group, summed, max-pooled over ``kernel``); ``keep = B - lead`` as served.
    Keys leaving the ring while the answer is decoded stay (every token is admitted)."""

    name = "served_snapkv"

    def __init__(self, keep: int, obs: int, kernel: int, local_window: int):
        self.keep, self.obs, self.kernel, self.window = keep, obs, kernel, local_window

    def visibility(self, layer, q, k_pre, k_post, prompt_len):
        from sglang_wgkv.memory.snapkv_score import snapkv_scores

        Hkv, T, D = k_post.shape
        P, dev = prompt_len, k_post.device
        ng = max(P - self.window, 0)  # global part at the prompt's end
        kept = torch.zeros(Hkv, T, dtype=torch.bool, device=dev)
        kept[:, ng:] = True  # the ring, then the answer
        if ng <= self.keep:
            kept[:, :ng] = True
            return Visibility(kept, window=1, full_rows=P)
        obs = min(self.obs, P)
        group = q.shape[0] // Hkv
        qw = q[:, P - obs : P].reshape(Hkv, group, obs, D).transpose(1, 2)  # [Hkv, obs, G, D]
        q_pos = torch.arange(P - obs, P, device=dev)[None].expand(Hkv, -1)
        r_pos = torch.arange(ng, P, device=dev)[None].expand(Hkv, -1)
        scores = snapkv_scores(
            qw,
            q_pos,
            k_post[:, :ng],
            torch.full((Hkv,), ng, device=dev),
            k_post[:, ng:P],
            r_pos,
            D**-0.5,
            self.kernel,
        )
        kept.scatter_(1, scores.topk(self.keep, dim=-1).indices, True)
        return Visibility(kept, window=1, full_rows=P)
