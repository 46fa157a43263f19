"""Decode-kernel benchmark: Triton plan-free folded decode vs FlashInfer, one Llama-3.1-8B layer shape.

Hq=32, Hkv=8, D=128, bf16, W_local=256, batch 1 (and 8 with ``--batches 1 8``). For each context n
and rejection rate, every (request, layer, KV head) stream holds the full ring (256 tokens) plus
``Binomial(n - 256, 1 - rejection)`` global tokens, on pages drawn in random order from one big pool
(as in a used :class:`~sglang_wgkv.memory.DualCachePool`). Timed, per layer, under CUDA-graph replay
(cudaEvent around many replays of several layers with distinct pages, so the working set exceeds L2):

* ``dense_flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper`` over all n tokens (random page order);
* ``folded_flashinfer``: :class:`FoldedPagedDecode` run (its host ``plan`` and the per-layer index
  build are outside the timed graph: they favour FlashInfer here);
* ``triton``: :func:`folded_decode` reading the page table directly (nothing outside the graph), one
  launch per layer (the split kernel merges: ``DecodeConfig.fused_merge``, the default);
* ``triton_two_launch``: the same with a separate merge launch per layer (``fused_merge=False``).

``--fused-merge`` picks the Triton rows: ``both`` (default), ``fused`` (``triton`` alone) or
``two_launch`` (``triton_two_launch`` alone). ``--kv-dtypes bf16 fp8_e4m3`` adds ``triton_fp8``: the
same streams on FP8 pages (``--kv-cache-dtype fp8_e4m3``'s layout, its served launch shape), with
``vs_bf16`` (the bf16 row's time over its own) and TB/s of the FP8 bytes; ``--sweep-kv-dtype
fp8_e4m3`` sweeps the launch shapes on FP8 pages instead (single-stage shapes too: FP8 tiles reach
shared memory in 8-byte copies where bf16's take 16). Effective TB/s = K+V bytes the kernel must read /
time.
A small launch-shape sweep (block_n, warps, stages, splits; fused merge unless ``two_launch``) runs
first at one shape and is reported; the timed runs use the defaults unless ``--use-best``.
The workload (pool layout, CUDA-graph timing) lives in ``decode_workload``, the figure in
``kernel_plots``.

usage: python -m benchmarks.kernel_decode [--out DIR] [--lengths ...] [--rejections ...] [--batches 1 8]
                                          [--deadline S] [--no-sweep] [--use-best]
                                          [--fused-merge {both,fused,two_launch}]
                                          [--kv-dtypes bf16 fp8_e4m3] [--sweep-kv-dtype fp8_e4m3]
"""

import argparse
import dataclasses
import os

import torch

from benchmarks.common import Deadline, environment, write_json
from benchmarks.decode_workload import (
    DT,
    HKV,
    HQ,
    PAGE,
    TOKEN_BYTES,
    D,
    FoldedPool,
    W,
    fp8_pages,
    global_lengths,
    graph_ms,
    layers_for,
    triton_fn,
)
from benchmarks.kernel_plots import plot_kernel_decode

SWEEP_CONFIGS = [(64, 4, 2), (64, 8, 2), (32, 4, 2), (128, 8, 2), (64, 4, 3), (64, 4, 4)]
# FP8 pages also try one stage: the tiles then load into registers (16-byte loads), not through
# 8-byte cp.async copies into shared memory.
FP8_SWEEP_CONFIGS = [(32, 4, 1), (64, 4, 1), (32, 8, 1), (32, 4, 3), (32, 8, 2)]
TRITON_ROWS = {
    "fused": [("triton", True)],
    "two_launch": [("triton_two_launch", False)],
    "both": [("triton", True), ("triton_two_launch", False)],
}  # --fused-merge -> (key, fused_merge)


def sweep(args, results, gen):
    """Launch shapes at batch 1, 128K tokens, 75% rejection (or the first given length)."""
    from sglang_wgkv.attention.decode_config import MAX_SPLIT_COUNT, DecodeConfig, choose_num_splits

    n = 131072 if 131072 in args.lengths else args.lengths[0]
    glen = global_lengths(1, 1, n, 0.75, gen)
    L = layers_for(int((glen.long() + W).sum()) * TOKEN_BYTES, 16)
    pool = FoldedPool(global_lengths(1, L, n, 0.75, gen), gen)
    fp8 = args.sweep_kv_dtype == "fp8_e4m3"
    paged = fp8_pages(pool) if fp8 else {"kv_bytes_per_layer": pool.kv_bytes_per_layer}
    kv_bytes = paged.pop("kv_bytes_per_layer")
    q = torch.randn(1, HQ, D, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    base = choose_num_splits(1, HKV, n, "cuda")
    rows = []
    fused = args.fused_merge != "two_launch"
    for bn, warps, stages in SWEEP_CONFIGS + (FP8_SWEEP_CONFIGS if fp8 else []):
        for splits in sorted(
            set(args.sweep_splits)
            if args.sweep_splits
            else {max(1, base // 2), base, min(MAX_SPLIT_COUNT, base * 2)}
        ):
            cfg = DecodeConfig(bn, warps, stages, fused)
            try:
                t = graph_ms(triton_fn(pool, q, out, splits, cfg, **paged)) / L
                rows.append(
                    {
                        "block_n": bn,
                        "num_warps": warps,
                        "num_stages": stages,
                        "splits": splits,
                        "ms_per_layer": t,
                        "tbps": kv_bytes / t / 1e9,
                    }
                )
            except Exception as exc:
                rows.append(
                    {
                        "block_n": bn,
                        "num_warps": warps,
                        "num_stages": stages,
                        "splits": splits,
                        "error": repr(exc)[:300],
                    }
                )
    ok = [r for r in rows if "ms_per_layer" in r]
    best = min(ok, key=lambda r: r["ms_per_layer"]) if ok else None
    results["sweep"] = {
        "kv_dtype": args.sweep_kv_dtype,
        "n": n,
        "rejection": 0.75,
        "batch": 1,
        "default_splits": base,
        "fused_merge": fused,
        "rows": rows,
        "best": best,
    }
    print("sweep best:", best, flush=True)
    del pool
    torch.cuda.empty_cache()
    return best


def run(args, deadline, results, path, best):
    import flashinfer

    from sglang_wgkv.attention.decode_config import DecodeConfig, choose_num_splits

    gen = torch.Generator().manual_seed(0)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    rows = results.setdefault("decode", [])
    for B in args.batches:
        for n in args.lengths:
            if B * n * HKV * TOKEN_BYTES > args.max_dense_gb * 2**30:
                rows.append({"batch": B, "n": n, "skipped": "dense KV over --max-dense-gb"})
                continue
            if deadline.left() < 15:
                rows.append({"batch": B, "n": n, "skipped": "deadline"})
                continue
            entry = {"batch": B, "n": n}
            q = torch.randn(B, HQ, D, device="cuda", dtype=DT)
            out = torch.empty_like(q)
            # Dense: HKV heads per token, all n tokens, one page list per request in random order.
            pages = -(-n // PAGE)
            dense_bytes = B * n * HKV * TOKEN_BYTES
            L = layers_for(dense_bytes, 4)
            kv = [torch.randn(B * pages, 2, PAGE, HKV, D, device="cuda", dtype=DT) for _ in range(L)]
            dense = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=torch.zeros(B * pages, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buffer=torch.zeros(B, dtype=torch.int32, device="cuda"),
            )
            dense.plan(
                torch.arange(B + 1, dtype=torch.int32) * pages,
                torch.randperm(B * pages, device="cuda").to(torch.int32),
                torch.full((B,), n - (pages - 1) * PAGE, dtype=torch.int32),
                HQ,
                HKV,
                D,
                PAGE,
                q_data_type=DT,
                kv_data_type=DT,
            )

            def dense_run():
                for layer_kv in kv:
                    dense.run(q, layer_kv, out=out)

            try:
                t = graph_ms(dense_run) / L
                entry["dense_flashinfer"] = {"ms": t, "tbps": dense_bytes / t / 1e9, "layers": L}
            except Exception as exc:
                entry["dense_flashinfer"] = {"error": repr(exc)[:300]}
            del kv, dense
            torch.cuda.empty_cache()
            splits = best["splits"] if args.use_best and best else choose_num_splits(B, HKV, n, "cuda")
            swept = DecodeConfig(best["block_n"], best["num_warps"], best["num_stages"]) if best else None
            use_best = args.use_best and best is not None
            cfg = swept if use_best and args.sweep_kv_dtype == "bf16" else DecodeConfig()
            fp8_cfg = swept if use_best and args.sweep_kv_dtype == "fp8_e4m3" else None
            fp8_cfg = fp8_cfg or DecodeConfig.for_pages(torch.float8_e4m3fn)
            fp8_splits = splits if use_best else choose_num_splits(B, HKV, n, "cuda", fp8_cfg.programs_per_sm)
            entry["triton_launch"] = {
                "splits": splits,
                "block_n": cfg.block_n,
                "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages,
            }
            for rej in args.rejections:
                if deadline.left() < 8:
                    entry.setdefault("folded", []).append({"rejection": rej, "skipped": "deadline"})
                    continue
                per_layer = B * HKV * (W + (1 - rej) * max(n - W, 0)) * TOKEN_BYTES
                L = layers_for(int(per_layer), 16)
                pool = FoldedPool(global_lengths(B, L, n, rej, gen), gen)
                res = {
                    "rejection": rej,
                    "layers": L,
                    "kv_bytes_per_layer": pool.kv_bytes_per_layer,
                    "kv_bytes_vs_dense": pool.kv_bytes_per_layer / dense_bytes,
                }
                try:
                    decs = pool.flashinfer_plans(workspace)

                    def fi_run():
                        for dec in decs:
                            dec.run(q, pool.k_pages, pool.v_pages, out=out)

                    t = graph_ms(fi_run) / L
                    res["folded_flashinfer"] = {"ms": t, "tbps": pool.kv_bytes_per_layer / t / 1e9}
                    del decs
                except Exception as exc:
                    res["folded_flashinfer"] = {"error": repr(exc)[:300]}
                for key, fused in TRITON_ROWS[args.fused_merge]:
                    try:
                        t = (
                            graph_ms(
                                triton_fn(pool, q, out, splits, dataclasses.replace(cfg, fused_merge=fused))
                            )
                            / L
                        )
                        res[key] = {"ms": t, "tbps": pool.kv_bytes_per_layer / t / 1e9}
                    except Exception as exc:
                        res[key] = {"error": repr(exc)[:300]}
                    for base in ("dense_flashinfer", "folded_flashinfer"):
                        ref = entry.get(base) if base == "dense_flashinfer" else res.get(base)
                        if "ms" in (ref or {}) and "ms" in res[key]:
                            res[key][f"speedup_vs_{base}"] = ref["ms"] / res[key]["ms"]
                if "fp8_e4m3" in args.kv_dtypes:
                    try:
                        paged = fp8_pages(pool)
                        fp8_bytes = paged.pop("kv_bytes_per_layer")
                        t = graph_ms(triton_fn(pool, q, out, fp8_splits, fp8_cfg, **paged)) / L
                        res["triton_fp8"] = {
                            "ms": t,
                            "tbps": fp8_bytes / t / 1e9,
                            "block_n": fp8_cfg.block_n,
                            "num_warps": fp8_cfg.num_warps,
                            "num_stages": fp8_cfg.num_stages,
                            "splits": fp8_splits,
                        }
                        if "ms" in res.get("triton", {}):
                            res["triton_fp8"]["vs_bf16"] = res["triton"]["ms"] / t
                        del paged
                    except Exception as exc:
                        res["triton_fp8"] = {"error": repr(exc)[:300]}
                if "ms" in res.get("triton", {}) and "ms" in res.get("triton_two_launch", {}):
                    res["triton"]["speedup_vs_two_launch"] = (
                        res["triton_two_launch"]["ms"] / res["triton"]["ms"]
                    )
                if "ms" in res["folded_flashinfer"] and "ms" in entry.get("dense_flashinfer", {}):
                    res["folded_flashinfer"]["speedup_vs_dense_flashinfer"] = (
                        entry["dense_flashinfer"]["ms"] / res["folded_flashinfer"]["ms"]
                    )
                entry.setdefault("folded", []).append(res)
                print(B, n, res, flush=True)
                del pool
                torch.cuda.empty_cache()
            rows.append(entry)
            write_json(path, results, "kernel_decode")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernels")
    ap.add_argument("--name", default="kernel_decode", help="output file stem")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 262144, 524288])
    ap.add_argument("--rejections", type=float, nargs="+", default=[0.0, 0.5, 0.75, 0.9])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds for the whole run")
    ap.add_argument(
        "--max-dense-gb", type=float, default=24.0, help="skip shapes whose dense KV per layer is larger"
    )
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    ap.add_argument(
        "--sweep-splits",
        type=int,
        nargs="+",
        default=None,
        help="split counts the sweep tries (default: half, once and twice choose_num_splits)",
    )
    ap.add_argument(
        "--use-best", action="store_true", help="time the sweep's best launch shape, not the default"
    )
    ap.add_argument(
        "--fused-merge",
        choices=sorted(TRITON_ROWS),
        default="both",
        help="Triton rows: one launch per layer (triton), two (triton_two_launch) or both",
    )
    ap.add_argument(
        "--kv-dtypes",
        nargs="+",
        choices=["bf16", "fp8_e4m3"],
        default=["bf16"],
        help="with fp8_e4m3: each Triton case on FP8 pages too (triton_fp8, vs_bf16)",
    )
    ap.add_argument(
        "--sweep-kv-dtype", choices=["bf16", "fp8_e4m3"], default="bf16", help="the pages the sweep reads"
    )
    args = ap.parse_args(argv)
    if any(n < W for n in args.lengths) or any(not 0.0 <= r <= 1.0 for r in args.rejections):
        ap.error(f"lengths must be >= {W} and rejections in [0, 1]")
    return args


def main():
    args = parse_args()
    deadline = Deadline(args.deadline)
    path = os.path.join(args.out, args.name + ".json")
    results = {
        "env": environment(),
        "shape": {
            "Hq": HQ,
            "Hkv": HKV,
            "head_dim": D,
            "dtype": "bfloat16",
            "local_window": W,
            "page_size": PAGE,
        },
    }
    torch.manual_seed(0)
    best = None if args.no_sweep else sweep(args, results, torch.Generator().manual_seed(1))
    run(args, deadline, results, path, best)
    write_json(path, results, "kernel_decode")
    plot_kernel_decode(results, os.path.join(args.out, args.name + ".png"))


if __name__ == "__main__":
    main()
