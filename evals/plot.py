"""Pareto plot of an ``evals.run`` result: task accuracy and held-out NLL versus KV fraction.

``python -m evals.plot RESULTS.json OUT.png [--length L]`` (default: all lengths pooled).
"""

import argparse
import json
from pathlib import Path

STYLE = {
    "wgkv": ("WG-KV (learned admission)", "tab:red", "o"),
    "streaming": ("StreamingLLM (sinks + window)", "tab:blue", "s"),
    "snapkv": ("SnapKV (prefill one-shot)", "tab:green", "^"),
    "random": ("random admission + ring", "tab:gray", "x"),
    "equal_budget": ("equal per-head budget (calibrated)", "tab:purple", "D"),
}


def plot(results: dict, out: str | Path, length: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [s for s in results["summary"] if s["length"] == length]
    panels = [(ev, "accuracy") for ev in sorted({s["eval"] for s in summary} - {"nll"})]
    if any(s["eval"] == "nll" for s in summary):
        panels.append(("nll", "nll_cont"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), squeeze=False)
    for ax, (ev, metric) in zip(axes[0], panels):
        rows = [s for s in summary if s["eval"] == ev and metric in s]
        full = [s for s in rows if s["method"] == "full"]
        if full:
            ax.axhline(full[0][metric], color="k", ls="--", lw=1, label="full cache")
        xs = []
        for n, (method, (label, color, marker)) in enumerate(STYLE.items()):
            pts = sorted((s["kv_fraction"], s[metric]) for s in rows if s["method"] == method)
            if pts:
                # shrinking markers: methods at the same memory and score stay visible on top of each other
                ax.plot(*zip(*pts), color=color, marker=marker, label=label, markersize=11 - 1.6 * n)
                xs += [x for x, _ in pts]
        if xs and max(xs) > 2 * min(xs):
            ax.set_xscale("log")
        else:  # one memory point (a single gate set): a log axis would zoom into rounding noise
            ax.set_xlim(0, 1.05)
        ax.set_xlabel("KV fraction (cached keys / prompt tokens)")
        ax.set_ylabel("accuracy" if metric == "accuracy" else "NLL of the continuation (nats)")
        ax.set_title(f"{ev} ({'all lengths' if length is None else length})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results")
    p.add_argument("out")
    p.add_argument("--length", type=int, default=None)
    a = p.parse_args(argv)
    print(plot(json.loads(Path(a.results).read_text()), a.out, a.length))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
