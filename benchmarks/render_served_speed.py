"""Tables of the served-speed results (``serving/``): the merged workloads and their A/Bs, the
decode logs and server-log models behind them, and the CPU models of the scheduler's knee and reclaim."""

from __future__ import annotations

from collections import defaultdict

from benchmarks.prefill_log import RUNNING_BANDS
from benchmarks.report_format import cmd, cmds, f, table

# a served run's profiles (its field, the table's title, what a row's time is per), in the order shown
PROFILE_TABLES = (
    ("profile", "Decode step on the idle server", "step"),
    ("profile_under_load", "Decode step under the workload's load", "step"),
    ("profile_prefill", "Prefill chunk", "chunk"),
)
# the host events of a served profile (``served_profile.PROFILE_HOST``), as a table's caption says them
PROFILE_HOST_WORDS = {
    "stack": "CPU activities and Python stacks recorded too",
    "ops": "CPU activities recorded too, no Python stacks",
    "gpu": "GPU activities only",
}


def served_summary(d: dict) -> list[str]:
    """``serving/summary.json`` of ``served_report merge``: each WG-KV configuration against each
    upstream baseline measured beside it, then against the best of them."""
    rows = []
    for r in d["rows"]:
        against = r["baseline"] or "(none measured)"
        if r["baseline"] == "best":
            against = f"best ({r['best_of']})" if r.get("best_of") else "best (every baseline refused)"
        upstream = f(r["upstream"]) if r["upstream"] is not None else ""
        if r.get("upstream_refusal") and r["upstream"] is None:
            upstream = "refused: " + r["upstream_refusal"][:80].replace("|", "/")
        rows.append(
            [
                r["workload"] + (f" (TP={r['tp']})" if r.get("tp", 1) > 1 else ""),
                r["metric"],
                r["wgkv_config"],
                against,
                upstream,
                f(r["wgkv"]),
                f"{f(r['ratio'])}x" if r["ratio"] else "",
                r["goal"],
            ]
        )
    lines = [
        f"WG-KV against upstream SGLang, `python -m sglang.bench_serving` (ratio: {d['ratio']}; {d['best']}).",
        "",
    ]
    lines += table(
        ["workload", "metric", "WG-KV", "upstream", "upstream value", "WG-KV value", "ratio", "goal"], rows
    )
    seen = set()
    for r in d["rows"]:
        for server, c in r["command"].items():
            config = r["baseline"] if server == "upstream" else r["wgkv_config"]
            key = (r["workload"], server, c.get("server"), c.get("bench"))
            if r["baseline"] != "best" and key not in seen and c.get("bench"):
                seen.add(key)
                lines.append(
                    f"- {r['workload']} {server} {config}: server {cmd(c['server'])}; bench {cmd(c['bench'])}"
                )
    return lines + [""]


def load_tables(runs: dict) -> list[str]:
    """The runs' full prefill forwards under load by running requests (``prefill_under_load``'s
    ``by_running``) and their TTFT against the prompt's length (``ttft_by_length``), where recorded."""
    lines = []
    bands = {s: (r.get("prefill_under_load") or {}).get("by_running") for s, r in runs.items()}
    bands = {s: b for s, b in bands.items() if b}
    if bands:
        names = [label for label, *_ in RUNNING_BANDS if any(label in b for b in bands.values())]
        lines += [
            "",
            "Full prefill forwards while requests waited, prompt tokens a second (median, forwards):",
            "",
        ]
        lines += table(
            ["server"] + [f"{k} running" for k in names],
            [
                [s] + [f"{f(b[k]['median'], 0)} ({b[k]['forwards']})" if k in b else "" for k in names]
                for s, b in bands.items()
            ],
        )
    fits = {s: r["ttft_by_length"] for s, r in runs.items() if r.get("ttft_by_length")}
    if fits:
        lines += [
            "",
            "TTFT against the prompt's length (least squares over the requests; medians by third):",
            "",
        ]
        lines += table(
            ["server", "ms a request", "ms per 1K prompt tokens", "thirds: prompt tokens, median TTFT ms"],
            [
                [
                    s,
                    t["fixed_ms"],
                    t["per_1k_tokens_ms"],
                    "; ".join(
                        f"{a}-{b}: {m['median_ttft_ms']}" for m in t["thirds"] for a, b in [m["input_len"]]
                    ),
                ]
                for s, t in fits.items()
            ],
        )
    return lines


def served_workload(d: dict) -> list[str]:
    """``serving/W*.json``: one workload, both engines, with the decode profile where one was taken."""
    w = d["workload"]
    lines = [
        f"{w['id']}: {w['prompts']} x ({w['input_len']} + {w['output_len']}) tokens; goal: {w['goal']}.",
        "",
    ]
    rows = []
    # per profile kind (a run's field): each server's trace summary, and the host events they recorded
    profiles, hosts = defaultdict(dict), defaultdict(set)
    for server, run in d["runs"].items():
        r = run.get("result") or {}
        rows.append(
            [
                server,
                f(run.get("startup_s"), 0),
                run.get("max_total_num_tokens"),
                run.get("max_running_seen"),
                f((r.get("median_ttft_ms") or 0) / 1000 or None),
                f(r.get("median_tpot_ms")),
                f(r.get("output_throughput"), 1),
                (run.get("error") or run.get("refusal") or "")[:80].replace("|", "/"),
            ]
        )
        for kind, _, _ in PROFILE_TABLES:
            for summ in (run.get(kind) or {}).get("summary", []):
                profiles[kind][server] = summ
                hosts[kind].add(PROFILE_HOST_WORDS[run[kind].get("profile_host", "stack")])
    lines += table(
        [
            "server",
            "start s",
            "KV tokens (logical)",
            "max running",
            "TTFT p50 s",
            "TPOT p50 ms",
            "output tok/s",
            "error or refusal",
        ],
        rows,
    )
    machines = d.get("machines")
    if machines:
        lines += ["", f"Machines: {machines}."]
    lines += load_tables(d["runs"])
    for kind, what, unit in PROFILE_TABLES:
        got = profiles[kind]
        if got:
            names = sorted(
                {k for p in got.values() for k in p.get("phase_us_per_step", {})},
                key=lambda k: -max(p.get("phase_us_per_step", {}).get(k, 0) for p in got.values()),
            )
            prow = [[k] + [f(p.get("phase_us_per_step", {}).get(k), 0) for p in got.values()] for k in names]
            prow += [
                ["GPU busy / idle"]
                + [
                    f"{f(p['gpu_busy_us_per_step'], 0)} / {f(p['gpu_idle_us_per_step'], 0)}"
                    for p in got.values()
                ]
            ]
            lines += [
                f"{what}, GPU time per phase (us per {unit}; torch profiler "
                f"over {next(iter(got.values()))['steps']} of them, {' / '.join(sorted(hosts[kind]))}):",
                "",
            ]
            lines += table(["phase"] + list(got), prow)
    return lines


def served_ab(d: dict) -> list[str]:
    """``served_report ab``: WG-KV server variants of one machine's hour, workload by workload, beside
    the upstream parts of that hour where given."""
    rows = []
    for r in d["ab_rows"]:
        vs = r.get("vs_best_upstream") or {}
        label = r["variant"] if r["variant"] != "default" else "(none: the served default then)"
        if r.get("result") is False:
            label += " (compiled while timed: no result)"
        rows.append(
            [
                label,
                r["workload"],
                f(r["ttft_s"]),
                f(r["tpot_ms"], 3),
                f(r.get("p99_tpot_ms"), 3),
                f(r.get("e2e_s")),
                f(r["output_tok_s"], 1),
                f(r["tpot_vs_default"], 3),
                f(vs.get("output_tok_s"), 3),
            ]
        )
    return (
        [
            f"{d['what']}. Command: {cmd(d['command'])}; {d['environment'].get('gpu') or 'CPU'}, "
            f"{d['environment'].get('date_utc')}.",
            "",
        ]
        + table(
            [
                "variant (extra server arguments)",
                "workload",
                "TTFT p50 s",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "e2e p50 s",
                "output tok/s",
                "default TPOT / TPOT",
                "tok/s vs best upstream",
            ],
            rows,
        )
        + ["Servers: " + cmds(list(dict.fromkeys(r["server_command"] for r in d["ab_rows"])), "; "), ""]
    )


def decode_log(d: dict) -> list[str]:
    """``benchmarks/decode_log_compare.py``: two server runs of one workload, decode interval by interval."""
    m = d["summary"]
    return [
        f"{d['what']}. Before: {d['before']}; after: {d['after']}. {d['note']} Command: {cmd(d['command'])}.",
        "",
    ] + table(
        [
            "intervals (kept / stalls)",
            "before median tok/s",
            "after median tok/s",
            "after / before median",
            "min",
            "max",
        ],
        [
            [
                f"{m['kept']} / {m['stalls']}",
                f(m["before_median_tok_s"], 0),
                f(m["after_median_tok_s"], 0),
                f(m["ratio_median"], 3),
                f(m["ratio_min"], 3),
                f(m["ratio_max"], 3),
            ]
        ],
    )


def served_model(d: dict) -> list[str]:
    """``benchmarks/served_model.py``: each engine's fitted costs, and the running batch's effect."""
    ref = d["reference"]
    out = [f"{d['what']}. {d['note']} Command: {cmd(d['command'])}.", ""]
    out += table(
        [
            "engine",
            "decode step a (ms)",
            "per running request b (ms)",
            "per prompt token g (us)",
            "measured tok/s",
            "measured median TPOT (ms)",
            "most running",
        ],
        [
            [
                e["engine"],
                f(e["fit"]["a_ms"], 2),
                f(e["fit"]["b_ms"], 3),
                f(1000 * e["fit"]["g_ms"], 1),
                f(e["measured"]["output_tok_s"], 0),
                f(e["measured"]["median_tpot_ms"], 1),
                e["measured"]["max_running_seen"],
            ]
            for e in d["engines"]
        ],
    )
    rows = []
    for name, v in d["against_reference"].items():
        rows.append(
            [
                name,
                f"{v['reference_running']}",
                f"{f(v['rate_at_reference_running'], 2)}x / {f(v['tpot_at_reference_running'], 2)}x",
                f(v["running_at_tpot_parity"], 0),
                f"{f(v['rate_at_tpot_parity'], 2)}x",
                f"{f(v['rate_limit'], 2)}x",
                f(1000 * v["g_ms_for_1p1x_at_parity"], 1),
                f"{f(v['running_at_knee'], 0)}: {f(v['rate_at_knee'], 2)}x / {f(v['tpot_at_knee'], 2)}x"
                if "running_at_knee" in v
                else "",
            ]
        )
    out += [""] + table(
        [
            "predicted, against " + ref,
            f"{ref}'s running",
            "tok/s / TPOT at that running",
            "running at TPOT parity",
            "tok/s there",
            "tok/s, no limit",
            "g (us) for 1.1x at parity",
            "running knee K={:g}: running, tok/s / TPOT".format(
                next(iter(d["against_reference"].values()), {}).get("knee", 0)
            ),
        ],
        rows,
    )
    return out + [""]


def decode_ab(d: dict) -> list[str]:
    """Two versions of the WG-KV decode, each on its own H200 against an upstream run on that machine
    (``machines``: one entry each): TPOT, profiled step and per-layer kernel times."""
    head = f"{d['what']}. Commands: {cmds(list(d['commands'].values()), '; ')}."
    rows = []
    for machine in d["machines"]:
        for w in ("W1", "W0"):
            rows.append(
                [
                    machine["code"],
                    w,
                    f(machine["upstream_tpot_ms"], 3),
                    f(machine[f"wgkv_{w}_tpot_ms"], 3),
                    f(machine["upstream_tpot_ms"] / machine[f"wgkv_{w}_tpot_ms"], 3),
                    f(machine["profile_median_gap_ms"][w], 3),
                    ", ".join(f"{k} {v}" for k, v in machine["per_layer_us"][w].items()),
                ]
            )
    return (
        [head, ""]
        + table(
            [
                "decode",
                "workload",
                "upstream TPOT ms",
                "WG-KV TPOT ms",
                "ratio",
                "profiled step ms",
                "per layer (us)",
            ],
            rows,
        )
        + ["", d["reading"], ""]
    )


def knee_sim(d: dict) -> list[str]:
    """``benchmarks/knee_sim.py``: a burst through the running knee's code on a simulated clock."""
    out = [f"{d['note']}. Command: {cmd(d['command'])}.", ""]
    out += table(
        [
            "variant",
            "mixed passes",
            "output tok/s",
            "median TPOT (ms)",
            "target (ms)",
            "median TTFT (s)",
            "most running",
        ],
        [
            [
                r["variant"],
                "yes" if r["mixed"] else "no",
                f(r["output_tok_s"], 0),
                f(r["median_tpot_ms"], 1),
                "-" if r["target_ms"] is None else f(r["target_ms"], 1),
                f(r["median_ttft_s"], 1),
                r["max_running"],
            ]
            for r in d["rows"]
        ],
    )
    return out


def reclaim_syncs(d: dict) -> list[str]:
    """``benchmarks/reclaim_syncs.py``: host syncs of the prefix cache's reclaim on a pool full of
    snapshots, counted on CPU."""
    shape = d["shape"]
    out = [
        f"Rounds of {shape['per_round']} admissions of {shape['prompt']}-token prompts sharing nothing, "
        f"{shape['running']} running, {shape['pages']} pages. Command: {cmd(d['command'])}.",
        "",
    ]
    return (
        out
        + table(
            ["variant", "admissions", "host syncs", "syncs per admission", "snapshots dropped", "left"],
            [
                [
                    r["variant"],
                    r["admissions"],
                    r["host_syncs"],
                    f(r["syncs_per_admission"]),
                    r["snapshots_dropped"],
                    r["snapshots_left"],
                ]
                for r in d["rows"]
            ],
        )
        + [""]
    )
