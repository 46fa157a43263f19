"""Tables of the accuracy and gate-training results (``accuracy/``), one renderer per kind."""

from __future__ import annotations

from benchmarks.report_format import cmd, cmds, f, table


def eval_summary(d: dict) -> list[str]:
    c = d["config"]
    lines = [
        f"{d.get('note', '')} tau {c['tau']}, W_local {c['local_window']}, {c.get('gpu') or c['device']}, "
        f"{c['dtype']}; complete: {d['complete']}. Over all lengths (per-length rows in the file):",
        "",
    ]
    rows = [
        [
            s["eval"],
            s["method"],
            s.get("lam") or "",
            s["n"],
            f(s["kv_fraction"], 3),
            f(s.get("accuracy"), 3),
            f(s.get("answer_nll") if "answer_nll" in s else s.get("nll"), 3),
        ]
        for s in d["summary"]
        if s.get("length") is None
    ]
    return lines + table(["eval", "method", "lambda", "n", "KV fraction", "accuracy", "NLL"], rows)


def offline_accuracy(d: dict) -> list[str]:
    """evals.summary: one row per method at equal memory, with the full cache's values."""
    r0 = d["rows"][0]
    lines = [
        f"Full cache: NLL {f(r0['full_nll'], 4)}, passkey {f(r0['full_passkey'], 3)}, multi-key NIAH "
        f"{f(r0['full_niah_mk'], 3)}; complete: {d.get('complete')}.",
        "",
    ]
    rows = [
        [
            r["method"],
            r.get("lam") or "",
            r["n"],
            f(r["kv_fraction"], 3),
            f(r["nll"], 4),
            f(r["passkey"], 3),
            f(r["niah_mk"], 3),
            f(r.get("passkey_answer_nll"), 3),
            f(r.get("niah_mk_answer_nll"), 3),
        ]
        for r in d["rows"]
    ]
    return lines + table(
        [
            "method",
            "lambda",
            "n",
            "KV fraction",
            "NLL",
            "passkey",
            "NIAH-mk",
            "passkey answer NLL",
            "NIAH answer NLL",
        ],
        rows,
    )


def head_budgets(d: dict) -> list[str]:
    """evals.head_budgets: what WG-KV's per-head budgets keep against an equal budget."""
    r, more, less = (
        d["mass_weighted_recall"],
        d["heads_where_wgkv_keeps_more"],
        d["heads_where_wgkv_keeps_less"],
    )
    rows = [
        ["WG-KV keeps more", more["count"], f(more["mean_old_mass"], 3), f(more["mean_recall_gain"], 3)],
        ["WG-KV keeps less", less["count"], f(less["mean_old_mass"], 3), f(less["mean_recall_gain"], 3)],
    ]
    return [
        f"Command: {cmd(d['command'])}. Samples: {', '.join(d['samples'])}. Mass-weighted recall of older-key "
        f"attention: WG-KV {f(r['wgkv'], 3)}, equal budget {f(r['equal_budget'], 3)}; correlation of the "
        f"gate's per-head budget with the head's older-key attention {f(d['corr_wgkv_kept_vs_old_mass'], 2)}.",
        "",
    ] + table(["heads", "count", "older-key attention", "recall WG-KV - equal"], rows)


def training(d: dict) -> list[str]:
    v = d["final_validation_4k_heldout"]
    rows = [
        [
            lam,
            f(v["kv_fraction"][i], 3),
            f(v["global_fraction"][i], 3),
            f(v["soft_mse"][i], 4),
            f(v["hard_mse"][i], 4),
        ]
        for i, lam in enumerate(d["lams"])
    ]
    return [
        f"{d['what']}; {d['device']}. Command: {cmd(d['command'])}. {d['steps']} steps, {d['tokens_seen']} "
        f"tokens; shipped: lambda {d['shipped']['lam']} ({d['shipped']['path']}). Held-out 4K validation:",
        "",
    ] + table(["lambda", "KV fraction", "global fraction", "soft MSE", "hard MSE"], rows)


def train_speed(d: dict) -> list[str]:
    """``benchmarks/train_speed.py``: seconds per step of the gate trainer per backend and checkpointing."""
    rows = [
        [
            r["backend"],
            "on" if r["grad_checkpoint"] else "off",
            f(r.get("seconds_per_step"), 3),
            f(r.get("tokens_per_s_all_lambdas"), 0),
            f(r.get("minutes_for_2000_steps"), 1),
            f(r.get("peak_gib"), 1),
            "yes" if r.get("meets_goal") else ("no" if "error" not in r else r["error"][:60]),
        ]
        for r in d["runs"]
    ]
    return [
        f"{d['what']}; {d['model']}, {len(d['lams'])} lambda values per step, {d['seq_len']} tokens, "
        f"{d.get('gpu', 'CPU')}. Goal: {d['goal']}. Command: {cmds(d['command'], '; ')}.",
        "",
    ] + table(
        [
            "backend",
            "grad checkpoint",
            "s/step",
            "tok/s (all lambda)",
            "min / 2000 steps",
            "peak GiB",
            "meets goal",
        ],
        rows,
    )


def accuracy_summary(d: dict) -> list[str]:
    """``accuracy/summary.json``: one row per (method, budget, engine), offline (evals.summary --into:
    NLL, passkey, NIAH-mk) and served (evals.served: accuracy over the served set) side by side; each
    value with the full cache's on the same samples."""

    def vs(r, key, full_key, digits=3):
        v = r.get(key)
        return "" if v is None else f"{f(v, digits)} ({f(r.get(full_key), digits)})"

    rows = [
        [
            r.get("method"),
            r.get("lam") or "",
            r.get("budget") or "",
            r.get("engine") or "",
            r.get("n", ""),
            f(r.get("kv_fraction"), 3),
            vs(r, "nll", "full_nll", 4),
            vs(r, "passkey", "full_passkey"),
            vs(r, "niah_mk", "full_niah_mk"),
            vs(r, "accuracy", "full_accuracy"),
        ]
        for r in d["rows"]
    ]
    return ["Each value with the full cache's on the same samples in parentheses.", ""] + table(
        [
            "method",
            "lambda",
            "budget",
            "engine",
            "n",
            "KV fraction",
            "NLL",
            "passkey",
            "NIAH-mk",
            "served accuracy",
        ],
        rows,
    )


def served_accuracy(d: dict) -> list[str]:
    """``evals/served.py`` per-sample results: accuracy per configuration."""
    rows = [
        [
            r["method"],
            r["budget"] or "",
            len(r["rows"]),
            f(sum(x["correct"] for x in r["rows"]) / len(r["rows"]), 3),
            f(sum(x["kv_fraction"] for x in r["rows"]) / len(r["rows"]), 3),
            f(r["seconds"], 0),
        ]
        for r in d["results"]
    ]
    head = f"Engine {d['engine']}" + (
        f"; command: {cmds(d['command'], '; command: ')}" if d.get("command") else ""
    )
    return [head + (f". {d['note']}" if d.get("note") else ""), ""] + table(
        ["method", "budget", "n", "accuracy", "KV fraction", "request seconds"], rows
    )


def aime_runs(d: dict) -> list[str]:
    """``evals/aime25.py`` reports, one per server configuration (long generation, eviction counters)."""
    rows = []
    for name, run in d["runs"].items():
        r = run["report"]
        tokens = [s["completion_tokens"] for s in r["samples"]]
        rows.append(
            [
                name,
                cmd(run["server"]),
                len(tokens),
                f(r["mean_completion_tokens"], 1),
                max(tokens),
                f(r["mean_eviction_triggers"], 3),
                max(s["eviction_triggers"] or 0 for s in r["samples"]),
                f(r["mean_kv_tokens_per_head"], 1),
                r["truncated"],
                r["errors"],
                f(r["accuracy"], 3),
            ]
        )
    client = cmd(next(iter(d["runs"].values()))["client"])
    return [f"{d['what']}. Client: {client}.", ""] + table(
        [
            "run",
            "server",
            "samples",
            "mean tokens",
            "max tokens",
            "mean eviction triggers",
            "max triggers",
            "mean KV tokens/head",
            "truncated",
            "errors",
            "accuracy",
        ],
        rows,
    )


def trigger_runs(d: dict) -> list[str]:
    """Served runs of one configuration before/after a change: accuracy and samples evicted twice."""
    rows = [
        [name, run["commit"], len(run["rows"]), f(run["accuracy"], 3), run["two_trigger_samples"]]
        for name, run in d["runs"].items()
    ]
    commands = cmds([run["command"] for run in d["runs"].values()], "; ")
    return [f"{d['what']} Commands: {commands}.", ""] + table(
        ["run", "commit", "samples", "accuracy", "samples with 2+ eviction triggers"], rows
    )


def prompt_window(d: dict) -> list[str]:
    """``evals.prompt_window``: the evictor's prompt-end scoring (observation window : kernel @ budget)
    against the full cache, offline, per run."""
    out = []
    for run in d["runs"]:
        tasks = sorted({t["task"] for t in run["summary"]}, key=lambda t: (t == "all", t))
        policies = list(dict.fromkeys(t["policy"] for t in run["summary"]))
        by = {(t["policy"], t["length"], t["task"]): t for t in run["summary"]}
        lengths = sorted({t["length"] for t in run["summary"]})
        rows = [
            [pol, L]
            + [f"{by[pol, L, t]['correct']}/{by[pol, L, t]['n']}" if (pol, L, t) in by else "" for t in tasks]
            for L in lengths
            for pol in policies
        ]
        out += [f"Command: {cmd(run['command'])}; {run['model']}.", ""] + table(
            ["policy", "length", *tasks], rows
        )
    return out


def agreement(d: dict) -> list[str]:
    """``evals.agreement``: the served engine against the offline harness, sample by sample."""
    rows = [
        [
            p["served"],
            p["offline"] + (f"@{p['lam']}" if p.get("lam") is not None else ""),
            p["n"],
            p["agree"],
            p["near_tie"],
            p["hard"],
            f(p["served_accuracy"], 3),
            f(p["offline_accuracy"], 3),
            f(p["served_kv"], 3),
            f(p["offline_kv"], 3),
            f(p["max_kv_gap"], 4),
            p["kv_within_tolerance"],
        ]
        for p in d["pairs"]
    ]
    return [
        f"Command: {cmd(d['command'])}; served: {cmds(d['served_command'], ' then ')}; offline: "
        f"{cmds(d['offline_command'], ' then ')}. Near-tie: the offline answer margin within {d['near_tie']} logits; "
        "served KV is the prompt's share (generated tokens discounted).",
        "",
    ] + table(
        [
            "served",
            "offline",
            "n",
            "agree",
            "near-tie",
            "hard",
            "served acc",
            "offline acc",
            "served KV",
            "offline KV",
            "max KV gap",
            "KV within bound",
        ],
        rows,
    )
