"""Per (layer, KV head): what WG-KV's gate-decided budgets keep against an equal per-head budget.

For each sample one dense forward records every layer's queries and keys. Per (layer, KV head):

* ``wgkv_kept``: prompt keys older than the local window with ``g >= tau`` (the gate decides how many);
* ``equal_kept``: the same total spread equally, ``mean(wgkv_kept)`` per head, the keys with the best
  calibrated score (:func:`evals.query_stats.key_scores`, the ``equal_budget`` policy's choice);
* ``old_mass``: the share of the full-cache attention of the queries after the prompt (the answer or the
  continuation, summed over the head's query group) that falls on those older keys: how much the head
  needs anything beyond its window;
* ``recall_wgkv`` / ``recall_equal``: the part of ``old_mass`` that the kept keys carry.

Both policies see the dense forward's keys here (in :mod:`evals.run` each runs on its own forward), so
the breakdown isolates the choice of keys and budgets from the drift of later layers.

CLI: ``python -m evals.head_budgets --gates DIR --corpus C --ruler FILE --out OUT.json [--plot OUT.png]``.
"""

import argparse
import json
from pathlib import Path

import torch

from evals.query_stats import calibrate, key_scores
from sglang_wgkv.gate import WriteGates, load_gates
from sglang_wgkv.training.backbone import Backbone, dense_attention, load_backbone
from sglang_wgkv.training.corpus import Corpus


@torch.no_grad()
def head_breakdown(
    backbone: Backbone,
    gates: WriteGates,
    stats,
    ids: torch.Tensor,
    prompt_len: int,
    tau: float,
    local_window: int,
) -> dict[str, torch.Tensor]:
    """One sample -> per-(layer, KV head) tensors ``[L, Hkv]``: wgkv_kept, equal_kept, old_mass,
    recall_wgkv, recall_equal (see the module docstring)."""
    P, old = prompt_len, max(prompt_len - local_window, 0)
    out = {k: [] for k in ("wgkv_kept", "equal_kept", "old_mass", "recall_wgkv", "recall_equal")}
    kept_wgkv, scores, masses = [], [], []

    def record(layer, q, k_pre, k_post, v, scale):
        Hkv, group = k_post.shape[1], q.shape[1] // k_post.shape[1]
        g = gates.layers[layer](k_pre[0].transpose(0, 1), k_post[0].transpose(0, 1)).t()  # [Hkv, T]
        kept_wgkv.append(g[:, :old] >= tau)
        scores.append(key_scores(stats, layer, k_pre[0, :, :old], P))
        logits = q[0, :, P:].float() @ k_post[0, :, : q.shape[2]].float().repeat_interleave(
            group, 0
        ).transpose(1, 2)
        causal = (
            torch.arange(q.shape[2], device=q.device)[None, :]
            <= torch.arange(P, q.shape[2], device=q.device)[:, None]
        )
        probs = torch.softmax((logits * scale).masked_fill(~causal, float("-inf")), dim=-1)  # [Hq, A, T]
        mass = probs.sum(1).view(Hkv, group, -1).sum(1)  # [Hkv, T]
        masses.append(mass / mass.sum(-1, keepdim=True))
        return dense_attention(layer, q, k_pre, k_post, v, scale)

    backbone(ids[None].to(backbone.device), record)
    budget = int(round(torch.stack([k.sum(-1) for k in kept_wgkv]).float().mean().item()))
    for kept, score, mass in zip(kept_wgkv, scores, masses):
        equal = torch.zeros_like(kept)
        if budget > 0:
            equal.scatter_(1, score.topk(min(budget, old), dim=-1).indices, True)
        old_mass = mass[:, :old].sum(-1)
        denom = old_mass.clamp_min(1e-12)
        out["wgkv_kept"].append(kept.sum(-1).float())
        out["equal_kept"].append(equal.sum(-1).float())
        out["old_mass"].append(old_mass)
        out["recall_wgkv"].append((mass[:, :old] * kept).sum(-1) / denom)
        out["recall_equal"].append((mass[:, :old] * equal).sum(-1) / denom)
    return {k: torch.stack(v).cpu() for k, v in out.items()}


def _samples(corpus: Corpus | None, ruler: list[dict], length: int, n: int, cont: int):
    for s in ruler:
        if s["length"] == length and s["index"] < n:
            yield s["task"], torch.tensor(s["prompt"] + s["answer"]), len(s["prompt"])
    if corpus is not None:
        for row in corpus.rows("heldout", length)[:n]:
            yield "nll", torch.as_tensor(row).long(), length - cont


def summarize(per_sample: list[dict[str, torch.Tensor]], local_window: int) -> dict:
    """Means over samples per (layer, head), and the totals that say where unequal budgets win or lose."""
    mean = {k: torch.stack([s[k] for s in per_sample]).mean(0) for k in per_sample[0]}
    w = mean["old_mass"]
    more = mean["wgkv_kept"] > mean["equal_kept"]
    gain = mean["recall_wgkv"] - mean["recall_equal"]
    return {
        "per_head": {k: v.tolist() for k, v in mean.items()},
        "mass_weighted_recall": {
            "wgkv": float((mean["recall_wgkv"] * w).sum() / w.sum()),
            "equal_budget": float((mean["recall_equal"] * w).sum() / w.sum()),
        },
        "heads_where_wgkv_keeps_more": {
            "count": int(more.sum()),
            "of": more.numel(),
            "mean_old_mass": float(w[more].mean()) if more.any() else None,
            "mean_recall_gain": float(gain[more].mean()) if more.any() else None,
        },
        "heads_where_wgkv_keeps_less": {
            "count": int((~more).sum()),
            "mean_old_mass": float(w[~more].mean()) if (~more).any() else None,
            "mean_recall_gain": float(gain[~more].mean()) if (~more).any() else None,
        },
        "corr_wgkv_kept_vs_old_mass": float(
            torch.corrcoef(torch.stack([mean["wgkv_kept"].flatten(), w.flatten()]))[0, 1]
        ),
        "local_window": local_window,
    }


def plot(summary: dict, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = {k: torch.tensor(v) for k, v in summary["per_head"].items()}
    panels = [
        ("wgkv_kept", "WG-KV keeps (older keys)", "viridis"),
        ("equal_kept", "equal budget keeps", "viridis"),
        ("old_mass", "attention on older keys (full cache)", "magma"),
        ("recall_gain", "recall: WG-KV - equal budget", "coolwarm"),
    ]
    h["recall_gain"] = h["recall_wgkv"] - h["recall_equal"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 6))
    vmax_keep = float(max(h["wgkv_kept"].max(), h["equal_kept"].max()))
    for ax, (key, title, cmap) in zip(axes, panels):
        kw = {"vmin": 0, "vmax": vmax_keep} if key.endswith("kept") else {}
        if key == "recall_gain":
            lim = float(h[key].abs().max()) or 1.0
            kw = {"vmin": -lim, "vmax": lim}
        im = ax.imshow(h[key].numpy(), aspect="auto", cmap=cmap, **kw)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("KV head")
        fig.colorbar(im, ax=ax, fraction=0.08)
    axes[0].set_ylabel("layer")
    r = summary["mass_weighted_recall"]
    fig.suptitle(
        f"mass-weighted recall of older-key attention: WG-KV {r['wgkv']:.3f}, "
        f"equal budget {r['equal_budget']:.3f}",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--gates", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--ruler", default=None)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=2, help="per task (RULER) and held-out NLL rows")
    p.add_argument("--cont", type=int, default=256)
    p.add_argument("--calibration-rows", type=int, default=2)
    p.add_argument("--calibration-length", type=int, default=2048)
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    backbone = load_backbone(a.model)
    gates = load_gates(a.gates)
    corpus = Corpus(a.corpus)
    stats = calibrate(
        backbone,
        [torch.as_tensor(r).long() for r in corpus.rows("train", a.calibration_length)[: a.calibration_rows]],
    )
    ruler = json.loads(Path(a.ruler).read_text())["samples"] if a.ruler else []
    c = gates.config
    per_sample, kinds = [], []
    for kind, ids, P in _samples(corpus, ruler, a.length, a.samples, a.cont):
        per_sample.append(head_breakdown(backbone, gates, stats, ids, P, c.tau, c.local_window))
        kinds.append(kind)
    out = summarize(per_sample, c.local_window)
    out["samples"] = kinds
    out["command"] = "python -m evals.head_budgets " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.plot:
        plot(out, a.plot)
    print(json.dumps({k: v for k, v in out.items() if k != "per_head"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
