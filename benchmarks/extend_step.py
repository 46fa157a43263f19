"""The pool's share of a prefill chunk (issue 15, W2): ``extend_inputs`` (each request's cached context
and new rows, the attention's keys) and ``write_extend`` (admitted tokens leaving the ring into their
global pages, the chunk's last tokens into the ring), torch ops against the Triton launches of a
``triton_extend`` pool, at the served W2 shape by default: Llama-3.1-8B attention (32 layers, 8 KV heads,
D 128, bf16), W_local 256, 25% random admission, chunks of 8,192 tokens of one 32,768-token request.

python -m benchmarks.extend_step [--layers 32 --kv-heads 8 --head-dim 128 --window 256 --chunk 8192
                                  --prompt 32768 --admit 0.25 --reps 3] [--out PATH]

For each chunk position (a request's first chunk, then after 8K, 16K, 24K cached tokens) and path,
the wall time of one chunk's pool work, every layer (begin_extend, then per layer extend_inputs and
its write, staged in groups of layers as the backend stages them: ``ExtendWrites``), synchronised
before and after: the host's launches count, as they do in service. A
first, untimed repetition checks: every layer's attention inputs equal on both paths, chunk by chunk
(positions and admitted flags; keys and values where a head has them, not a shorter head's padding); after each repetition the two pools' states must be equal
(page tables, lengths, flags, key and value pages). CUDA if available, else CPU (a smoke run:
the Triton path then needs TRITON_INTERPRET=1). Writes benchmarks/results/kernels/extend_step.json.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_json
from sglang_wgkv.config import FAR_POSITION, WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.extend_writes import ExtendWrites


def chunk_rows(a, dev, gen, start, n):
    H, D = a.kv_heads, a.head_dim
    k = torch.randn(a.layers, n, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(a.layers, n, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    admit = torch.rand(a.layers, n, H, device=dev, generator=gen) < a.admit
    return k, v, admit, torch.arange(start, start + n, device=dev)


def run_chunk(pool, r, start, rows, sync):
    k, v, admit, pos = rows
    sync()
    t0 = time.perf_counter()
    pool.begin_extend([r], [start], [k.shape[1]])
    writes = ExtendWrites(pool)
    for layer in range(pool.num_layers):
        pool.extend_inputs(layer, k[layer], v[layer], admit[layer], pos, torch.bfloat16)
        writes.stage(layer, k[layer], v[layer], admit[layer])
    sync()
    return (time.perf_counter() - t0) * 1e3


def check_chunk(pools, r, start, chunks):
    """One chunk on every pool, layer by layer: each layer's attention inputs must be equal across them
    (SystemExit naming the first that differs)."""
    for pool, (k, v, admit, pos) in zip(pools.values(), chunks.values()):
        pool.begin_extend([r], [start], [k.shape[1]])
    writes = {name: ExtendWrites(pool) for name, pool in pools.items()}
    for layer in range(next(iter(pools.values())).num_layers):
        got = {
            name: pool.extend_inputs(layer, k[layer], v[layer], admit[layer], pos, torch.bfloat16)
            for (name, pool), (k, v, admit, pos) in zip(pools.items(), chunks.values())
        }
        first, *others = got.values()
        # a global row a head did not fill (the heads' lengths differ) is padding no attention reads
        read = first[3] | (first[2] != FAR_POSITION)[:, None]
        for name, inputs in zip(list(got)[1:], others):
            for what, x, y in zip(("keys", "values", "k_pos", "admitted"), first, inputs):
                if what in ("keys", "values"):
                    x, y = x[read], y[read]
                if not torch.equal(x, y):
                    raise SystemExit(f"chunk at {start}, layer {layer}: {name}'s {what} differ from torch's")
        for staged, (k, v, admit, _) in zip(writes.values(), chunks.values()):
            staged.stage(layer, k[layer], v[layer], admit[layer])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--admit", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "kernels" / "extend_step.json")
    )
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    L, H, D = a.layers, a.kv_heads, a.head_dim
    starts = list(range(0, a.prompt, a.chunk))
    pages = L * H * (-(-a.prompt // 16) + 4)  # every token kept would fit: admission never runs short
    pools = {
        name: DualCachePool(
            L,
            H,
            D,
            num_pages=pages,
            max_requests=2,
            max_context_len=a.prompt + 64,
            config=WGKVConfig(local_window=a.window),
            dtype=torch.bfloat16,
            device=dev,
            triton_decode=t,
            triton_extend=t,
        )
        for name, t in (("torch", False), ("triton", True))
    }
    ms = {name: {s: [] for s in starts} for name in pools}
    for rep in range(a.reps + 1):  # the first repetition checks (untimed): Triton compiles there
        gen = {name: torch.Generator(device=dev).manual_seed(rep) for name in pools}
        for pool in pools.values():
            pool.alloc_request(1)
        for s in starts:
            n = min(a.chunk, a.prompt - s)
            chunk = {name: chunk_rows(a, dev, gen[name], s, n) for name in pools}
            if rep == 0:
                check_chunk(pools, 1, s, chunk)
                continue
            for name, pool in pools.items():
                ms[name][s].append(run_chunk(pool, 1, s, chunk[name], sync))
        same = all(
            torch.equal(getattr(pools["torch"], x), getattr(pools["triton"], x))
            for x in ("page_table", "global_len", "ring_flag")
        )
        same = same and all(
            torch.equal(getattr(pools["torch"], x)[:-1], getattr(pools["triton"], x)[:-1])
            for x in ("k_pages", "v_pages")
        )
        for pool in pools.values():
            pool.free_request(1)
        if not same:
            raise SystemExit(f"repetition {rep}: the torch and Triton pools differ")
    rows = []
    for s in starts:
        med = {name: sorted(ms[name][s])[len(ms[name][s]) // 2] for name in pools}
        rows.append(
            {
                "prefix": s,
                "chunk": min(a.chunk, a.prompt - s),
                "torch_ms": med["torch"],
                "triton_ms": med["triton"],
                "speedup": med["torch"] / med["triton"],
            }
        )
        print(rows[-1], flush=True)
    write_json(
        a.out,
        {
            "env": environment(),
            "command": "python " + " ".join(sys.argv),
            "shape": {
                "layers": L,
                "kv_heads": H,
                "head_dim": D,
                "window": a.window,
                "chunk": a.chunk,
                "prompt": a.prompt,
                "admit": a.admit,
                "reps": a.reps,
                "device": dev,
            },
            "rows": rows,
            "per_chunk_ms": "one chunk's pool work over every layer, wall clock",
        },
        "extend_step",
    )


if __name__ == "__main__":
    main()
