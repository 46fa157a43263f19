"""Host cost of one prefill chunk as the context grows to a million tokens (pool-level, no server).

Drives a :class:`~sglang_wgkv.memory.DualCachePool` the way the ``wgkv`` backend's extend does, one
request prefilled chunk by chunk: ``begin_extend`` (host plan), per layer ``extend_inputs`` (the
cached context gathered for attention) and ``write_extend`` (promotion), the evictor's observation
(a bounded request, as a million-token request on a server gets) and the step boundary
(``maybe_evict``), with random admission. The model shape is small (the host structures scale with
the chunk, the batch and the layers, not with ``head_dim``), so a million tokens fit a CPU's memory.

Per sampled chunk: the plan's host and device index sizes (O(chunk): no structure grows with the
context), the gathered context rows per layer (what attention reads: the admitted keys, O(context)
and bounded by a budget when one is set), the wall time of the chunk's pool work and the process's
RSS. Run: ``python -m benchmarks.chunked_prefill_host --out benchmarks/results/long_context/chunked_prefill_host.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def plan_sizes(plan) -> tuple[int, int]:
    """(device index elements, host list entries) of an :class:`ExtendPlan`."""
    device = sum(v.numel() for v in vars(plan).values() if isinstance(v, torch.Tensor))
    host = sum(len(v) for v in (plan.prefix_lens, plan.req_slots, plan.extend_lens))
    host += sum(len(row) for row in plan.context_gcols)
    return device, host


def run(args) -> dict:
    torch.manual_seed(0)
    L, H, G, D, W = args.layers, args.kv_heads, args.group, args.head_dim, args.local_window
    n, chunk, rate = args.tokens, args.chunk, args.admit
    kept = (
        int(n * rate * 1.1) + W + 4 * chunk if args.kv_budget is None else args.kv_budget * 3 + W + 4 * chunk
    )
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=L * H * (kept // 16 + 8),
        max_requests=2,
        max_context_len=n + 16,
        config=WGKVConfig(local_window=W),
        dtype=torch.float32,
    )
    evictor = SnapKVEvictor(pool, budget=None, num_q_heads=H * G, window=min(32, W), rows=1)
    pool.alloc_request(1)
    if args.kv_budget is not None:
        evictor.bound_request(1, args.kv_budget, 2 * args.kv_budget, min(32, args.kv_budget // 8))
    else:  # a pool bound that admission never reaches: observation and boundary checks, no compression
        evictor.bound_request(1, n, n, 32)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(chunk, H, D, generator=gen)
    v = torch.randn(chunk, H, D, generator=gen)
    q = torch.randn(chunk, H * G, D, generator=gen)
    samples, done, rss0, window = [], 0, rss_mib(), []
    next_sample = 0
    while done < n:
        c = min(chunk, n - done)
        t0 = time.perf_counter()
        evictor.open_prompts([1])
        evictor.maybe_evict()
        plan = pool.begin_extend([1], [done], [c])
        evictor.mark_extend([1], [done + c == n])
        positions = torch.arange(done, done + c)
        rows, phase = [], {"gather": 0.0, "write": 0.0}
        t1 = time.perf_counter()
        for layer in range(L):
            admit = torch.rand(c, H, generator=gen) < rate
            evictor.observe_extend(layer, q[:c])
            t = time.perf_counter()
            keys, _, _, _ = pool.extend_inputs(layer, k[:c], v[:c], admit, positions, torch.float32)
            phase["gather"] += time.perf_counter() - t
            rows.append(keys.shape[0])
            t = time.perf_counter()
            pool.write_extend(layer, k[:c], v[:c], admit)
            phase["write"] += time.perf_counter() - t
        window.append(
            (
                1000 * (time.perf_counter() - t0),
                1000 * (t1 - t0),
                1000 * phase["gather"],
                1000 * phase["write"],
            )
        )
        done += c
        if done >= next_sample or done == n:
            device_idx, host_idx = plan_sizes(plan)
            ms, plan_ms, gather_ms, write_ms = np.median(np.array(window), axis=0).round(2).tolist()
            window = []
            samples.append(
                {
                    "context_tokens": done,
                    "median_chunk_ms": ms,
                    "median_plan_ms": plan_ms,
                    "median_gather_ms": gather_ms,
                    "median_write_ms": write_ms,
                    "plan_device_index_elems": device_idx,
                    "plan_host_entries": host_idx,
                    "gathered_rows_per_layer": int(np.max(rows)),
                    "max_global_per_head": int(pool.global_len[1].max()),
                    "rss_mib_over_start": round(rss_mib() - rss0, 1),
                }
            )
            next_sample += args.sample_every
    evictor.maybe_evict()
    pool.free_request(1)
    pool.check_integrity()
    return {"samples": samples, "pool_pages": pool.allocator.num_pages}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--admit", type=float, default=0.25)
    p.add_argument("--kv-budget", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--local-window", type=int, default=256)
    p.add_argument("--sample-every", type=int, default=65536)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = {
        "kind": "chunked_prefill_host",
        "command": "python -m benchmarks.chunked_prefill_host " + " ".join(argv or sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "device": "cpu",
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        **run(args),
    }
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
