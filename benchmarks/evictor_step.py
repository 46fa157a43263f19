"""Cost of the SnapKV evictor at model scale (default: Qwen3-4B attention, the paper's App. K setup).

python -m benchmarks.evictor_step [--requests 8 --layers 36 --kv-heads 8 --q-heads 32 --head-dim 128
                                  --budget 4096 --window 256] [--scores auto|torch|triton] [--out PATH]

Measures (CUDA if available, else CPU):
* ``maybe_evict`` when no request's host bound exceeds the budget (the per-step cost: host only);
* ``observe_decode`` for one layer of a decode batch;
* one eviction of every stream of 1 and of all requests, each stream at ``budget + 1`` global tokens
  (the pool state is restored between repetitions), with the peak extra device memory.
Writes benchmarks/results/kernels/evictor_step.json.
"""

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_json
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool, SnapKVEvictor


def build(a, dev):
    L, H, D, W, B = a.layers, a.kv_heads, a.head_dim, a.window, a.requests
    n = a.budget + W + 1  # every stream ends at budget + 1 global tokens
    pages_per_req = L * H * (n // 16 + 2)
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=B * pages_per_req,
        max_requests=B,
        max_context_len=n + 64,
        config=WGKVConfig(local_window=W),
        dtype=torch.bfloat16,
        device=dev,
    )
    scores = {"auto": None, "torch": False, "triton": True}[a.scores]
    ev = SnapKVEvictor(pool, budget=a.budget, num_q_heads=a.q_heads, window=W, triton_scores=scores)
    for r in range(B):
        pool.alloc_request(r)
        pool.begin_extend([r], [0], [n])  # one request at a time keeps the temporaries small
        for layer in range(L):
            ev.observe_extend(layer, torch.randn(n, a.q_heads, D, device=dev, dtype=torch.bfloat16))
            kv = torch.randn(2, n, H, D, device=dev, dtype=torch.bfloat16)
            pool.write_extend(layer, kv[0], kv[1], torch.ones(n, H, dtype=torch.bool, device=dev))
    return pool, ev


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, reps, setup=None):
    out = []
    for _ in range(reps):
        if setup:
            setup()
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--scores",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="the evictor's scores: the torch reference or the Triton kernel (auto: the kernel on CUDA)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels" / "evictor_step.json"))
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    pool, ev = build(a, dev)
    B = a.requests
    saved = {name: getattr(pool, name).clone() for name in ("page_table", "global_len")}
    alloc = {name: getattr(pool.allocator, name).clone() for name in ("free_stack", "num_free", "ref")}
    cached = pool.cached_len.copy()

    def restore(active):
        for name, t in saved.items():
            getattr(pool, name).copy_(t)
        for name, t in alloc.items():
            getattr(pool.allocator, name).copy_(t)
        pool.allocator.sync_free()
        pool.cached_len[:] = cached
        pool.active[:] = False
        pool.active[:active] = True
        ev._exact_max[:] = 0
        ev._left_at_exact[:] = 0

    result = {"env": environment(), "args": vars(a), "device": str(dev), "triton_scores": ev.triton_scores}
    # per-step cost without eviction: every bound within budget
    restore(B)
    ev._exact_max[:] = 0
    ev._left_at_exact[:] = ev._left_ring()
    result["maybe_evict_no_candidate_us"] = min(timed(ev.maybe_evict, dev, 50)) * 1e3
    assert ev.checks == 0
    pool.begin_decode(list(range(B)), cached[:B].tolist())
    q = torch.randn(B, a.q_heads, a.head_dim, device=dev, dtype=torch.bfloat16)
    result["observe_decode_us"] = min(timed(lambda: ev.observe_decode(0, q), dev, 50)) * 1e3
    for active in sorted({1, B}):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        ms = timed(ev.maybe_evict, dev, a.reps, setup=lambda: restore(active))
        streams = active * a.layers * a.kv_heads
        assert int(pool.global_len[:active].max()) <= a.budget
        result[f"evict_{active}_requests"] = {
            "streams": streams,
            "ms": ms,
            "ms_per_stream": min(ms) / streams,
            "peak_extra_mib": (torch.cuda.max_memory_allocated() - base) / 2**20
            if dev.type == "cuda"
            else None,
        }
    result["triton_scores_used"] = ev.triton_scores  # False if the kernel failed to build (logged)
    print(result)
    write_json(a.out, result, "evictor_step")


if __name__ == "__main__":
    main()
