"""Kernel benchmark: WG-KV prefill and decode attention vs dense kernels, one Llama-3.1-8B layer.

Prefill (batch 1, N tokens, Hq=32, Hkv=8, D=128, bf16, W_local=256): the Triton vertical-slash kernel
at 0/50/75/90% rejection (random admission per token and head) against dense causal FlashInfer FA3
and FA2 (``single_prefill_with_kv_cache``) and torch SDPA (flash backend).
Decode (batch 1): FlashInfer folded-head decode (ring + global pages of each head, pages in random
order) against dense FlashInfer paged decode (same page size, random page order) and SDPA, over 8
layers with distinct memory, eager and CUDA-graph replay. Effective bandwidth = K+V bytes / time.
The prefill half lives in ``kernel_attention_prefill``, the figure in ``kernel_plots``.

usage: python -m benchmarks.kernel_attention --out DIR [--lengths 32768 131072 ...] [--deadline S]
"""

import argparse
import json
import os

import torch

from benchmarks.common import Deadline, capture_graph, cuda_ms, environment, write_json
from benchmarks.kernel_attention_prefill import DT, HKV, HQ, D, W, run_prefill
from benchmarks.kernel_plots import plot_kernel_attention


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
        "--fused-qkv", action="store_true", help="prefill q, k, v as views of one fused row (as served)"
    )
    ap.add_argument(
        "--baselines",
        nargs="+",
        default=["flashinfer_fa3", "flashinfer_fa2", "torch_sdpa_flash", "sgl_kernel_fa3"],
    )
    ap.add_argument("--positions-int64", action="store_true", help="int64 positions (as served)")
    args = ap.parse_args()
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
            "batch": 1,
            "fused_qkv": args.fused_qkv,
            "positions": "int64" if args.positions_int64 else "int32",
        },
    }
    torch.manual_seed(0)
    if not args.skip_decode:
        run_decode(args, deadline, results, path)
    if not args.skip_prefill:
        run_prefill(args, deadline, results, path)
    write_json(path, results, "kernel_attention")
    plot_kernel_attention(results, os.path.join(args.out, args.name + ".png"))


if __name__ == "__main__":
    main()
