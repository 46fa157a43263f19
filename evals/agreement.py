"""Served against offline (issue 16 item 5): do the served engine and the offline harness give the same
answers and keep the same share of the KV, sample by sample?

Inputs: an ``evals.served`` result (``--served``: greedy ``/generate`` per sample) and an ``evals.run``
result on the same samples (``--offline``: teacher-forced answers, ``answer_margin`` = the closest
call of greedy decoding, min over answer positions of target logit - best other logit). Pairs of
methods (``--pairs``, served=offline[@λ]) are matched by (task, length, index).

* **Answers.** A sample agrees when both call it correct or both wrong. A disagreement is a
  *near-tie* when the offline margin is within ``--near-tie`` logits of 0 (two engines that sum in
  a different order may pick either of two almost equal tokens); else it is a *hard* disagreement.
* **KV share.** Offline: cached keys per (layer, KV head) after the prompt / prompt tokens. Served:
  ``mean_kv_tokens_per_head`` at the request's end covers the prompt and the ``g`` generated tokens,
  which all sit in the ring, so its prompt share is ``(mean_kv - g) / prompt``; the ``g`` prompt tokens
  that left the ring while generating bound the difference (``tolerance = g / prompt``).

``python -m evals.agreement --served S.json --offline R.json --pairs full=full,wgkv_served=wgkv --out A.json``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _key(r: dict) -> tuple:
    return (r.get("task") or r.get("eval"), r["length"], r["index"])


def served_prompt_share(row: dict) -> tuple[float, float]:
    """(share of the prompt's KV kept, tolerance) of an ``evals.served`` row."""
    usage, prompt = row.get("usage"), row["prompt_tokens"]
    if not usage:  # the full cache
        return 1.0, 0.0
    generated = usage["cached_tokens"] - prompt
    return (usage["mean_kv_tokens_per_head"] - generated) / prompt, generated / prompt


def compare(served_rows: list[dict], offline_rows: list[dict], near_tie: float) -> dict:
    """Per-sample comparison of one served method with one offline method (rows already filtered)."""
    offline = {_key(r): r for r in offline_rows}
    samples, counts = [], {"agree": 0, "near_tie": 0, "hard": 0, "missing_offline": 0}
    for s in served_rows:
        o = offline.get(_key(s))
        if o is None:
            counts["missing_offline"] += 1
            continue
        share, tol = served_prompt_share(s)
        margin = o.get("answer_margin")
        if s["correct"] == o["correct"]:
            verdict = "agree"
        elif margin is not None and abs(margin) <= near_tie:
            verdict = "near_tie"
        else:
            verdict = "hard"
        counts[verdict] += 1
        samples.append(
            {
                "task": _key(s)[0],
                "length": s["length"],
                "index": s["index"],
                "verdict": verdict,
                "served_correct": s["correct"],
                "offline_correct": o["correct"],
                "offline_margin": margin,
                "served_kv": share,
                "offline_kv": o["kv_fraction"],
                "kv_tolerance": tol,
                "kv_within_tolerance": abs(share - o["kv_fraction"]) <= tol + 1e-9,
            }
        )
    n = len(samples)
    return {
        **counts,
        "n": n,
        "served_accuracy": sum(x["served_correct"] for x in samples) / n if n else None,
        "offline_accuracy": sum(x["offline_correct"] for x in samples) / n if n else None,
        "served_kv": sum(x["served_kv"] for x in samples) / n if n else None,
        "offline_kv": sum(x["offline_kv"] for x in samples) / n if n else None,
        "max_kv_gap": max((abs(x["served_kv"] - x["offline_kv"]) for x in samples), default=None),
        "kv_within_tolerance": all(x["kv_within_tolerance"] for x in samples),
        "samples": samples,
    }


def parse_pairs(text: str) -> list[tuple[str, str, float | None]]:
    pairs = []
    for item in text.split(","):
        served, _, offline = item.partition("=")
        method, _, lam = offline.partition("@")
        pairs.append((served, method, float(lam) if lam else None))
    return pairs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--served", required=True, help="evals.served --out")
    p.add_argument("--offline", required=True, help="evals.run --out on the same samples")
    p.add_argument("--pairs", default="full=full,wgkv_served=wgkv", help="served=offline[@lam],...")
    p.add_argument("--near-tie", type=float, default=1.0, help="|offline margin| (logits) of a near-tie")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    served = json.loads(Path(a.served).read_text())
    offline = json.loads(Path(a.offline).read_text())
    out = {
        "command": "python -m evals.agreement " + " ".join(sys.argv[1:] if argv is None else argv),
        "served_command": served.get("command"),
        "offline_command": offline.get("config", {}).get("command"),
        "near_tie": a.near_tie,
        "pairs": [],
    }
    for s_method, o_method, lam in parse_pairs(a.pairs):
        s_rows = [
            r
            for res in served["results"]
            if res["method"] == s_method and res.get("budget") is None
            for r in res["rows"]
        ]
        o_rows = [
            r
            for r in offline["rows"]
            if r["method"] == o_method and r["eval"] != "nll" and (lam is None or r.get("lam") == lam)
        ]
        if o_method != "full" and lam is None and len({r.get("lam") for r in o_rows}) > 1:
            raise SystemExit(f"{o_method}: several λ in the offline results; name one ({o_method}@λ)")
        res = compare(s_rows, o_rows, a.near_tie)
        out["pairs"].append({"served": s_method, "offline": o_method, "lam": lam, **res})
        print(
            json.dumps(
                {"served": s_method, "offline": o_method}
                | {
                    k: res[k]
                    for k in (
                        "n",
                        "agree",
                        "near_tie",
                        "hard",
                        "served_accuracy",
                        "offline_accuracy",
                        "served_kv",
                        "offline_kv",
                        "max_kv_gap",
                        "kv_within_tolerance",
                    )
                }
            )
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
