"""Tables of the other serving results (``serving/``, ``constrained/``, ``reliability/``): client
throughput, memory, log-probability floors, frontend programs, soaks and CPU decode; one renderer per kind
(the served-speed kinds: ``render_served_speed.py``)."""

from __future__ import annotations

from benchmarks.report_format import cmd, f, table


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
