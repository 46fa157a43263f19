"""The served evictor's prompt-end scoring, offline: which observation window and pooling kernel keep
what the question needs (issue 18).

For each RULER-style sample (the served set, :mod:`evals.ruler`), one forward per policy
(:mod:`evals.harness`): the full cache, and :class:`evals.policies.ServedPromptEnd` (dense prefill, then
the ring plus the ``B - lead`` keys the evictor's own scoring ranks highest, as ``--kv-budget B`` with
admission off compresses at the prompt's end) for every ``--settings`` entry ``obs:kernel@B``.
``correct``: greedy decoding, teacher-forced, emits exactly the answer (as :mod:`evals.run`); ``nll``:
the answer's mean NLL.

CLI::

    python -m evals.prompt_window --ruler evals/data/ruler_2k_8k.json.gz --lengths 2048 --samples 8 \\
        --settings 256:5@1024,32:7@1024,32:13@1024,32:13@512 --out benchmarks/results/accuracy/prompt_window.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from evals.harness import policy_forward
from evals.policies import FullCache, ServedPromptEnd
from evals.ruler import load_samples
from evals.run import answer_scores
from sglang_wgkv.config import DEFAULT_LOCAL_WINDOW, WGKVConfig
from sglang_wgkv.training.backbone import load_backbone


def parse_setting(text: str) -> tuple[int, int, int]:
    """``obs:kernel@budget`` -> (obs, kernel, budget)."""
    head, budget = text.split("@")
    obs, kernel = head.split(":")
    return int(obs), int(kernel), int(budget)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ruler", required=True)
    p.add_argument("--lengths", default="2048")
    p.add_argument("--tasks", default="passkey,niah_multikey")
    p.add_argument("--samples", type=int, default=8, help="at most this many per (task, length)")
    p.add_argument("--settings", default="256:5@1024,32:7@1024,32:13@1024,32:13@512")
    p.add_argument("--local-window", type=int, default=DEFAULT_LOCAL_WINDOW)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    command = shlex.join(["python", "-m", "evals.prompt_window", *(sys.argv[1:] if argv is None else argv)])
    samples = load_samples(a.ruler, a.samples, a.lengths, a.tasks)
    settings = [parse_setting(x) for x in a.settings.split(",")]
    names = ["full"] + [f"{o}:{k}@{b}" for o, k, b in settings]
    policies = [FullCache()] + [
        ServedPromptEnd(b - WGKVConfig(kv_budget=b).evictor_lead, o, k, a.local_window)
        for o, k, b in settings
    ]
    backbone = load_backbone("embedded")
    rows = []
    for s in samples:
        prompt, answer = list(s["prompt"]), list(s["answer"])
        P = len(prompt)
        t0 = time.monotonic()
        # one policy per forward: a 4K prompt's float32 scores of one policy are ~2 GB on CPU
        hidden, _ = policy_forward(backbone, torch.tensor(prompt + answer), policies, P, max_batch_tokens2=1)
        correct, nll, _ = answer_scores(backbone, hidden, P, answer)
        for name, c, n in zip(names, correct, nll):
            rows.append(
                {
                    "task": s["task"],
                    "length": int(s["length"]),
                    "index": int(s["index"]),
                    "policy": name,
                    "correct": c,
                    "answer_nll": round(n, 4),
                }
            )
        print(
            s["task"],
            s["length"],
            s["index"],
            f"{time.monotonic() - t0:.0f}s",
            " ".join(f"{n}={'ok' if c else 'miss'}" for n, c in zip(names, correct)),
            flush=True,
        )
    summary = defaultdict(lambda: {"correct": 0, "n": 0})
    for r in rows:
        for key in ((r["policy"], r["length"], r["task"]), (r["policy"], r["length"], "all")):
            summary[key]["correct"] += r["correct"]
            summary[key]["n"] += 1
    table = [
        {"policy": k[0], "length": k[1], "task": k[2], **v, "accuracy": v["correct"] / v["n"]}
        for k, v in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][2], names.index(kv[0][0])))
    ]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(out.read_text()) if out.exists() else {"runs": []}
    prev["runs"] = [r for r in prev["runs"] if r["command"] != command] + [
        {
            "command": command,
            "model": "embedded SmolLM2-135M-Instruct (float32, CPU)",
            "summary": table,
            "rows": rows,
        }
    ]
    out.write_text(json.dumps(prev, indent=1) + "\n")
    for t in table:
        if t["task"] == "all":
            print(json.dumps(t))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
