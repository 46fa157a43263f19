"""Served speed, the report: part files of ``benchmarks.served_speed`` into
``benchmarks/results/serving/`` (one ``<workload>.json`` each, ``summary.json`` and ``summary.png``),
and WG-KV variants side by side.

    python -m benchmarks.served_report merge PARTS... [--out-dir benchmarks/results/serving]
    python -m benchmarks.served_report ab PARTS... --out FILE --what TEXT

Pairing rules (``merge``):

=========================  ===================================================================
rule                       why
=========================  ===================================================================
one machine, one hour      every run of a workload in one merge started within
                           :data:`MAX_PAIR_SPAN_S` of the others: each ratio divides two runs
                           made on one machine, one after the other
the workload's arguments   each run's server command holds the workload's ``server_args``
                           (a changed definition is another workload)
nothing compiled           no run's timed part compiled a Triton kernel (``compiled_in_timed_run``):
                           a compile stops the scheduler for seconds, so the ratio would time
                           the JIT (run the workload again on the warm machine)
``best``                   per workload, metric and WG-KV configuration: the best upstream value
                           among the baselines measured in that merge (that machine), paired
                           with the same WG-KV run; ``best_of`` names the baseline
a merge replaces           the summary rows of each (workload, tp, WG-KV configuration) it
                           measured; other rows stay as an earlier merge left them
=========================  ===================================================================
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from benchmarks import served_workloads as sw

REPO = Path(__file__).resolve().parents[1]
# Parts whose runs are compared ran on one machine, one after the other: at most this far apart.
MAX_PAIR_SPAN_S = 3600
# Parts written before baselines and WG-KV configurations were recorded ran these.
LEGACY = {"upstream": "flashinfer", "wgkv": "bf16"}
RATIO = "upstream/wgkv for times, wgkv/upstream for throughput: > 1 means WG-KV is faster"
BEST = (
    "baseline 'best': per workload, metric and WG-KV configuration, the best upstream value among the "
    "baselines measured on the same machine within the hour of the WG-KV run (best_of names it)"
)


def part_config(part: dict) -> str:
    """The baseline (upstream) or WG-KV configuration a part ran."""
    key = "baseline" if part["server"] == "upstream" else "wgkv_config"
    return part.get(key) or LEGACY[part["server"]]


def collect(parts: list[dict], ws: sw.WorkloadSet) -> dict[tuple[str, int], dict[str, dict[str, dict]]]:
    """``{(workload, tp): {"upstream": {baseline: run}, "wgkv": {config: run}}}``; each run gains the
    part's ``date_utc``. A workload's ``upstream_from`` borrows that workload's upstream runs."""
    groups: dict[tuple[str, int], dict[str, dict[str, dict]]] = {}
    for part in parts:
        for key in ("wgkv_extra", "upstream_extra"):
            if part.get(key):
                raise ValueError(
                    f"a part ran with --{key.replace('_', '-')} {part[key]!r}: an A/B part "
                    "(served_report ab), not the workload's row"
                )
        config = part_config(part)
        for rec in part["runs"]:
            if "workload" not in rec:  # a server that never started: no row
                continue
            ws[rec["workload"]]  # an unknown workload raises here
            key = (rec["workload"], part.get("tp", 1))
            by_config = groups.setdefault(key, {"upstream": {}, "wgkv": {}})[part["server"]]
            if config in by_config:
                raise ValueError(f"{key[0]}: two {part['server']} {config} runs in one merge")
            by_config[config] = {**rec, "date_utc": part["environment"].get("date_utc")}
    for (name, tp), group in list(groups.items()):
        src = ws[name].upstream_from
        if src and not group["upstream"] and (src, tp) in groups:
            group["upstream"] = dict(groups[(src, tp)]["upstream"])  # the same requests, measured once
    return groups


def check_comparable(groups: dict[tuple[str, int], dict[str, dict[str, dict]]], ws: sw.WorkloadSet) -> None:
    """ValueError unless each workload's runs used its current server arguments, compiled nothing in
    their timed runs and started within :data:`MAX_PAIR_SPAN_S` of each other."""
    for (name, _), group in groups.items():
        want = shlex.split(ws[name].server_args)
        stamps = []
        for server, by_config in group.items():
            for config, rec in by_config.items():
                cmd = shlex.split(rec.get("server_command") or "")
                if not any(cmd[i : i + len(want)] == want for i in range(len(cmd))):
                    raise ValueError(
                        f"{name} {server} {config}: its server ran without the workload's arguments "
                        f"{ws[name].server_args!r}"
                    )
                if rec.get("compiled_in_timed_run"):
                    raise ValueError(
                        f"{name} {server} {config}: its timed run compiled Triton kernels "
                        f"{rec['compiled_in_timed_run']} (run it again on the warm machine)"
                    )
                if rec.get("date_utc"):
                    stamps.append(datetime.datetime.fromisoformat(rec["date_utc"]))
        if len(stamps) > 1 and (max(stamps) - min(stamps)).total_seconds() > MAX_PAIR_SPAN_S:
            raise ValueError(
                f"{name}: its runs are {max(stamps) - min(stamps)} apart (not one machine's hour)"
            )


def _commands(up: dict | None, wg: dict | None) -> dict:
    return {
        s: {"server": r.get("server_command"), "bench": r.get("bench_command")}
        for s, r in (("upstream", up), ("wgkv", wg))
        if r
    }


def run_value(metric: sw.Metric, rec: dict, w: sw.Workload) -> float | None:
    """The metric of a run that served every request; None for a refused, failed or partial run
    (bench_serving reports 0 for the latencies of a run whose requests all failed)."""
    result = rec.get("result") or {}
    done = result.get("completed")
    if rec.get("refusal") or rec.get("error") or (done is not None and done < w.client.prompts):
        return None
    return metric.value(result)


def workload_rows(name: str, tp: int, group: dict[str, dict[str, dict]], ws: sw.WorkloadSet) -> list[dict]:
    """One row per metric, WG-KV configuration and baseline, then the ``best`` row of each."""
    w, rows = ws[name], []
    for config, wg in sorted(group["wgkv"].items()):
        for metric_name in w.metrics:
            metric = ws.metrics[metric_name]
            wg_value = run_value(metric, wg, w)
            pairs = []
            for baseline, up in sorted(group["upstream"].items()):
                up_value = run_value(metric, up, w)
                row = {
                    "workload": name,
                    "tp": tp,
                    "metric": metric_name,
                    "baseline": baseline,
                    "wgkv_config": config,
                    "upstream": up_value,
                    "wgkv": wg_value,
                    "ratio": metric.ratio(up_value, wg_value),
                    "goal": w.goal,
                    "command": _commands(up, wg),
                }
                if up.get("refusal") or up.get("error"):
                    row["upstream_refusal"] = (up.get("refusal") or up.get("error"))[-500:]
                pairs.append(row)
            measured = [r for r in pairs if r["upstream"] is not None]
            if measured:
                top = metric.best([r["upstream"] for r in measured])
                pick = next(r for r in measured if r["upstream"] == top)
                best = {**pick, "baseline": "best", "best_of": pick["baseline"]}
            elif pairs:  # every baseline refused or failed: the best upstream is none
                best = {**pairs[0], "baseline": "best", "best_of": None}
            else:  # WG-KV alone (no baseline measured beside it)
                best = None
                pairs = [
                    {
                        "workload": name,
                        "tp": tp,
                        "metric": metric_name,
                        "baseline": None,
                        "wgkv_config": config,
                        "upstream": None,
                        "wgkv": wg_value,
                        "ratio": None,
                        "goal": w.goal,
                        "command": _commands(None, wg),
                    }
                ]
            rows += pairs + ([best] if best else [])
    return rows


def row_key(r: dict) -> tuple:
    return (r["workload"], r.get("tp", 1), r.get("wgkv_config"))


def merged_summary(old_rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """``new_rows`` replace the old rows of each (workload, tp, WG-KV configuration) they cover."""
    covered = {row_key(r) for r in new_rows}
    kept = [r for r in old_rows if row_key(r) not in covered]
    order = {"best": 1}
    return sorted(
        kept + new_rows,
        key=lambda r: (
            (r["workload"], r.get("tp", 1), r.get("wgkv_config") or "", r["metric"])
            + (order.get(r.get("baseline"), 0), r.get("baseline") or "")
        ),
    )


def workload_file(
    name: str, tp: int, group: dict, ws: sw.WorkloadSet, envs: list, old: dict, machines: str
) -> dict:
    w = ws[name]
    runs = dict(old.get("runs", {}))
    for server, by_config in group.items():
        for config, rec in by_config.items():
            runs[f"{server}:{config}"] = rec
    out = {
        "kind": "served_workload",
        "workload": {
            "id": name,
            "tp": tp,
            "prompts": w.client.prompts,
            "input_len": w.client.input_len,
            "output_len": w.client.output_len,
            "range_ratio": w.client.range_ratio,
            "request_rate": w.client.request_rate,
            "server_args": w.server_args,
            "wgkv_args": w.wgkv_args,
            "env": w.env,
            "wgkv_request": w.wgkv_request,
            "goal": w.goal,
        },
        "environment": envs,
        "runs": runs,
    }
    if machines:
        out["machines"] = machines
    return out


def merge(a) -> None:
    from benchmarks.trace_summary import recategorize

    ws = sw.load(Path(a.workloads_file))
    parts = [json.loads(Path(p).read_text()) for p in a.parts]
    for part in parts:
        for rec in part["runs"]:
            for summary in (rec.get("profile") or {}).get("summary", []):
                recategorize(summary)  # phases of the current trace_summary.PHASES
    groups = collect(parts, ws)
    check_comparable(groups, ws)
    envs = [p["environment"] for p in parts]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for (name, tp), group in sorted(groups.items()):
        key = name + (f"_tp{tp}" if tp > 1 else "")
        path = out / f"{key}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(
            json.dumps(workload_file(name, tp, group, ws, envs, old, a.machines), indent=1) + "\n"
        )
        rows += workload_rows(name, tp, group, ws)
    summary_path = out / "summary.json"
    old_rows = json.loads(summary_path.read_text())["rows"] if summary_path.exists() else []
    rows = merged_summary(old_rows, rows)
    summary = {"kind": "served_summary", "rows": rows, "ratio": RATIO, "best": BEST}
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    plot(rows, out / "summary.png")
    for row in rows:
        print(
            json.dumps(
                {k: row.get(k) for k in ("workload", "metric", "baseline", "upstream", "wgkv", "ratio")}
            )
        )


def ab(a) -> None:
    """WG-KV server variants (``served_speed --wgkv-extra``) run on one machine within the hour, side by
    side, with the upstream parts of that machine as references: each part's metrics (the workload
    file's) with its server command; ratios against the WG-KV part without extra arguments (the served
    default) and, per metric, against the best upstream part (``vs_best_upstream``, > 1: WG-KV better).
    A run that compiled a Triton kernel while it was timed is kept but marked ``result: false``."""
    ws = sw.load(Path(a.workloads_file))
    m = ws.metrics
    rows, envs = [], []
    for path in a.parts:
        part = json.loads(Path(path).read_text())
        envs.append(part["environment"])
        if part["server"] == "wgkv":
            variant = part.get("wgkv_extra") or "default"
        else:
            variant = " ".join(filter(None, ("upstream", part_config(part), part.get("upstream_extra"))))
        for rec in part["runs"]:
            if "workload" in rec and not rec.get("error"):
                r = rec.get("result")
                compiled = rec.get("compiled_in_timed_run") or []
                rows.append(
                    {
                        "variant": variant,
                        "server": part["server"],
                        "workload": rec["workload"],
                        **{name: metric.value(r) for name, metric in m.items()},
                        "completed": (r or {}).get("completed"),
                        "max_running_seen": rec.get("max_running_seen"),
                        "prefill_under_load": rec.get("prefill_under_load"),
                        "request_times": rec.get("request_times"),
                        "ttft_by_length": rec.get("ttft_by_length"),
                        "compiled_in_timed_run": compiled,
                        "result": not compiled,
                        "server_command": rec["server_command"],
                        "bench_command": rec.get("bench_command"),
                    }
                )
    if not any(r["server"] == "wgkv" for r in rows):
        raise ValueError("ab compares WG-KV variants: no WG-KV part given")
    stamps = [datetime.datetime.fromisoformat(env["date_utc"]) for env in envs]
    if (max(stamps) - min(stamps)).total_seconds() > MAX_PAIR_SPAN_S:
        raise ValueError(f"the parts are {max(stamps) - min(stamps)} apart (not one machine's hour)")
    base = {r["workload"]: r for r in rows if r["variant"] == "default"}
    upstream = [r for r in rows if r["server"] == "upstream" and r["result"]]
    for r in rows:
        b = base.get(r["workload"])
        r["tpot_vs_default"] = b["tpot_ms"] / r["tpot_ms"] if b and r["tpot_ms"] else None
        r["tok_s_vs_default"] = r["output_tok_s"] / b["output_tok_s"] if b and b["output_tok_s"] else None
        refs = [u for u in upstream if u["workload"] == r["workload"]]
        if r["server"] == "wgkv" and refs:
            r["vs_best_upstream"] = {
                name: metric.ratio(metric.best([u[name] for u in refs if u[name]] or [0.0]), r[name])
                for name, metric in m.items()
            }
    out = {
        "kind": "served_ab",
        "what": a.what,
        "command": shlex.join(["python", "-m", "benchmarks.served_report", *sys.argv[1:]]),
        "environment": envs[0],
        "ab_rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        shown = ("variant", "workload", "ttft_s", "tpot_ms", "p99_tpot_ms", "e2e_s", "output_tok_s", "result")
        print(json.dumps({k: r.get(k) for k in shown}))


def plot(rows: list[dict], png: Path) -> None:
    """The ratios against ``best`` (against the only baseline measured where rows predate ``best``)."""
    try:
        import matplotlib
    except ImportError:  # the `train` extra brings it; the tables and JSON do not need it
        print(f"matplotlib is not installed (pip install -e .[train]): {png} not redrawn", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ratio"] and r.get("baseline") == "best"]
    fig, ax = plt.subplots(figsize=(1.4 * max(3, len(rows)) + 2, 3.6))
    labels = [f"{r['workload']}\n{r['metric']}\n{r['wgkv_config']} vs {r['best_of']}" for r in rows]
    bars = ax.bar(labels, [r["ratio"] for r in rows], color="tab:blue")
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("WG-KV speed / best upstream")
    ax.set_title(
        "Served speed on one H200 (Llama-3.1-8B config, dummy weights; WG-KV admits 25% at random, "
        "W0 keeps every token)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads-file", default=str(sw.WORKLOADS_JSON))
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="part files -> results/serving/ (workload files, summary.json)")
    m.add_argument("parts", nargs="+")
    m.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results" / "serving"))
    m.add_argument(
        "--machines", default="", help="which machine the runs come from, and when (the workload files' text)"
    )
    b = sub.add_parser(
        "ab", help="WG-KV variants of one machine's hour (served_speed --wgkv-extra) side by side"
    )
    b.add_argument("parts", nargs="+")
    b.add_argument("--out", required=True)
    b.add_argument("--what", required=True, help="what the variants test (goes into the JSON)")
    a = p.parse_args(argv)
    {"merge": merge, "ab": ab}[a.cmd](a)


if __name__ == "__main__":
    main()
