"""The figures of the kernel benchmarks (``kernel_decode``, ``kernel_attention``), from their result dicts."""


def plot_kernel_decode(results, png):
    """``kernel_decode``: ms per layer and effective TB/s against the context, one row per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results.get("decode", []) if "skipped" not in r]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    fig, axes = plt.subplots(len(batches), 2, figsize=(13, 4.5 * len(batches)), squeeze=False)
    for i, B in enumerate(batches):
        rb = [r for r in rows if r["batch"] == B]
        ax_ms, ax_bw = axes[i]
        pts = [
            (r["n"], r["dense_flashinfer"]["ms"], r["dense_flashinfer"]["tbps"])
            for r in rb
            if "ms" in r.get("dense_flashinfer", {})
        ]
        if pts:
            ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], "ko--", label="dense FlashInfer")
            ax_bw.plot([p[0] for p in pts], [p[2] for p in pts], "ko--", label="dense FlashInfer")
        rejs = sorted({f["rejection"] for r in rb for f in r.get("folded", []) if "skipped" not in f})
        for j, rej in enumerate(rejs):
            color = plt.cm.viridis(j / max(1, len(rejs) - 1))
            for kern, style, name in (
                ("folded_flashinfer", "s:", "FlashInfer folded"),
                ("triton", "o-", "Triton"),
                ("triton_two_launch", "^--", "Triton 2 launches"),
            ):
                pts = [
                    (r["n"], f[kern]["ms"], f[kern]["tbps"])
                    for r in rb
                    for f in r.get("folded", [])
                    if f.get("rejection") == rej and "ms" in f.get(kern, {})
                ]
                if pts:
                    label = f"{name} {int(rej * 100)}% rej."
                    ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
                    ax_bw.plot([p[0] for p in pts], [p[2] for p in pts], style, color=color, label=label)
        ax_ms.set(
            xscale="log",
            yscale="log",
            xlabel="context tokens",
            ylabel="ms per layer",
            title=f"Decode, batch {B}, one Llama-3.1-8B layer (CUDA graph)",
        )
        ax_bw.set(
            xscale="log",
            xlabel="context tokens",
            ylabel="effective TB/s (K+V read / time)",
            title=f"Decode bandwidth, batch {B}",
        )
        ax_ms.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot_kernel_attention(results, png):
    """``kernel_attention``: prefill and decode ms per layer against the length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    pre = [r for r in results.get("prefill", []) if "skipped" not in r]
    ax = axes[0]
    for base in ("flashinfer_fa3", "flashinfer_fa2", "torch_sdpa_flash"):
        pts = [(r["n"], r[base]["ms"]) for r in pre if "ms" in r.get(base, {})]
        if pts:
            ax.plot(*zip(*pts), "o--", label=f"dense {base}")
    for rej in sorted({w["rejection"] for r in pre for w in r.get("wgkv_triton", [])}):
        pts = [
            (r["n"], w["total_ms"]) for r in pre for w in r.get("wgkv_triton", []) if w["rejection"] == rej
        ]
        ax.plot(*zip(*pts), "o-", label=f"WG-KV Triton, {int(rej * 100)}% rejected")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prefill tokens",
        ylabel="ms per layer",
        title="Prefill attention, one Llama-3.1-8B layer (H200)",
    )
    ax.legend(fontsize=7)
    dec = [r for r in results.get("decode", []) if "skipped" not in r]
    ax = axes[1]
    pts = [
        (r["n"], r["dense_flashinfer"]["graph"]["ms_per_layer"])
        for r in dec
        if "ms_per_layer" in r["dense_flashinfer"].get("graph", {})
    ]
    if pts:
        ax.plot(*zip(*pts), "o--", label="dense FlashInfer decode (graph)")
    for rej in sorted({w["rejection"] for r in dec for w in r.get("wgkv_folded_flashinfer", [])}):
        pts = [
            (r["n"], w["graph"]["ms_per_layer"])
            for r in dec
            for w in r.get("wgkv_folded_flashinfer", [])
            if w["rejection"] == rej and "ms_per_layer" in w.get("graph", {})
        ]
        if pts:
            ax.plot(*zip(*pts), "o-", label=f"WG-KV folded, {int(rej * 100)}% rejected (graph)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context tokens",
        ylabel="ms per layer",
        title="Decode attention, batch 1, one layer (H200)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
