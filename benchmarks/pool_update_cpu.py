"""Time one decode-step pool update (promotion for all layers + ring writes per layer) on this CPU.

python -m benchmarks.pool_update_cpu [--requests 32 --layers 30 --kv-heads 3 --head-dim 64 --context 1024]
Writes benchmarks/results/kernels/pool_update_cpu.json.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "kernels" / "pool_update_cpu.json")
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    B, L, H, D = a.requests, a.layers, a.kv_heads, a.head_dim
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=B * L * H * (a.context // 16 + 20),
        max_requests=B,
        max_context_len=a.context + a.steps + 16,
        config=WGKVConfig(),
        dtype=torch.bfloat16,
    )
    slots = list(range(B))
    for r in slots:
        pool.alloc_request(r)
    pool.begin_extend(slots, [0] * B, [a.context] * B)
    for layer in range(L):
        pool.write_extend(
            layer,
            torch.randn(B * a.context, H, D),
            torch.randn(B * a.context, H, D),
            torch.rand(B * a.context, H) < 0.25,
        )
    k, v = torch.randn(B, H, D), torch.randn(B, H, D)
    admit = torch.rand(B, H) < 0.25
    slots_dev = torch.tensor(slots)
    times = []
    for step in range(a.steps):
        lens = [a.context + step] * B
        t0 = time.perf_counter()
        pool.begin_decode(slots, lens, slots_dev, torch.tensor(lens))
        for layer in range(L):
            pool.write_decode(layer, k, v, admit)
        times.append(time.perf_counter() - t0)
    pool.check_integrity()
    times = sorted(times[5:])
    res = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": {"requests": B, "layers": L, "kv_heads": H, "head_dim": D, "context": a.context},
        "decode_step_pool_update_ms": {
            "median": 1e3 * times[len(times) // 2],
            "min": 1e3 * times[0],
            "p90": 1e3 * times[int(0.9 * len(times))],
        },
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"kind": "pool_update_cpu", **res}, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
