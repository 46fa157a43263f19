"""Memory-accuracy evaluation: held-out NLL and RULER-style tasks versus KV fraction.

For every sample, the full cache and WG-KV (one gate set per λ, admission ``g >= tau``) run first;
then StreamingLLM, random admission, SnapKV and the equal per-head budget policy (query statistics
calibrated on ``--calibration-rows`` training rows of the corpus, never on the test prompts) run at
each WG-KV's measured cache size (equal memory, per sample). KV fraction = mean cached keys per
(layer, KV head) after the prompt / prompt length.

* NLL: held-out corpus rows of each length; the last ``--cont`` tokens are the continuation. ``nll_cont``
  is their NLL given the compressed prompt (all methods); ``nll_all`` is the NLL of every token
  (not for SnapKV, which prefills densely); ``mse`` is the final hidden states' MSE against full cache.
* Tasks: ``evals.ruler`` samples; ``accuracy`` = greedy decoding would emit exactly the answer.

CLI: ``python -m evals.run --model M --gates DIR[,DIR..] --corpus C --ruler FILE --out results.json``.
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn import functional as F

from evals.harness import two_pass
from evals.query_stats import calibrate
from evals.ruler import load_samples
from sglang_wgkv.gate import load_gates
from sglang_wgkv.training.backbone import Backbone, load_backbone
from sglang_wgkv.training.corpus import Corpus


def answer_scores(backbone: Backbone, hidden: torch.Tensor, prompt_len: int, answer: list[int]):
    A = len(answer)
    target = torch.tensor(answer, device=hidden.device)
    logits = backbone.logits(hidden[:, prompt_len - 1 : prompt_len + A - 1]).float()  # [N, A, V]
    correct = (logits.argmax(-1) == target).all(-1)
    nll = F.cross_entropy(
        logits.transpose(1, 2), target[None].expand(len(hidden), -1), reduction="none"
    ).mean(-1)
    # the closest call of greedy decoding: min over answer positions of (target logit - best other logit);
    # negative where greedy leaves the answer, near 0 a near-tie (evals.agreement)
    tgt = logits.gather(-1, target[None, :, None].expand(len(hidden), -1, 1))[..., 0]
    other = logits.scatter(-1, target[None, :, None].expand(len(hidden), -1, 1), float("-inf")).amax(-1)
    margin = (tgt - other).amin(-1)
    return correct.tolist(), nll.tolist(), margin.tolist()


def _nll(backbone: Backbone, hidden: torch.Tensor, ids: torch.Tensor, prompt_len: int):
    """Per-element (nll over all next tokens, nll over the continuation)."""
    out_all, out_cont = [], []
    for h in hidden:  # one element at a time keeps the [T, vocab] logits small
        lp = F.cross_entropy(backbone.logits(h[:-1]).float(), ids[1:], reduction="none")
        out_all.append(lp.mean().item())
        out_cont.append(lp[prompt_len - 1 :].mean().item())
    return out_all, out_cont


def evaluate(
    backbone: Backbone,
    gate_sets: list,
    tau: float,
    local_window: int,
    corpus: Corpus | None,
    nll_lengths: list[int],
    nll_rows: int,
    cont: int,
    ruler: list[dict],
    time_budget_s: float | None,
    log=print,
    stats=None,
) -> dict:
    """Run the NLL and task evaluations; returns per-sample rows (stops early past ``time_budget_s``)."""
    t0 = time.time()
    dev = backbone.device
    rows, complete = [], True

    def over_budget() -> bool:
        return time_budget_s is not None and time.time() - t0 > time_budget_s

    units = []
    if corpus is not None:
        for L in nll_lengths:
            for i, row in enumerate(corpus.rows("heldout", L)[:nll_rows]):
                units.append(("nll", L, i, row))
    units += [("task", s["length"], s["index"], s) for s in ruler]
    units.sort(key=lambda u: (u[1], u[2]))  # short first, tasks interleaved: a cut-off loses long ones
    for kind, L, i, item in units:
        if over_budget():
            complete = False
            break
        if kind == "nll":
            ids = torch.as_tensor(item, device=dev)
            P = len(ids) - cont
            recs, hidden = two_pass(backbone, ids, P, gate_sets, tau, local_window, seed=i, stats=stats)
            nll_all, nll_cont = _nll(backbone, hidden, ids, P)
            mse = (hidden.float() - hidden[0].float()).pow(2).mean(dim=(1, 2)).tolist()
            for r, a, c, m in zip(recs, nll_all, nll_cont, mse):
                rows.append(
                    {
                        "eval": "nll",
                        "length": L,
                        "index": i,
                        **r,
                        "kv_fraction": r["cache"] / P,
                        "nll_all": None if r["method"] == "snapkv" else a,
                        "nll_cont": c,
                        "mse": m,
                    }
                )
        else:
            ids = torch.tensor(item["prompt"] + item["answer"], device=dev)
            P = len(item["prompt"])
            recs, hidden = two_pass(backbone, ids, P, gate_sets, tau, local_window, seed=i, stats=stats)
            correct, nll, margin = answer_scores(backbone, hidden, P, item["answer"])
            for r, ok, n, m in zip(recs, correct, nll, margin):
                rows.append(
                    {
                        "eval": item["task"],
                        "length": L,
                        "index": i,
                        **r,
                        "kv_fraction": r["cache"] / P,
                        "correct": ok,
                        "answer_nll": n,
                        "answer_margin": m,
                    }
                )
        log(f"[{time.time() - t0:6.1f}s] {kind} {L} #{i}")
    return {"rows": rows, "complete": complete, "elapsed_s": round(time.time() - t0, 1)}


def summarize(rows: list[dict]) -> list[dict]:
    """Means per (eval, length, method, lam), plus an all-lengths row (length None) per (eval, method, lam)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["eval"], r["length"], r["method"], r["lam"])].append(r)
        groups[(r["eval"], None, r["method"], r["lam"])].append(r)
    out = []
    for (ev, L, method, lam), rs in groups.items():
        s = {
            "eval": ev,
            "length": L,
            "method": method,
            "lam": lam,
            "n": len(rs),
            "kv_fraction": sum(r["kv_fraction"] for r in rs) / len(rs),
        }
        for key in ("correct", "nll_all", "nll_cont", "mse", "answer_nll"):
            vals = [float(r[key]) for r in rs if r.get(key) is not None]
            if vals:
                s["accuracy" if key == "correct" else key] = sum(vals) / len(vals)
        out.append(s)
    return sorted(out, key=lambda s: (s["eval"], s["length"] or 0, s["method"], s["lam"] or 0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--gates", required=True, help="comma-separated gate directories (one per λ)")
    p.add_argument("--tau", type=float, default=None, help="admission threshold (default: the gates' own)")
    p.add_argument("--corpus", default=None, help="built corpus for the NLL evaluation")
    p.add_argument("--nll-lengths", default="2048,4096,8192")
    p.add_argument("--nll-rows", type=int, default=4)
    p.add_argument("--cont", type=int, default=256, help="continuation tokens scored after the prompt")
    p.add_argument("--ruler", default=None, help="samples from `python -m evals.ruler`")
    p.add_argument(
        "--samples", type=int, default=None, help="use at most this many samples per (task, length)"
    )
    p.add_argument("--lengths", default=None, help="comma-separated task lengths to keep (default: all)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks to keep (default: all)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument(
        "--calibration-rows",
        type=int,
        default=2,
        help="training rows of the corpus that calibrate the equal-budget policy (0: no such policy)",
    )
    p.add_argument("--calibration-length", type=int, default=2048)
    a = p.parse_args(argv)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backbone = load_backbone(a.model, dtype=dtype, device=device)
    gate_sets = [load_gates(d, device=device) for d in a.gates.split(",")]
    for g in gate_sets:
        g.check_model(backbone.shape.num_layers, backbone.shape.num_kv_heads, backbone.shape.head_dim)
    tau = a.tau if a.tau is not None else gate_sets[0].config.tau
    window = gate_sets[0].config.local_window
    # the same filters as evals.served: one sample set for both (evals.agreement)
    ruler = load_samples(a.ruler, a.samples, a.lengths, a.tasks) if a.ruler else []
    corpus = Corpus(a.corpus) if a.corpus else None
    stats = None
    if corpus is not None and a.calibration_rows > 0:
        rows = corpus.rows("train", a.calibration_length)[: a.calibration_rows]
        stats = calibrate(backbone, [torch.as_tensor(r).long() for r in rows])
    res = evaluate(
        backbone,
        gate_sets,
        tau,
        window,
        corpus,
        [int(x) for x in a.nll_lengths.split(",")],
        a.nll_rows,
        a.cont,
        ruler,
        a.time_budget_s,
        stats=stats,
    )
    res["summary"] = summarize(res["rows"])
    res["config"] = {
        "model": a.model,
        "gates": a.gates.split(","),
        "tau": tau,
        "local_window": window,
        "cont": a.cont,
        "device": device,
        "dtype": str(dtype),
        "calibration": None
        if stats is None
        else {
            "split": "train",
            "length": a.calibration_length,
            "rows": a.calibration_rows,
            "tokens": stats.tokens,
        },
        "command": "python -m evals.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for s in res["summary"]:
        if s["length"] is None:
            print(json.dumps(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
