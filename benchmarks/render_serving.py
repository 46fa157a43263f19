"""Tables of the serving results (``serving/``, ``constrained/``, ``reliability/``), one renderer per kind."""

from __future__ import annotations

from benchmarks.report_format import cmd, cmds, f, table


def serving_throughput(d: dict) -> list[str]:
    w = d["workload"]
    lines = [
        f"{d['label']}: {w['num_requests']} requests x ({w['prompt_tokens']} prompt + {w['output_tokens']} output "
        f"tokens), `--mem-fraction-static {w['mem_fraction_static']}`.",
        "",
    ]
    for name, run in d["runs"].items():
        if "command" in run:
            lines.append(f"{name}: {cmd(run['command'])}")
    lines.append("")
    rows = [
        [
            name,
            s["max_total_num_tokens"],
            s["max_running_seen"],
            f(s["output_tok_s"], 1),
            f"{f(s['ttft_p50_s'], 1)} / {f(s['ttft_p99_s'], 1)}",
            f"{f(s['tpot_p50_s'], 0, 1e-3)} / {f(s['tpot_p99_s'], 0, 1e-3)}",
            f(s["wall_s"], 1),
        ]
        for name, s in d["summary"].items()
    ]
    lines += table(
        [
            "server",
            "KV tokens (logical)",
            "max running seen",
            "output tok/s",
            "TTFT p50 / p99 s",
            "TPOT p50 / p99 ms",
            "wall s",
        ],
        rows,
    )
    if d.get("wgkv_over_upstream_output_tok_s"):
        lines += [f"WG-KV / upstream output tokens/s: {f(d['wgkv_over_upstream_output_tok_s'])}x.", ""]
    return lines


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


def served_workload(d: dict) -> list[str]:
    """``serving/W*.json``: one workload, both engines, with the decode profile where one was taken."""
    w = d["workload"]
    lines = [
        f"{w['id']}: {w['prompts']} x ({w['input_len']} + {w['output_len']}) tokens; goal: {w['goal']}.",
        "",
    ]
    rows, phases, loaded, prefill = [], {}, {}, {}
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
        for summ in (run.get("profile") or {}).get("summary", []):
            phases[server] = summ
        for summ in (run.get("profile_under_load") or {}).get("summary", []):
            loaded[server] = summ
        for summ in (run.get("profile_prefill") or {}).get("summary", []):
            prefill[server] = summ
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
    for what, got in (
        ("Decode step on the idle server", phases),
        ("Decode step under the workload's load", loaded),
        ("Prefill chunk", prefill),
    ):
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
                f"{what}, GPU time per phase (us per {'chunk' if got is prefill else 'step'}; torch profiler "
                f"over {next(iter(got.values()))['steps']} of them, CPU activities recorded too):",
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


def logprob_floor(d: dict) -> list[str]:
    """``benchmarks/logprob_floor.py``: each serving path against float32 (along its own tokens), and
    each pair of paths' greedy logprobs, prompt by prompt."""
    out = [f"Command: {cmd(d['command'])}; {d['environment'].get('gpu') or 'CPU'}.", ""]
    if "float32" in d:
        rows = [
            [name, i, f"{r['max_abs']:.3f} @ {r['at']}", f(r["mean_abs"], 4)]
            for name, rs in d["float32"].items()
            for i, r in enumerate(rs)
        ]
        out += [f"Against float32: {d['truth']}.", ""] + table(
            ["server", "prompt", "max abs logprob diff @ token", "mean abs"], rows
        )
    rows = [
        [
            pair.replace("~", " vs "),
            i,
            "" if r["first_divergence"] is None else r["first_divergence"],
            f"{r['max_abs']:.3f} @ {r['at']}",
            f(r["mean_abs"], 3),
        ]
        for pair, rs in d["pairs"].items()
        for i, r in enumerate(rs)
    ]
    return (
        out
        + ["Pairs, up to and including the first differing greedy token:", ""]
        + table(["pair", "prompt", "first differing token", "max abs logprob diff @ token", "mean abs"], rows)
    )


def serving_memory(d: dict) -> list[str]:
    m, srv = d["machine"], d.get("server", {})
    gpu = "peak_gpu_used_bytes" in d
    phases = [
        [
            name,
            "yes" if p.get("ok", True) else f"no: {p.get('detail')}",
            p.get("seconds", ""),
            f(p["peak_rss_bytes"], 2, 1 << 30),
        ]
        + ([f(p.get("peak_gpu_used_bytes"), 2, 1 << 30)] if gpu else [])
        for name, p in d["phases"].items()
    ]
    gpu_text = (
        (
            f" Peak GPU memory used {f(d['peak_gpu_used_bytes'], 2, 1 << 30)} of "
            f"{f(m['gpu_total_bytes'], 1, 1 << 30)} GiB ({d['peak_gpu_fraction']:.1%})."
        )
        if gpu
        else ""
    )
    return [
        f"{d['label']}: {cmd(d['command'])} on {m['cpus']} CPUs, RAM {f(m['mem_total_bytes'], 1, 1 << 30)} GiB "
        f"({f(m['mem_available_at_start_bytes'], 1, 1 << 30)} GiB available at start). KV tokens "
        f"{srv.get('max_total_num_tokens')}, request slots {srv.get('max_running_requests')}. Peak RSS of the "
        f"process tree {f(d['peak_rss_bytes'], 2, 1 << 30)} GiB ({d['peak_rss_fraction_of_ram']:.0%} of RAM);"
        f"{gpu_text} survived: {d['survived']}." + (f" Note: {d['note']}" if d.get("note") else ""),
        "",
    ] + table(["phase", "ok", "seconds", "peak RSS GiB"] + (["peak GPU GiB"] if gpu else []), phases)


def constrained_programs(d: dict) -> list[str]:
    """``constrained/*.json`` of ``benchmarks/constrained_programs.py``: outcome per program and server
    (ok; answer: mechanics fine, the model's answer wrong; error)."""
    servers = [r["server"] for r in d["runs"]]
    rows = [[prog] + [outcomes.get(srv, "") for srv in servers] for prog, outcomes in d["table"].items()]
    alive = ", ".join(f"{r['server']} alive after: {r.get('alive_after')}" for r in d["runs"])
    return [
        f"Command: {cmd(d['environment']['command'])}; {d['max_new_tokens']} new tokens per generation; {alive}.",
        "",
    ] + table(["program"] + servers, rows)


def soak(d: dict) -> list[str]:
    """``sglang_wgkv/testing/soak.py``: mixed jobs against one server, idle-checked pool at every checkpoint."""
    c = d["config"]
    head = (
        f"Command: {cmd(d.get('command') or '')}. {d['jobs']} jobs ({c['concurrency']} at once), "
        f"{d['http_requests']} HTTP requests in {f(d['wall_s'], 0)} s ({f(d['jobs_per_s'], 3)} jobs/s); "
        f"{len(d['checkpoints'])} idle-checked checkpoints; retractions {d.get('retractions')}; greedy probe "
        f"unchanged: {d['probe_equal']}; failures: {len(d['failures'])}."
        + (f" {d['note']}" if d.get("note") else "")
    )
    secs = d.get("mean_job_s") or {}
    rows = [[k, n, f(secs.get(k), 2)] for k, n in d["counts"].items()]
    return [head, ""] + table(["job kind", "count", "mean s"], rows)


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


def cpu_decode_threads(d: dict) -> list[str]:
    env = d.get("env", {})
    rows = [
        [
            r["batch"],
            r["cached_tokens"],
            r["kv_tokens"],
            f(r["torch_threads_ms_step"], 1),
            f(r["one_thread_ms_step"], 1),
            f(r["torch_threads_ms_step"] / r["one_thread_ms_step"], 2),
        ]
        for r in d["rows"]
    ]
    return [
        f"{cmd(d['command'])} on {d.get('cpus')} CPUs, OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY')}, "
        f"torch threads {env.get('torch_threads')}: one decode step's attention layers of the embedded "
        f"model's shape on the CPU path (mean of {d['steps']} steps):",
        "",
        *table(
            ["requests", "cached tokens", "KV tokens", "ms, torch's threads", "ms, one thread", "speed-up"],
            rows,
        ),
    ]


def cpu_dtype(d: dict) -> list[str]:
    env = d.get("env", {})
    lin = d["linear_ms_per_layer"]
    rows = [[name, f(ms, 1), f(ms / lin["float32"], 2)] for name, ms in lin.items()]
    out = [
        f"{cmd(d['command'])} on {d.get('cpus')} CPUs, torch {env.get('torch')} "
        f"(half-precision matmul units: {d['cpu_half_matmul']}). One layer's linear maps of the embedded "
        f"model at {d['rows']} tokens:",
        "",
        *table(["dtype", "ms a layer", "vs float32"], rows),
    ]
    served = d.get("served") or {}
    if served:
        phases = list(next(iter(served.values()))["phase_s"])
        out += [
            "",
            "The README's serve command in each dtype (`benchmarks/serving_memory.py`'s phases, seconds):",
            "",
            *table(
                ["command", "start-up s", *phases, "KV tokens", "peak RSS GiB", "all phases ok"],
                [
                    [cmd(s["command"]), s["startup_s"], *(s["phase_s"].get(p) for p in phases)]
                    + [s["kv_tokens"], f(s["peak_rss_bytes"], 2, 1 << 30), s["phases_ok"] and s["survived"]]
                    for s in served.values()
                ],
            ),
        ]
    return out
