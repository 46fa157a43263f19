"""The paper's Fig. 8 protocol (App. I): Llama-3.1-8B shape, random weights, batch 1, 75% rejection.

Two engines over the same :class:`fig8_model.RandomLlama`, measured in the same run:

* dense: FlashInfer FA3 causal prefill (``single_prefill_with_kv_cache(backend="fa3")``), a dense
  paged KV cache (16-token pages, allocated for the whole context), FlashInfer paged decode;
* WG-KV: the write gate runs on every token (its decision is replaced by a random 25% admission
  mask, App. I.3), Triton vertical-slash prefill, the core ``DualCachePool`` (ring + global pages,
  sized for the admitted tokens) filled by the Triton prefill write; per decode step the Triton lazy
  promotion (``triton_pool.decode_promote``), the Triton decode write and the decode attention:
  ``--decode triton`` (default): the plan-free Triton split-KV decode
  (``attention.triton_decode.folded_decode``); the whole step, promotion included, is one CUDA
  graph replay with no host sync but the token; ``--decode flashinfer``: FlashInfer folded-head
  decode, promotion by ``begin_decode`` before the replay, one host sync for the page counts and a
  FlashInfer plan per layer whose page counts changed.

Optional extra dense prefill baselines (``--extra-dense fa2 sdpa`` at ``--extra-dense-lengths``):
the same dense engine with FlashInfer FA2 or torch SDPA (flash backend) prefill attention; TTFT and
peak memory only (no decode).

TTFT = wall time of the prefill forward up to the first token on the host. TPOT = mean wall time of
100 decode steps after 5 warm-up steps (the first one captures the CUDA graph); every step syncs
once for its token. Peak memory = ``torch.cuda.max_memory_allocated`` over prefill + decode,
weights included. A length that does not fit records ``{"oom": ...}``.

Each length and mode is one entry of ``<out>/<name>.json``; ``--append`` merges a run into an
existing file (so a sweep can be split over several time-limited runs); ``<name>.md`` is the markdown
table of everything in the file.

The engines live in ``fig8_engines`` (the step loop, dense) and ``fig8_wgkv_engine``, the table
and figure in ``fig8_report``, the model in ``fig8_model``.

usage: python -m benchmarks.fig8_end_to_end --out DIR [--lengths 131072 ...] [--modes wgkv dense]
       [--decode triton|flashinfer] [--extra-dense fa2 sdpa --extra-dense-lengths 131072]
       [--name STEM --append] [--deadline S]
"""

import argparse
import gc
import json
import os
import time

import torch

from benchmarks.common import Deadline, environment, write_json
from benchmarks.fig8_engines import DEVICE, P_ADMIT, STEPS, WARMUP, WINDOW, DenseEngine
from benchmarks.fig8_model import HKV, HQ, LAYERS, D, RandomLlama
from benchmarks.fig8_report import markdown, plot, ratios
from benchmarks.fig8_wgkv_engine import WGKVEngine


def measure(engine, n, decode=True):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine.prefill(n)
    ttft = time.perf_counter() - t0
    res = {"ttft_s": ttft}
    if decode:
        for _ in range(WARMUP):
            engine.decode_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            engine.decode_step()
        res.update(tpot_ms=(time.perf_counter() - t0) / STEPS * 1e3, graph=engine.graph is not None)
    res["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    res.update(engine.kv_bytes())
    return res


def make_engine(model, n_max, key, workspace, use_graph, cfg):
    """key: "dense" | "dense_fa2" | "dense_sdpa" (prefill only) | "wgkv" | "wgkv_triton" | "wgkv_flashinfer"."""
    if key.startswith("dense"):
        return DenseEngine(model, n_max, workspace, use_graph, key[6:] or "fa3")
    return WGKVEngine(model, n_max, workspace, use_graph, cfg, key[5:])


def run_length(model, n, key, workspace, use_graph, cfg):
    """One measurement; ``{"oom": ...}`` when the engine or its run does not fit."""
    n_max = n + WARMUP + STEPS + 1
    res = None
    try:
        engine = make_engine(model, n_max, key, workspace, use_graph, cfg)
        res = {"engine": engine.name, **measure(engine, n, decode=key not in ("dense_fa2", "dense_sdpa"))}
    except torch.cuda.OutOfMemoryError as exc:
        res = {"oom": str(exc)[:300]}
    engine = None  # drop the engine (and, after an OOM, the traceback's references) before freeing
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/paper_fig8")
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 409600, 512000])
    ap.add_argument("--deadline", type=float, default=3000.0)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--eager", action="store_true", help="no CUDA graph for decode")
    ap.add_argument("--modes", nargs="+", default=["wgkv", "dense"], choices=["wgkv", "dense"])
    ap.add_argument(
        "--decode",
        nargs="+",
        default=["triton"],
        choices=["triton", "flashinfer"],
        help="WG-KV decode attention; the first is column 'wgkv', others 'wgkv_<name>'",
    )
    ap.add_argument(
        "--extra-dense",
        nargs="*",
        default=[],
        choices=["fa2", "sdpa"],
        help="also measure dense TTFT with these prefill backends (columns 'dense_<name>')",
    )
    ap.add_argument(
        "--extra-dense-lengths",
        type=int,
        nargs="*",
        default=[],
        help="lengths (among --lengths) for --extra-dense",
    )
    ap.add_argument("--name", default="fig8_end_to_end", help="output file stem")
    ap.add_argument("--append", action="store_true", help="merge into an existing <name>.json")
    args = ap.parse_args()
    deadline = Deadline(args.deadline)
    path = os.path.join(args.out, args.name + ".json")
    cfg = None
    if os.path.exists("/tmp/wgkv_prefill_config.json"):
        from sglang_wgkv.attention.triton_prefill import PrefillConfig

        with open("/tmp/wgkv_prefill_config.json") as f:
            cfg = PrefillConfig(**json.load(f))
    columns = []  # (key, lengths)
    if "wgkv" in args.modes:
        columns += [("wgkv" if i == 0 else f"wgkv_{d}", args.lengths) for i, d in enumerate(args.decode)]
    if "dense" in args.modes:
        columns.append(("dense", args.lengths))
    columns += [
        (f"dense_{b}", [n for n in args.lengths if n in args.extra_dense_lengths]) for b in args.extra_dense
    ]
    engine_key = {"wgkv": "wgkv_" + args.decode[0]}
    torch.manual_seed(0)
    model = RandomLlama(max(args.lengths) + WARMUP + STEPS + 16, layers=args.layers)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
    protocol = {
        "layers": args.layers,
        "q_heads": HQ,
        "kv_heads": HKV,
        "head_dim": D,
        "dtype": "bfloat16",
        "batch": 1,
        "local_window": WINDOW,
        "admission": f"random {P_ADMIT} per (token, layer, head), gate MLP evaluated",
        "decode_steps": STEPS,
        "warmup_steps": WARMUP,
        "cuda_graph_decode": not args.eager,
        "prefill_config": cfg.__dict__ if cfg else "default",
    }
    run = {
        "env": environment(),
        "protocol": protocol,
        "columns": [c for c, _ in columns],
        "wgkv_decode": args.decode[0],
    }
    if args.append and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
        results.setdefault("runs", []).append(run)
    else:
        results = {**run, "weight_bytes": model.weight_bytes(), "lengths": [], "runs": [run]}
    for key, lengths in columns:  # warm-up pass: JIT builds, Triton compiles, graph machinery
        if lengths:
            run.setdefault("warmup", {})[key] = run_length(
                model, 8192, engine_key.get(key, key), workspace, not args.eager, cfg
            )
    write_json(path, results, "fig8")
    for n in args.lengths:
        row = next((r for r in results["lengths"] if r["n"] == n), None)
        if row is None:
            row = {"n": n}
            results["lengths"].append(row)
        for key, lengths in columns:
            if n not in lengths:
                continue
            done = [r for r in results["lengths"] if "ttft_s" in r.get(key, {})]
            est = 0.0
            if done:  # quadratic extrapolation from the longest measured length
                last = max(done, key=lambda r: r["n"])
                est = last[key]["ttft_s"] * (n / last["n"]) ** 2 + 15
            if deadline.left() < est:
                row[key] = {"skipped": f"deadline: ~{est:.0f} s needed, {deadline.left():.0f} s left"}
                continue
            row[key] = run_length(model, n, engine_key.get(key, key), workspace, not args.eager, cfg)
            print(n, key, json.dumps(row[key]), flush=True)
            row["ratios"] = ratios(row)
            write_json(path, results, "fig8")
        if row.get("ratios"):
            print(n, "ratios", json.dumps(row["ratios"]), flush=True)
    write_json(path, results, "fig8")
    table = markdown(results)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(table)
    print(table, flush=True)
    plot(results, os.path.join(args.out, args.name + ".png"))


if __name__ == "__main__":
    main()
