"""Tables of the kernel and end-to-end protocol results (``kernels/``, ``paper_fig8/``), one renderer per kind."""

from __future__ import annotations

from benchmarks.report_format import cmd, f, gb, table


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
            rows.append([r["n"], f"skipped ({r['skipped']})"] + [""] * 9)
            continue
        fa3 = r.get("sgl_kernel_fa3") or r.get("flashinfer_fa3", {})  # SGLang's own FA3 where it ran
        sdpa = r.get("torch_sdpa_flash", {})
        for w in r["wgkv_triton"]:
            rows.append(
                [
                    r["n"],
                    f(fa3.get("ms"), 3),
                    f(sdpa.get("ms"), 1),
                    f(w["rejection"]),
                    f(w["plan_ms"]),
                    f(w["compact_ms"]),
                    f(w["kernel_ms"], 3),
                    f(w.get("fa3_band_ms"), 3),
                    f(w["total_ms"], 3),
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
                "FA3 window + band ms",
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


def extend_step(d: dict) -> list[str]:
    """``extend_step.py``: one prefill chunk's pool work, torch against the Triton launches."""
    s = d["shape"]
    lines = [
        f"Command: {cmd(d['command'])}; {d['env'].get('gpu')}. {s['layers']} layers, Hkv {s['kv_heads']}, "
        f"D {s['head_dim']}, W_local {s['window']}, chunk {s['chunk']} of a {s['prompt']}-token prompt, "
        f"admit {s['admit']}; {d['per_chunk_ms']}.",
        "",
    ]
    rows = [
        [r["prefix"], r["chunk"], f(r["torch_ms"]), f(r["triton_ms"]), f"{f(r['speedup'])}x"]
        for r in d["rows"]
    ]
    return lines + table(["cached prefix", "chunk", "torch ms", "Triton ms", "speedup"], rows)


def chunked_prefill_host(d: dict) -> list[str]:
    """``benchmarks/chunked_prefill_host.py``: one prefill chunk's host plan and gathers at growing context."""
    s = d["settings"]
    rows = [
        [
            r["context_tokens"],
            f(r["median_chunk_ms"]),
            r["plan_device_index_elems"],
            r["plan_host_entries"],
            r["gathered_rows_per_layer"],
            r["max_global_per_head"],
            f(r["rss_mib_over_start"], 1),
        ]
        for r in d["samples"]
    ]
    head = (
        f"Command: {cmd(d['command'])}. Chunk {s['chunk']} tokens, admission {s['admit']}, "
        f"kv_budget {s['kv_budget']}, {s['layers']} layers x {s['kv_heads']} KV heads (CPU, timings noisy)."
    )
    header = [
        "context",
        "chunk ms",
        "plan index elems",
        "host entries",
        "rows gathered/layer",
        "max global/head",
        "RSS MiB over start",
    ]
    return [head, "", *table(header, rows), ""]


def host_ops(d: dict) -> list[str]:
    """``benchmarks/host_ops.py``: the launches of a served forward on the kernels path, counted on CPU."""

    def launches(part: dict) -> str:
        return " + ".join(f"{f(part[k], 0)} {k}" for k in ("torch", "triton", "sync") if part.get(k))

    rows = [
        [name, launches(r["per_layer"]), launches(r["per_forward"])] for name, r in d["scenarios"].items()
    ]
    H, Hq, D, W = d["shape"]
    head = (
        f"Command: {cmd(d['command'])}. {H} KV heads, {Hq} query heads, head_dim {D}, W_local {W}; aten ops that "
        "launch a kernel (torch), Triton launches, host syncs; counted on CPU, the Triton kernels interpreted."
    )
    return [head, ""] + table(
        ["forward", "launches a layer", "launches a forward (besides the layers)"], rows
    )


def host_time(d: dict) -> list[str]:
    """``benchmarks/host_time.py``: the host's microseconds in the backend's part of a forward, on CPU."""
    spans = sorted(
        {k for r in d["scenarios"].values() for k in r if k.startswith("wgkv.")} - {"wgkv.plan_forward"}
    )
    rows = [
        [
            name,
            f(r.get("init_forward_metadata"), 0),
            f(r.get("forward_extend", r.get("forward_decode")), 0),
            *(f(r.get(k), 0) if k in r else "" for k in spans),
        ]
        for name, r in d["scenarios"].items()
    ]
    head = (
        f"Command: {cmd(d['command'])}. Host microseconds ({d['unit']}), {d['layers']} layers, the Triton "
        "launches returning at once: the Python and torch dispatch around the kernels."
    )
    return [head, ""] + table(["forward", "plan", "a layer", *(k.removeprefix("wgkv.") for k in spans)], rows)


def kernel_gate(d: dict) -> list[str]:
    """``kernel_gate.py``: the prefill write gate's launch shapes, one layer at a time."""
    env, s = d["environment"], d["shape"]
    rows = [
        [
            r["rows"],
            r["variant"],
            " ".join(f"{k}={v}" for k, v in (r.get("launch") or {}).items()),
            f(r.get("ms"), 3),
            "" if r.get("max_abs_err") is None else f"{r['max_abs_err']:.1e}",
            {True: "yes", False: "no"}.get(r.get("within_check"), ""),
            r.get("error", ""),
        ]
        for r in d["rows"]
    ]
    return [
        f"One layer of the prefill gate ({s['kv_heads']} KV heads, head_dim {s['head_dim']}, inner "
        f"{s['inner']}, bf16 keys); {env.get('gpu')}, {env.get('date_utc')}. Command: {cmd(env['command'])}.",
        "",
    ] + table(
        [
            "rows",
            "variant",
            "launch",
            "ms / layer",
            "max abs err vs torch",
            "within the start-up check",
            "error",
        ],
        rows,
    )


def prefill_chunk(d: dict) -> list[str]:
    """``prefill_chunk.py``: one served prefill chunk after a long context, piece by piece."""
    env, s = d["environment"], d["shape"]
    names = [
        "plan",
        "compact",
        "fa3_vertical",
        "wgkv_fa3",
        "wgkv_triton",
        "upstream_paged",
        "upstream_contiguous",
    ]
    rows = [
        [
            r["admit"],
            *(f(r["ms"].get(n), 3) for n in names),
            f(r.get("wgkv_fa3_vs_upstream_paged"), 2),
            *(_err(r.get("max_abs_diff", {}).get(k)) for k in ("wgkv_fa3_vs_triton", "wgkv_fa3_vs_upstream")),
        ]
        for r in d["rows"]
    ]
    return [
        f"One layer ({s['q_heads']} query heads, {s['kv_heads']} KV heads, head_dim {s['head_dim']}, "
        f"{s['dtype']}): a {d['chunk']}-token chunk after {d['context']} cached tokens; FA3: {d['fa3']}; "
        f"{env.get('gpu')}, {env.get('date_utc')}. Command: {cmd(env['command'])}.",
        "",
    ] + table(
        [
            "admitted",
            *(f"{n} ms" for n in names),
            "wgkv_fa3 / upstream_paged",
            "max abs diff vs triton",
            "vs upstream (all admitted)",
        ],
        rows,
    )


def _err(x) -> str:
    return "" if x is None else f"{x:.1e}"
