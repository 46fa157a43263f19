"""The Fig. 8 results as ratios, a markdown table and a figure (``benchmarks.fig8_end_to_end``)."""


def ratios(row) -> dict:
    """Speedups of WG-KV over the dense columns measured for one length (same run or merged runs)."""
    out = {}
    d = row.get("dense", {})
    for key in [k for k in row if k.startswith("wgkv")]:
        w, sfx = row[key], key[4:]
        if "ttft_s" not in w:
            continue
        if "ttft_s" in d:
            out["ttft_speedup" + sfx] = d["ttft_s"] / w["ttft_s"]
            out["peak_memory_ratio" + sfx] = w["peak_memory_bytes"] / d["peak_memory_bytes"]
            out["kv_bytes_ratio" + sfx] = w["kv_used_bytes"] / d["kv_used_bytes"]
        if "tpot_ms" in d and "tpot_ms" in w:
            out["tpot_speedup" + sfx] = d["tpot_ms"] / w["tpot_ms"]
        for base in ("dense_fa2", "dense_sdpa"):
            if "ttft_s" in row.get(base, {}):
                out[f"ttft_speedup{sfx}_vs_{base[6:]}"] = row[base]["ttft_s"] / w["ttft_s"]
    return out


def markdown(results) -> str:
    """The SUMMARY table of every length and column in ``results``."""
    lines = [
        "| N | column | TTFT s | TPOT ms | peak GB | KV used GB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(results["lengths"], key=lambda r: r["n"]):
        for key, r in row.items():
            if key in ("n", "ratios"):
                continue
            note = r.get("oom") and "OOM" or r.get("skipped", "")
            cells = [
                f"{r['ttft_s']:.1f}" if "ttft_s" in r else "",
                f"{r['tpot_ms']:.2f}" if "tpot_ms" in r else "",
                f"{r['peak_memory_bytes'] / 1e9:.1f}" if "peak_memory_bytes" in r else "",
                f"{r['kv_used_bytes'] / 1e9:.1f}" if "kv_used_bytes" in r else "",
            ]
            lines.append(f"| {row['n']} | {key} | " + " | ".join(cells) + f" | {note} |")
        if row.get("ratios"):
            lines.append(
                f"| {row['n']} | ratios | "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
                + " |||||"
            )
    return "\n".join(lines) + "\n"


def plot(results, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["lengths"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label, scale in (
        (axes[0], "ttft_s", "TTFT (s)", 1),
        (axes[1], "tpot_ms", "TPOT (ms)", 1),
        (axes[2], "peak_memory_bytes", "peak memory (GB)", 1e-9),
    ):
        cols = sorted({k for r in rows for k in r if k not in ("n", "ratios")})
        for col in cols:
            pts = sorted((r["n"] / 1024, r[col][key] * scale) for r in rows if key in r.get(col, {}))
            if pts:
                ax.plot(*zip(*pts), "o-" if col.startswith("wgkv") else "s--", label=col)
        ax.set(xlabel="context (K tokens)", ylabel=label)
        ax.legend()
    fig.suptitle("Llama-3.1-8B shape, random weights, batch 1, 75% rejection, H200")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
