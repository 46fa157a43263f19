"""Where one decode launch's time goes at the served W1 shape (issue 15): the fixed cost per launch.

Batch 1, Llama-3.1-8B layer (Hq 32, Hkv 8, D 128, bf16), W_local 256, 75% rejection (25% of the tokens
past the ring admitted), pages in random order (:class:`benchmarks.decode_workload.FoldedPool`). Each
variant is timed per layer under CUDA-graph replay over several layers (working set > L2) at several
context lengths, and fitted as ``ms = fixed + bytes / bandwidth`` (least squares over the lengths):
``fixed`` is what a launch costs whatever it reads (launch gap, prologue, the merge tail).

Variants (all :func:`folded_decode`, default launch shape unless named):

* ``fused``: one launch per layer, the split kernel merges (the served default);
* ``fused_write``: the same with the step's ring write fused (``new_k``/``new_v``, as served):
  its extra time over ``fused`` is what the fused write adds to the split kernel (the separate
  write launch it replaced took ~3.9 us per layer in the served W1 profile);
* ``fused_no_prefetch`` (older result files only): ``fused`` without the merge loop's prefetch of the
  next tile of partials, which gained nothing and went (kernels/decode_fixed_cost.json);
* ``fused_write_pdl``: ``fused_write`` launched with programmatic dependent launch
  (``DecodeConfig.pdl``): each layer's launch overlaps the previous one's tail; its gain over
  ``fused_write`` bounds what PDL can take off the fixed cost (between two split kernels; in service
  the kernel before it is SGLang's RoPE);
* ``two_launch``: a separate merge kernel; ``split_only``: the split kernel alone (merge launch
  stubbed out: wrong output, timing only) - ``two_launch - split_only`` is the merge kernel;
* ``empty``: a launch over streams of one token each (the launch gap and the prologue alone).

Then a split-count sweep of ``fused_write`` at the W1 length. Writes JSON (command included).

``--configs SPEC ...`` also times ``fused_write`` under each launch shape (``DecodeConfig.parse``
specs, as ``--wgkv-decode-launch`` takes them; the split count as the served path chooses it from
the spec's ``programs_per_sm``) at every length, fitted the same way, against the default shape
(``""``, always first). ``--best-out FILE`` then writes the spec that is fastest at the W1 length
if it beats the default by ``--min-gain`` (else an empty file): a later served run reads it.

usage: python -m benchmarks.decode_fixed_cost [--out DIR] [--lengths ...] [--splits ...] [--deadline S]
                                              [--variants ...] [--configs SPEC ...] [--best-out FILE]
"""

import argparse
import os
import sys

import numpy as np
import torch

from benchmarks.common import Deadline, environment, write_json
from benchmarks.decode_workload import (
    DT,
    HKV,
    HQ,
    TOKEN_BYTES,
    D,
    FoldedPool,
    W,
    global_lengths,
    graph_ms,
    layers_for,
    triton_fn,
)

W1_TOKENS = 126976 + 128
W1_POS = W1_TOKENS - 1  # the decoded position of fused_write: slot pos % W lies in the (full) ring


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing (``split_only``)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def variant_fn(name, pool, q, out, splits, cfg=None):
    from sglang_wgkv.attention.decode_config import DecodeConfig

    B = q.shape[0]
    if cfg is None:
        cfg = DecodeConfig(
            fused_merge=name not in ("two_launch", "split_only"), pdl=name == "fused_write_pdl"
        )
    extra = {}
    if name in ("fused_write", "fused_write_pdl"):
        k_new = torch.randn(B, HKV, D, device="cuda", dtype=DT)
        pos = torch.full((B,), W1_POS, dtype=torch.int64, device="cuda")
        extra = dict(new_k=k_new, new_v=torch.randn_like(k_new), pos=pos, window=W)
    return triton_fn(pool, q, out, splits, cfg, **extra)


def timed(name, pool, q, out, splits, td, cfg=None):
    saved = td._merge_kernel
    try:
        if name == "split_only":
            td._merge_kernel = _NoLaunch()
        return graph_ms(variant_fn(name, pool, q, out, splits, cfg))
    finally:
        td._merge_kernel = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernels")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, W1_TOKENS, 262144])
    ap.add_argument("--splits", type=int, nargs="+", default=[24, 33, 40, 44, 49, 55, 66, 80, 99, 128])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["fused", "fused_write", "fused_write_pdl", "two_launch", "split_only", "empty"],
    )
    ap.add_argument("--deadline", type=float, default=150.0)
    ap.add_argument(
        "--configs", nargs="*", default=[], help="launch shapes (DecodeConfig.parse specs) to time"
    )
    ap.add_argument("--best-out", default=None, help="write the fastest spec at the W1 length here")
    ap.add_argument(
        "--min-gain", type=float, default=0.03, help="the best spec's least gain over the default"
    )
    args = ap.parse_args()
    from sglang_wgkv.attention import decode_config as dc
    from sglang_wgkv.attention import triton_decode as td

    configs = [""] + [c for c in args.configs if c != ""] if args.configs else []
    launch = {c: dc.DecodeConfig.parse(c) for c in configs}
    launch_splits = {
        c: dc.choose_num_splits(1, HKV, 131072, "cuda", cfg.programs_per_sm) for c, cfg in launch.items()
    }

    deadline = Deadline(args.deadline)
    path = os.path.join(args.out, "decode_fixed_cost.json")
    results = {
        "env": environment(),
        "command": "python3 " + " ".join(sys.argv),
        "shape": {"batch": 1, "Hq": HQ, "Hkv": HKV, "head_dim": D, "local_window": W, "rejection": 0.75},
        "by_length": [],
        "fit": {},
        "splits_sweep": [],
    }
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, D, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    splits = dc.choose_num_splits(1, HKV, 131072, "cuda")
    results["default_splits"] = splits
    for n in args.lengths:
        if deadline.left() < 20:
            results["by_length"].append({"n": n, "skipped": "deadline"})
            continue
        per_layer = HKV * (W + 0.25 * (n - W)) * TOKEN_BYTES
        L = layers_for(int(per_layer), 16)
        pool = FoldedPool(global_lengths(1, L, n, 0.75, gen), gen)
        row = {"n": n, "layers": L, "kv_bytes_per_layer": pool.kv_bytes_per_layer, "ms_per_layer": {}}
        for name in args.variants:
            if name == "empty":
                continue
            row["ms_per_layer"][name] = timed(name, pool, q, out, splits, td) / L
        if configs:
            row["config_ms_per_layer"] = {}
        for spec in configs:
            if deadline.left() < 10:
                break
            row["config_ms_per_layer"][spec] = (
                timed("fused_write", pool, q, out, launch_splits[spec], td, launch[spec]) / L
            )
        results["by_length"].append(row)
        print(row, flush=True)
        if n == W1_TOKENS:
            for s in args.splits:
                if deadline.left() < 10:
                    break
                t = timed("fused_write", pool, q, out, s, td) / L
                results["splits_sweep"].append(
                    {"splits": s, "ms_per_layer": t, "tbps": pool.kv_bytes_per_layer / t / 1e9}
                )
                print("splits", s, t, flush=True)
        del pool
        torch.cuda.empty_cache()
        write_json(path, results, "decode_fixed_cost")
    if "empty" in args.variants:  # one token per stream: launch gap + prologue + a one-split merge
        empty = FoldedPool(torch.zeros(1, 16, HKV, dtype=torch.int32), gen)
        empty.ring.fill_(1)
        results["empty_ms_per_layer"] = timed("fused", empty, q, out, splits, td) / 16
    rows = [r for r in results["by_length"] if "ms_per_layer" in r]
    if len(rows) >= 2:
        for name in rows[0]["ms_per_layer"]:
            results["fit"][name] = fit_line(
                [(r["kv_bytes_per_layer"], r["ms_per_layer"][name]) for r in rows]
            )
    if configs:
        results["configs"] = config_summary(configs, launch_splits, rows, args.min_gain)
        if args.best_out:
            best = results["configs"]["best"]
            with open(args.best_out, "w") as f:
                f.write(best or "")
    write_json(path, results, "decode_fixed_cost")
    print(
        {
            "fit": results["fit"],
            "empty_ms_per_layer": results.get("empty_ms_per_layer"),
            "configs": results.get("configs"),
        },
        flush=True,
    )


def fit_line(points) -> dict:
    """``ms = fixed + bytes / bandwidth`` by least squares over ``(bytes, ms)`` points."""
    slope, fixed = np.polyfit([b for b, _ in points], [ms for _, ms in points], 1)
    return {"fixed_us": float(fixed) * 1e3, "tbps_marginal": 1e-9 / (float(slope) * 1e-3)}


def config_summary(configs, launch_splits, rows, min_gain):
    """Per launch shape: its split count, ms per layer at the W1 length, the fit over the lengths that
    timed it; ``best``: the fastest spec at the W1 length if it beats the default ``""`` by
    ``min_gain`` (None otherwise, or when the W1 length did not time them all)."""
    out = {"rows": [], "best": None, "min_gain": min_gain}
    w1 = next((r.get("config_ms_per_layer", {}) for r in rows if r["n"] == W1_TOKENS), {})
    for spec in configs:
        pts = [
            (r["kv_bytes_per_layer"], r["config_ms_per_layer"][spec])
            for r in rows
            if spec in r.get("config_ms_per_layer", {})
        ]
        out["rows"].append(
            {
                "spec": spec,
                "splits": launch_splits[spec],
                "w1_ms_per_layer": w1.get(spec),
                "fit": fit_line(pts) if len(pts) >= 2 else None,
            }
        )
    if len(w1) == len(configs) and "" in w1:
        best = min(w1, key=w1.get)
        if w1[""] / w1[best] >= 1 + min_gain:
            out["best"] = best
    return out


if __name__ == "__main__":
    main()
