"""Generate ``benchmarks/results/SUMMARY.md`` from the JSON files under ``benchmarks/results/``.

    python -m benchmarks.summary            # rewrite SUMMARY.md
    python -m benchmarks.summary --check    # exit 1 if SUMMARY.md is not what the JSON files give

Every number in the summary is read from a JSON file written by a benchmark (its command, device and
versions are in the file); every ratio divides two numbers of one run. Commands are shown with
machine paths replaced (``OUT`` for an output folder, repository-relative paths, ``python``).
One table per file and kind; a kind this script does not know is listed by name only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = (
    ("paper_fig8", "Fig. 8 protocol end to end (paper_fig8/)"),
    ("kernels", "Kernels (kernels/)"),
    ("serving", "Serving (serving/)"),
    ("accuracy", "Accuracy and gate training (accuracy/)"),
    ("constrained", "SGLang's frontend programs, constrained decoding (constrained/)"),
    ("reliability", "Reliability: mixed-request soaks (reliability/)"),
)
_REPO_DIRS = ("launch/", "benchmarks/", "sglang_wgkv/", "evals/", "tests/")


def clean_path(token: str) -> str:
    """A command token with machine paths replaced (see the module docstring)."""

    def one(m: re.Match) -> str:
        path = m.group(0)
        if "SmolLM2-135M-Instruct" in path:
            return "EMBEDDED_MODEL"
        for d in _REPO_DIRS:
            if "/" + d in path:
                return d + path.split("/" + d, 1)[1]
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if re.fullmatch(r"python[0-9.]*", name):
            return "python"
        if re.search(r"/(out|\.device/\d+)(/|$)", path):
            return "OUT/" + name if name not in ("out", "") and not name.isdigit() else "OUT"
        return "<" + name + ">"

    return re.sub(r"(?<![\w.])/(?:[\w.@+-]+/?)+", one, token)


def cmd(text: str) -> str:
    return "`" + clean_path(text) + "`"


def cmds(x, sep: str) -> str:
    """One command or a list of them (a result of several runs), each cleaned, joined by ``sep``."""
    return sep.join(cmd(c) for c in ([x] if isinstance(x, str) else x or []))


def f(x, digits=2, unit_div=1.0) -> str:
    return "" if x is None else f"{x / unit_div:.{digits}f}"


def gb(x) -> str:
    return f(x, 1, 1e9)


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


# -- one renderer per kind of JSON ---------------------------------------------------------------
def fig8(d: dict) -> list[str]:
    p = d["protocol"]
    lines = [
        f"Command: {cmd(d['env']['command'])}; {d['env'].get('gpu')}. {p['layers']} layers, Hq {p['q_heads']}, "
        f"Hkv {p['kv_heads']}, D {p['head_dim']}, {p['dtype']}, batch {p['batch']}, W_local "
        f"{p['local_window']}, admission: {p['admission']}; decode {p['decode_steps']} steps"
        f"{' under CUDA graphs' if p.get('cuda_graph_decode') else ''}.",
        "",
    ]
    columns = d.get("columns") or ["wgkv", "dense"]
    header = ["N"] + [f"{c} {m}" for c in columns for m in ("TTFT s", "TPOT ms", "peak GB", "KV used GB")]
    header += ["TTFT speedup", "TPOT speedup", "KV ratio"]
    rows = []
    for r in d["lengths"]:
        row = [r["n"]]
        for c in columns:
            e = r.get(c) or {}
            if "skipped" in e:
                row += [e["skipped"], "", "", ""]
            else:
                row += [
                    f(e.get("ttft_s"), 1),
                    f(e.get("tpot_ms")),
                    gb(e.get("peak_memory_bytes")),
                    gb(e.get("kv_used_bytes")),
                ]
        ratios = r.get("ratios") or {}
        row += [
            f(ratios.get("ttft_speedup")) + ("x" if "ttft_speedup" in ratios else ""),
            f(ratios.get("tpot_speedup")) + ("x" if "tpot_speedup" in ratios else ""),
            f(ratios.get("kv_bytes_ratio"), 3),
        ]
        rows.append(row)
    return lines + table(header, rows)


def kernel_decode(d: dict) -> list[str]:
    s = d["shape"]
    lines = [
        f"Command: {cmd(d['env']['command'])}; {d['env'].get('gpu')}. One layer: Hq {s['Hq']}, Hkv {s['Hkv']}, "
        f"D {s['head_dim']}, {s['dtype']}; CUDA-graph replay; TB/s = K+V bytes read / time.",
        "",
    ]
    # Files from before the fused merge have one Triton row (two launches per layer then, named triton).
    two = any("triton_two_launch" in fo for r in d["decode"] for fo in r["folded"])
    rows = []
    for r in d["decode"]:
        dense = r["dense_flashinfer"]
        for fo in r["folded"]:
            fi, tr = fo.get("folded_flashinfer", {}), fo.get("triton", {})
            rows.append(
                [
                    r["batch"],
                    r["n"],
                    f(dense["ms"], 3),
                    f(dense["tbps"]),
                    f(fo["rejection"]),
                    f(fo["kv_bytes_vs_dense"], 3),
                    f(fi.get("ms"), 3),
                    f(fi.get("tbps")),
                    f(tr.get("ms"), 3),
                    f(tr.get("tbps")),
                    f(tr.get("speedup_vs_dense_flashinfer")) + "x",
                ]
                + ([f(fo.get("triton_two_launch", {}).get("ms"), 3)] if two else [])
            )
    lines += table(
        [
            "batch",
            "N",
            "dense FlashInfer ms",
            "TB/s",
            "rejection",
            "KV vs dense",
            "FlashInfer folded ms",
            "TB/s",
            "Triton folded ms",
            "TB/s",
            "Triton vs dense",
        ]
        + (["Triton 2-launch ms"] if two else []),
        rows,
    )
    sweep = d.get("sweep")
    if sweep:
        b = sweep["best"]
        lines += [
            f"Launch sweep at N {sweep['n']}, rejection {sweep['rejection']}: best block_n {b['block_n']}, "
            f"{b['num_warps']} warps, {b['num_stages']} stages, {b['splits']} splits: "
            f"{f(b['ms_per_layer'], 4)} ms, {f(b['tbps'])} TB/s.",
            "",
        ]
    return lines


def decode_fixed_cost(d: dict) -> list[str]:
    """``decode_fixed_cost.py``: per-layer time of each decode variant by length, the fit
    ``fixed + bytes / bandwidth`` and the split sweep at the W1 length."""
    s = d["shape"]
    lines = [
        f"Command: {cmd(d['command'])}; {d['env'].get('gpu')}. Batch {s['batch']}, Hq {s['Hq']}, Hkv {s['Hkv']}, "
        f"D {s['head_dim']}, W_local {s['local_window']}, rejection {s['rejection']}; us per layer under "
        f"CUDA-graph replay, {d['default_splits']} splits.",
        "",
    ]
    rows = [r for r in d["by_length"] if "ms_per_layer" in r]
    names = list(rows[0]["ms_per_layer"]) if rows else []
    lines += table(
        ["N", "KV MB per layer"] + names,
        [
            [r["n"], f(r["kv_bytes_per_layer"] / 1e6, 1)] + [f(r["ms_per_layer"][k] * 1e3, 1) for k in names]
            for r in rows
        ],
    )
    lines += table(
        ["variant", "fixed us per launch", "marginal TB/s"],
        [[k, f(v["fixed_us"], 2), f(v["tbps_marginal"] / 1e3, 2)] for k, v in d["fit"].items()],
    )
    if d.get("empty_ms_per_layer") is not None:
        lines += [
            f"Empty launch (one token per stream): {f(d['empty_ms_per_layer'] * 1e3, 2)} us per layer.",
            "",
        ]
    if d.get("splits_sweep"):
        lines += table(
            ["splits (W1 length, fused write)", "us per layer", "TB/s"],
            [[r["splits"], f(r["ms_per_layer"] * 1e3, 1), f(r["tbps"])] for r in d["splits_sweep"]],
        )
    if d.get("configs"):
        c = d["configs"]
        lines += table(
            ["launch shape (fused write)", "splits", "us per layer at W1", "fixed us", "marginal TB/s"],
            [
                [
                    f"`{r['spec']}`" if r["spec"] else "default",
                    r["splits"],
                    f(r["w1_ms_per_layer"] * 1e3, 1) if r["w1_ms_per_layer"] is not None else "-",
                    f(r["fit"]["fixed_us"], 2) if r["fit"] else "-",
                    f(r["fit"]["tbps_marginal"] / 1e3, 2) if r["fit"] else "-",
                ]
                for r in c["rows"]
            ],
        )
        lines += [
            f"Best beating the default by {c['min_gain']:.0%} at the W1 length: "
            f"{('`' + c['best'] + '`') if c['best'] else 'none'}.",
            "",
        ]
    return lines


def kernel_attention(d: dict) -> list[str]:
    lines = [f"Command: {cmd(d['env']['command'])}; {d['env'].get('gpu')}.", ""]
    rows = []
    for r in d.get("prefill", []):
        if "skipped" in r:
            rows.append([r["n"], f"skipped ({r['skipped']})"] + [""] * 8)
            continue
        fa3, sdpa = r.get("flashinfer_fa3", {}), r.get("torch_sdpa_flash", {})
        for w in r["wgkv_triton"]:
            rows.append(
                [
                    r["n"],
                    f(fa3.get("ms"), 1),
                    f(sdpa.get("ms"), 1),
                    f(w["rejection"]),
                    f(w["plan_ms"]),
                    f(w["compact_ms"]),
                    f(w["kernel_ms"], 1),
                    f(w["total_ms"], 1),
                    f(w.get("speedup_vs_torch_sdpa_flash")) + "x",
                    f(w["tflops_useful"], 0),
                ]
            )
    if rows:
        lines += ["Prefill (vertical-slash Triton kernel), one layer:", ""]
        lines += table(
            [
                "N",
                "FA3 ms",
                "SDPA ms",
                "rejection",
                "plan ms",
                "compact ms",
                "kernel ms",
                "total ms",
                "total vs SDPA",
                "useful TFLOP/s",
            ],
            rows,
        )
    rows = []
    for r in d.get("decode", []):
        dense, sdpa = r["dense_flashinfer"]["graph"], r.get("dense_torch_sdpa", {})
        for w in r["wgkv_folded_flashinfer"]:
            g = w["graph"]
            rows.append(
                [
                    r["n"],
                    f(dense["ms_per_layer"], 3),
                    f(dense["tbps"]),
                    f(sdpa.get("ms_per_layer"), 3),
                    f(w["rejection"]),
                    f(g["ms_per_layer"], 3),
                    f(g["tbps"]),
                    f(g["speedup_vs_dense_flashinfer"]) + "x",
                    f(w["kv_bytes_vs_dense"], 3),
                ]
            )
    if rows:
        lines += ["Decode, batch 1, per layer (CUDA graphs):", ""]
        lines += table(
            [
                "N",
                "dense FlashInfer ms",
                "TB/s",
                "SDPA ms",
                "rejection",
                "folded FlashInfer ms",
                "TB/s",
                "vs dense",
                "KV vs dense",
            ],
            rows,
        )
    return lines


def evictor_step(d: dict) -> list[str]:
    a = d["args"]
    rows = [
        [k.split("_")[1], v["streams"], f(v["ms_per_stream"], 3), f(v["peak_extra_mib"], 0)]
        for k, v in d.items()
        if k.startswith("evict_")
    ]
    return [
        f"Command: {cmd(d['env']['command'])}; {d['env'].get('gpu')}. {a['layers']} layers, Hkv {a['kv_heads']}, "
        f"Hq {a['q_heads']}, D {a['head_dim']}, budget {a['budget']}, window {a['window']}. maybe_evict with "
        f"no candidate {f(d['maybe_evict_no_candidate_us'], 1)} us, observe_decode "
        f"{f(d['observe_decode_us'], 1)} us.",
        "",
    ] + table(["requests evicted", "streams", "ms per stream", "peak extra MiB"], rows)


def pool_update_cpu(d: dict) -> list[str]:
    s, t = d["shape"], d["decode_step_pool_update_ms"]
    return [
        f"Command: {cmd(d['command'])}; CPU ({d['machine']}, {d['threads']} threads). {s['requests']} requests, "
        f"{s['layers']} layers, {s['kv_heads']} KV heads, context {s['context']}: decode-step pool update median "
        f"{f(t['median'])} ms (min {f(t['min'])}, p90 {f(t['p90'])}).",
        "",
    ]


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


def served_speed(d: dict) -> list[str]:
    """``serving/summary.json`` of ``benchmarks/served_speed.py merge``."""
    rows = [
        [
            r["workload"] + (f" (TP={r['tp']})" if r.get("tp", 1) > 1 else ""),
            r["metric"],
            f(r["upstream"]),
            f(r["wgkv"]),
            f"{f(r['ratio'])}x" if r["ratio"] else "",
            r["goal"],
        ]
        for r in d["rows"]
    ]
    lines = [
        f"WG-KV against upstream SGLang `--attention-backend flashinfer`, `python -m sglang.bench_serving` "
        f"(ratio: {d['ratio']}).",
        "",
    ]
    lines += table(["workload", "metric", "upstream", "WG-KV", "ratio", "goal"], rows)
    seen = set()
    for r in d["rows"]:
        for server, c in r["command"].items():
            if (r["workload"], server) not in seen and c.get("bench"):
                seen.add((r["workload"], server))
                lines.append(
                    f"- {r['workload']} {server}: server {cmd(c['server'])}; bench {cmd(c['bench'])}"
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
                run.get("error", "")[:80] if run.get("error") else "",
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
            "error",
        ],
        rows,
    )
    if d.get("leases"):
        lines += ["", f"Machines: {d['leases']}."]
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


def soak(d: dict) -> list[str]:
    """``tests/soak_workload.py``: mixed jobs against one server, idle-checked pool at every checkpoint."""
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


def decode_ab(d: dict) -> list[str]:
    """Two versions of the WG-KV decode, each in its own H200 lease against that lease's upstream:
    TPOT, profiled step and per-layer kernel times."""
    head = f"{d['what']}. Commands: {cmds(list(d['commands'].values()), '; ')}."
    rows = []
    for lease in d["leases"]:
        for w in ("W1", "W0"):
            rows.append(
                [
                    lease["code"],
                    w,
                    f(lease["upstream_tpot_ms"], 3),
                    f(lease[f"wgkv_{w}_tpot_ms"], 3),
                    f(lease["upstream_tpot_ms"] / lease[f"wgkv_{w}_tpot_ms"], 3),
                    f(lease["profile_median_gap_ms"][w], 3),
                    ", ".join(f"{k} {v}" for k, v in lease["per_layer_us"][w].items()),
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


def sm90_registers(d: dict) -> list[str]:
    """``benchmarks/sm90_registers.py``: ptxas's allocation of the decode split kernel per config."""
    rows = [
        [
            r["block_n"],
            r["num_warps"],
            r["num_stages"],
            r["fused_write"],
            r["fused_merge"],
            r["registers"],
            f"{r['spill_store_bytes']} / {r['spill_load_bytes']}",
            r["shared_bytes"],
            r["blocks_per_sm_by_registers"],
        ]
        for r in d["rows"]
    ]
    return [
        f"Command: {cmd(d['command'])}; {d['target']}, cross-compiled on CPU (no timing). Served default: "
        f"{d['served_default']}.",
        "",
    ] + table(
        [
            "block_n",
            "warps",
            "stages",
            "fused write",
            "fused merge",
            "registers",
            "spill st / ld B",
            "shared B",
            "blocks/SM (regs)",
        ],
        rows,
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


def served_ab(d: dict) -> list[str]:
    """``served_speed.py ab``: WG-KV server variants of one lease, workload by workload."""
    rows = [
        [
            r["variant"],
            r["workload"],
            f(r["ttft_s"]),
            f(r["tpot_ms"], 3),
            f(r["output_tok_s"], 1),
            f(r["tpot_vs_default"], 3),
        ]
        for r in d["ab_rows"]
    ]
    return (
        [
            f"{d['what']}. Command: {cmd(d['command'])}; {d['environment'].get('gpu') or 'CPU'}, "
            f"{d['environment'].get('date_utc')}.",
            "",
        ]
        + table(
            [
                "variant (WG-KV server arguments)",
                "workload",
                "TTFT p50 s",
                "TPOT p50 ms",
                "output tok/s",
                "default TPOT / TPOT",
            ],
            rows,
        )
        + ["Servers: " + cmds(list(dict.fromkeys(r["server_command"] for r in d["ab_rows"])), "; "), ""]
    )


def renderer(d: dict):
    """The renderer of a result file's kind (None: unknown kind)."""
    if "ab_rows" in d:
        return served_ab
    if "protocol" in d and "lengths" in d:
        return fig8
    if "sweep" in d and "decode" in d:
        return kernel_decode
    if "fit" in d and "by_length" in d:
        return decode_fixed_cost
    if "prefill" in d or ("decode" in d and "shape" in d):
        return kernel_attention
    if "maybe_evict_no_candidate_us" in d:
        return evictor_step
    if "decode_step_pool_update_ms" in d:
        return pool_update_cpu
    if (
        isinstance(d.get("runs"), list)
        and d["runs"]
        and isinstance(d["runs"][0], dict)
        and "policy" in (d["runs"][0].get("summary") or [{}])[0]
    ):
        return prompt_window
    if "runs" in d and "summary" in d and "workload" in d:
        return serving_throughput
    if "rows" in d and "ratio" in d and all("workload" in r for r in d["rows"]):
        return served_speed
    if "runs" in d and isinstance(d.get("workload"), dict) and "id" in d["workload"]:
        return served_workload
    if "table" in d and "runs" in d and "max_new_tokens" in d:
        return constrained_programs
    if "phases" in d and "peak_rss_bytes" in d:
        return serving_memory
    if "rows" in d and "summary" in d and "config" in d:
        return eval_summary
    if "rows" in d and "source" in d and d["rows"] and "full_nll" in d["rows"][0]:
        return offline_accuracy
    if "mass_weighted_recall" in d:
        return head_budgets
    if "train_curve" in d:
        return training
    if "matched_intervals" in d:
        return decode_log
    if isinstance(d.get("runs"), list) and d["runs"] and "seconds_per_step" in d["runs"][0]:
        return train_speed
    if "results" in d and "engine" in d:
        return served_accuracy
    if "pairs" in d and "near_tie" in d:
        return agreement
    if d.get("target", "").startswith("sm_90a") and "rows" in d:
        return sm90_registers
    if "pairs" in d and "server_commands" in d:
        return logprob_floor
    if "jobs_per_s" in d and "checkpoints" in d:
        return soak
    if "leases" in d and "reading" in d:
        return decode_ab
    runs = d.get("runs")
    if isinstance(runs, dict) and runs and all("report" in r for r in runs.values()):
        return aime_runs
    if isinstance(runs, dict) and runs and all("two_trigger_samples" in r for r in runs.values()):
        return trigger_runs
    if set(d) == {"rows"}:
        return accuracy_summary
    return None


def render(results: Path = RESULTS) -> str:
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.summary` from the JSON files in the folders below (do not edit).",
        "Every number is read from a JSON written by the run; each ratio divides two numbers of one run.",
        "",
    ]
    for folder, title in SECTIONS:
        files = sorted((results / folder).glob("*.json"))
        if not files:
            continue
        lines += [f"## {title}", ""]
        for path in files:
            d = json.loads(path.read_text())
            fn = renderer(d)
            lines += [f"### `{folder}/{path.name}`", ""]
            lines += fn(d) if fn is not None else ["(no table for this kind of file)", ""]
    text = "\n".join(lines).rstrip("\n") + "\n"
    leaked = re.findall(r"(?<![\w.])/(?:root|work|tmp|home|opt)/\S*", text)
    if leaked:
        raise ValueError(f"machine paths in the summary: {leaked[:3]}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    a = ap.parse_args()
    text, target = render(), RESULTS / "SUMMARY.md"
    if a.check:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is out of date: run python -m benchmarks.summary", file=sys.stderr)
            sys.exit(1)
        return
    target.write_text(text)
    print(f"wrote {target} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
