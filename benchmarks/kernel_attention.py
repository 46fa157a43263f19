"""Kernel benchmark: WG-KV prefill and decode attention vs dense kernels, one Llama-3.1-8B layer.

Prefill (batch 1, N tokens, Hq=32, Hkv=8, D=128, bf16, W_local=256): the Triton vertical-slash kernel
at 0/50/75/90% rejection (random admission per token and head) against dense causal FlashInfer FA3
and FA2 (``single_prefill_with_kv_cache``) and torch SDPA (flash backend).
Decode (batch 1): FlashInfer folded-head decode (ring + global pages of each head, pages in random
order) against dense FlashInfer paged decode (same page size, random page order) and SDPA, over 8
layers with distinct memory, eager and CUDA-graph replay. Effective bandwidth = K+V bytes / time.

usage: python -m benchmarks.kernel_attention --out DIR [--lengths 32768 131072 ...] [--deadline S]
"""

import argparse
import json
import os

import torch

from benchmarks.common import Deadline, capture_graph, cuda_ms, environment, write_json

HQ, HKV, D, W = 32, 8, 128, 256
DT = torch.bfloat16


def visible_pairs(adm: torch.Tensor, n: int) -> int:
    """(query, key) pairs the vertical-slash mask keeps, summed over KV heads (prefill from scratch)."""
    j = torch.arange(n, device=adm.device)
    band = W * n - W * (W - 1) // 2 if n >= W else n * (n + 1) // 2
    vertical = ((n - W - j).clamp(min=0)[:, None] * adm).sum()
    return int(band * adm.shape[1] + vertical.item())


def inputs(n):
    q = torch.randn(n, HQ, D, device="cuda", dtype=DT)
    k = torch.randn(n, HKV, D, device="cuda", dtype=DT)
    v = torch.randn(n, HKV, D, device="cuda", dtype=DT)
    ind = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    pos = torch.arange(n, dtype=torch.int32, device="cuda")
    return q, k, v, ind, pos


def prefill_configs():
    from sglang_wgkv.attention.triton_prefill import PrefillConfig

    return [
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(128, 128, 8, 2),
        PrefillConfig(128, 64, 8, 2),
        PrefillConfig(64, 64, 4, 3),
        PrefillConfig(128, 64, 8, 4),
    ]


def run_prefill(args, deadline, results, path):
    from sglang_wgkv.attention.triton_prefill import PrefillConfig, default_config, vertical_slash_attention
    from sglang_wgkv.attention.vertical_slash_plan import build_vertical_slash_plan, compact_admitted

    if args.no_sweep:
        return _prefill_lengths(args, deadline, results, path, default_config(D))
    # Launch-shape sweep at 64K, 75% rejection; the best one is used below and saved for fig8.
    q, k, v, ind, pos = inputs(65536)
    adm = torch.rand(65536, HKV, device="cuda") < 0.25
    sweep = []
    for cfg in prefill_configs():
        try:
            plan = build_vertical_slash_plan(adm, ind, ind, pos, pos, W, cfg.block_m)
            comp = compact_admitted(k, v, adm, ind)
            ms = cuda_ms(
                lambda: vertical_slash_attention(
                    q, k, v, adm, ind, ind, pos, pos, W, plan=plan, compacted=comp, config=cfg
                ),
                reps=5,
                warmup=2,
            )
            sweep.append({"config": cfg.__dict__, "ms": sorted(ms)[len(ms) // 2]})
        except Exception as exc:
            sweep.append({"config": cfg.__dict__, "error": repr(exc)[:300]})
    ok = [s for s in sweep if "ms" in s]
    best = min(ok, key=lambda s: s["ms"])["config"]
    results["prefill_config_sweep_64k_75pct"] = sweep
    results["prefill_config"] = best
    with open("/tmp/wgkv_prefill_config.json", "w") as f:
        json.dump(best, f)
    del q, k, v
    _prefill_lengths(args, deadline, results, path, PrefillConfig(**best))


def _prefill_lengths(args, deadline, results, path, cfg):
    import flashinfer

    from sglang_wgkv.attention.triton_prefill import (
        build_vertical_slash_plan_triton,
        compact_admitted_triton,
        vertical_slash_attention,
    )
    from sglang_wgkv.attention.vertical_slash_plan import (
        _exclusive_count,
        build_vertical_slash_plan,
        compact_admitted,
    )

    results["prefill_config"] = cfg.__dict__

    def sdpa(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )

    rows = results.setdefault("prefill", [])
    for n in args.lengths:
        q, k, v, ind, pos = inputs(n)
        dense_flops = 4 * D * HQ * n * (n + 1) / 2
        reps = 3 if n <= 131072 else 1
        # Expected dense time at ~500 TFLOP/s decides whether this length still fits.
        if deadline.left() < 14 * dense_flops / 5e14 + 10:
            rows.append({"n": n, "skipped": "deadline"})
            write_json(path, results, "kernel_attention")
            continue
        entry = {"n": n, "dense_tflop": dense_flops / 1e12}
        dense = [
            (
                "flashinfer_fa3",
                lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3"),
            ),
            ("torch_sdpa_flash", lambda: sdpa(q, k, v)),
        ]
        dense = [(name, fn) for name, fn in dense if name in args.baselines]
        # FA2 (a further JIT build) only when the run has time to spare.
        if "flashinfer_fa2" in args.baselines and deadline.left() > 200 + 30 * dense_flops / 5e14:
            dense.append(
                (
                    "flashinfer_fa2",
                    lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2"),
                )
            )
        for name, fn in dense:
            try:
                ms = cuda_ms(fn, reps=reps, warmup=1 if n <= 131072 else 0)
                entry[name] = {"ms": min(ms), "tflops": dense_flops / min(ms) / 1e9}
            except Exception as exc:
                entry[name] = {"error": repr(exc)[:300]}
            torch.cuda.empty_cache()
        for rej in args.rejections:
            adm = torch.rand(n, HKV, device="cuda") >= rej
            pairs = visible_pairs(adm, n)
            flops = 4 * D * (HQ // HKV) * pairs
            # What the served prefill runs (the one-launch Triton plan, the Triton copy of admitted rows),
            # and, same run, the torch plan, the torch scatter and the 2-D row scan used before.
            # Files without "served_plan" predate the switch: their plan_ms is the torch plan.
            plan_ms = cuda_ms(
                lambda: build_vertical_slash_plan_triton(adm, ind, ind, pos, pos, W, cfg.block_m), reps=3
            )
            plan_torch_ms = cuda_ms(
                lambda: build_vertical_slash_plan(adm, ind, ind, pos, pos, W, cfg.block_m), reps=3
            )
            comp_ms = cuda_ms(lambda: compact_admitted_triton(k, v, adm, ind), reps=3)
            comp_torch_ms = cuda_ms(lambda: compact_admitted(k, v, adm, ind), reps=3)
            scan_1d_ms = cuda_ms(lambda: _exclusive_count(adm), reps=3)
            scan_2d_ms = cuda_ms(lambda: torch.cumsum(adm.t().contiguous(), 1, dtype=torch.int32), reps=3)
            plan = build_vertical_slash_plan_triton(adm, ind, ind, pos, pos, W, cfg.block_m)
            comp = compact_admitted_triton(k, v, adm, ind)
            kern = cuda_ms(
                lambda: vertical_slash_attention(
                    q, k, v, adm, ind, ind, pos, pos, W, plan=plan, compacted=comp, config=cfg
                ),
                reps=reps,
                warmup=1 if n <= 131072 else 0,
            )
            total = min(kern) + min(plan_ms) + min(comp_ms)
            wg = {
                "rejection": rej,
                "kernel_ms": min(kern),
                "plan_ms": min(plan_ms),
                "compact_ms": min(comp_ms),
                "served_plan": "triton",
                "plan_torch_ms": min(plan_torch_ms),
                "compact_torch_ms": min(comp_torch_ms),
                "scan_1d_ms": min(scan_1d_ms),
                "scan_2d_ms": min(scan_2d_ms),
                "total_ms": total,
                "visible_pairs": pairs,
                "tflops_useful": flops / min(kern) / 1e9,
            }
            for base in ("flashinfer_fa3", "flashinfer_fa2", "torch_sdpa_flash"):
                if "ms" in entry.get(base, {}):
                    wg[f"speedup_vs_{base}"] = entry[base]["ms"] / total
            entry.setdefault("wgkv_triton", []).append(wg)
            del plan, comp
        rows.append(entry)
        write_json(path, results, "kernel_attention")
        print(json.dumps({k: entry[k] for k in entry if k != "wgkv_triton"}), flush=True)
        for wg in entry.get("wgkv_triton", []):
            print("   ", json.dumps(wg), flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def folded_layer(n, rej, gen):
    """Global tokens per head for one layer: the ring holds W, the rest is admitted w.p. 1 - rej."""
    g = torch.binomial(torch.full((HKV,), float(n - W)), torch.full((HKV,), 1.0 - rej), generator=gen)
    return [int(x) for x in g]


def run_decode(args, deadline, results, path, layers=8):
    import flashinfer

    from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode

    gen = torch.Generator().manual_seed(0)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    rows = results.setdefault("decode", [])
    for n in args.lengths:
        if deadline.left() < 25:
            rows.append({"n": n, "skipped": "deadline"})
            continue
        entry = {"n": n, "layers": layers}
        q = torch.randn(1, HQ, D, device="cuda", dtype=DT)
        # Dense: FlashInfer paged decode, num_kv_heads = 8, pages in random order.
        pages = -(-n // 16)
        kv_dense = [torch.randn(pages, 2, 16, HKV, D, device="cuda", dtype=DT) for _ in range(layers)]
        dense = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(2, dtype=torch.int32, device="cuda"),
            paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device="cuda"),
            paged_kv_last_page_len_buffer=torch.zeros(1, dtype=torch.int32, device="cuda"),
        )
        dense.plan(
            torch.tensor([0, pages], dtype=torch.int32),
            torch.randperm(pages, device="cuda").to(torch.int32),
            torch.tensor([n - (pages - 1) * 16], dtype=torch.int32),
            HQ,
            HKV,
            D,
            16,
            q_data_type=DT,
            kv_data_type=DT,
        )
        out = torch.empty_like(q)

        def dense_layers():
            for kv in kv_dense:
                dense.run(q, kv, out=out)

        dense_bytes = n * HKV * D * 2 * 2
        entry["dense_flashinfer"] = _time_layers(dense_layers, dense_bytes, layers)
        # SDPA decode on one layer's contiguous K/V.
        kc = torch.randn(1, HKV, n, D, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)
        ms = cuda_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True),
            reps=20,
            warmup=3,
        )
        entry["dense_torch_sdpa"] = {
            "ms_per_layer": sorted(ms)[10],
            "tbps": dense_bytes / sorted(ms)[10] / 1e9,
        }
        del kc, vc, kv_dense
        torch.cuda.empty_cache()
        for rej in args.rejections:
            glens = [folded_layer(n, rej, gen) for _ in range(layers)]
            npages = [[16 + -(-g // 16) for g in gl] for gl in glens]
            total = sum(map(sum, npages))
            kp = torch.randn(total + 1, 16, D, device="cuda", dtype=DT)
            vp = torch.randn(total + 1, 16, D, device="cuda", dtype=DT)
            perm = torch.randperm(total, device="cuda").to(torch.int32)
            decs, off, kv_bytes = [], 0, 0
            for gl, npl in zip(glens, npages):
                indptr = torch.tensor([0] + npl, dtype=torch.int32).cumsum(0).to(torch.int32)
                last = torch.tensor([(g - 1) % 16 + 1 if g else 16 for g in gl], dtype=torch.int32)
                dec = FoldedPagedDecode(HQ, HKV, D, 1, int(indptr[-1]), "cuda", DT, float_workspace=workspace)
                dec.plan(indptr, perm[off : off + int(indptr[-1])], last.cuda())
                off += int(indptr[-1])
                kv_bytes += sum(W + g for g in gl) * D * 2 * 2
                decs.append(dec)

            def folded_layers():
                for dec in decs:
                    dec.run(q, kp, vp, out=out)

            res = _time_layers(folded_layers, kv_bytes / layers, layers)
            res["rejection"] = rej
            res["kv_bytes_vs_dense"] = kv_bytes / layers / dense_bytes
            for mode in ("eager", "graph"):
                if "ms_per_layer" in res.get(mode, {}) and "ms_per_layer" in entry["dense_flashinfer"].get(
                    mode, {}
                ):
                    res[mode]["speedup_vs_dense_flashinfer"] = (
                        entry["dense_flashinfer"][mode]["ms_per_layer"] / res[mode]["ms_per_layer"]
                    )
            entry.setdefault("wgkv_folded_flashinfer", []).append(res)
            del kp, vp, decs
            torch.cuda.empty_cache()
        rows.append(entry)
        write_json(path, results, "kernel_attention")
        print(json.dumps(entry), flush=True)


def _time_layers(fn, bytes_per_layer, layers):
    res = {}
    ms = cuda_ms(fn, reps=20, warmup=3)
    t = sorted(ms)[len(ms) // 2] / layers
    res["eager"] = {"ms_per_layer": t, "tbps": bytes_per_layer / t / 1e9}
    try:
        graph = capture_graph(fn)
        ms = cuda_ms(graph.replay, reps=30, warmup=3)
        t = sorted(ms)[len(ms) // 2] / layers
        res["graph"] = {"ms_per_layer": t, "tbps": bytes_per_layer / t / 1e9}
    except Exception as exc:
        res["graph"] = {"error": repr(exc)[:300]}
    return res


def plot(results, png):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernels")
    ap.add_argument("--name", default="kernel_attention", help="output file stem")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 262144, 524288])
    ap.add_argument("--rejections", type=float, nargs="+", default=[0.0, 0.5, 0.75, 0.9])
    ap.add_argument("--deadline", type=float, default=3000.0, help="seconds for the whole run")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="default launch shape, no sweep")
    ap.add_argument(
        "--baselines", nargs="+", default=["flashinfer_fa3", "flashinfer_fa2", "torch_sdpa_flash"]
    )
    args = ap.parse_args()
    deadline = Deadline(args.deadline)
    path = os.path.join(args.out, args.name + ".json")
    results = {
        "env": environment(),
        "shape": {"Hq": HQ, "Hkv": HKV, "head_dim": D, "dtype": "bfloat16", "local_window": W, "batch": 1},
    }
    torch.manual_seed(0)
    if not args.skip_decode:
        run_decode(args, deadline, results, path)
    if not args.skip_prefill:
        run_prefill(args, deadline, results, path)
    write_json(path, results, "kernel_attention")
    plot(results, os.path.join(args.out, args.name + ".png"))


if __name__ == "__main__":
    main()
