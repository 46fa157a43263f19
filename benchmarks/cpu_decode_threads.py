"""The torch decode layer's CPU threads: one decode step of the embedded model's shape (30 layers, 3 KV
heads, 9 query heads, head_dim 64, W_local 256, ~27% admitted) over the ``wgkv`` backend's CPU path,
with torch's threads and with one, at several batch sizes and cached lengths, under the CPU launcher's
``OMP_WAIT_POLICY=PASSIVE``. Chooses ``decode_layer.CPU_ONE_THREAD_KV_TOKENS``.

    python -m benchmarks.cpu_decode_threads --out benchmarks/results/serving/cpu_decode_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

# (requests decoding, tokens each holds)
CASES = [(1, 1100), (2, 1100), (4, 1100), (8, 1100), (32, 1100), (1, 4000), (4, 4000)]
L, H, HQ, D, W = 30, 3, 9, 64, 256
STEPS = 8


def measure(batch: int, prompt: int) -> dict:
    """ms a decode step (the attention layers only) with torch's threads and with one, alternating."""
    import torch

    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.gate import GateConfig, WriteGates
    from sglang_wgkv.integration.backend import decode_layer
    from sglang_wgkv.memory import DualCachePool
    from sglang_wgkv.testing.backend_harness import bare_backend, layer_of, run_decode, run_extend

    pages = batch * L * H * (prompt // 16 + 4 * STEPS) + 1024
    pool = DualCachePool(
        L, H, D, num_pages=pages, max_requests=batch + 2, max_context_len=prompt + 64,
        config=WGKVConfig(local_window=W, tau=0.1), dtype=torch.float32,
    )  # fmt: skip
    gates = WriteGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=4 * D)).eval()
    gates.requires_grad_(False)
    for g in gates.layers:
        g.b2.fill_(-1.0)  # sigmoid(-1) = 0.27: about the shipped gates' admission
    backend = bare_backend(
        pool, gates, use_kernels=False, slot_tau=torch.full((batch + 2,), 0.1), num_q_heads=HQ
    )
    layers = [layer_of(i, HQ, H, D) for i in range(L)]
    gen = torch.Generator().manual_seed(0)

    def rows(n):
        return [torch.randn(n, c * D, generator=gen) for c in (HQ, H, H)]

    slots = list(range(1, batch + 1))
    for r in slots:
        pool.alloc_request(r)
    run_extend(backend, layers, slots, [0] * batch, [prompt] * batch, rows)
    cached = [prompt]

    def step():
        run_decode(backend, layers, slots, [cached[0] + 1] * batch, rows)
        cached[0] += 1

    out = {"batch": batch, "cached_tokens": prompt, "kv_tokens": H * batch * prompt}
    times: dict[str, list[float]] = {"torch_threads": [], "one_thread": []}
    for _ in range(2):  # alternate, so that a slow spell of the machine hits both
        for name, limit in (("torch_threads", -1), ("one_thread", 1 << 40)):
            decode_layer.CPU_ONE_THREAD_KV_TOKENS = limit
            step()
            t = time.perf_counter()
            for _ in range(STEPS // 2):
                step()
            times[name].append((time.perf_counter() - t) / (STEPS // 2) * 1e3)
    for name, ms in times.items():
        out[f"{name}_ms_step"] = round(sum(ms) / len(ms), 1)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args(argv)
    if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # read when OpenMP starts: set it first
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "CUDA_VISIBLE_DEVICES": ""}
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.cpu_decode_threads", *sys.argv[1:]], env)
    import torch

    results = {
        "kind": "cpu_decode_threads",
        "command": "python -m benchmarks.cpu_decode_threads" + (f" --out {args.out}" if args.out else ""),
        "env": {"OMP_WAIT_POLICY": "PASSIVE", "torch_threads": torch.get_num_threads()},
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "steps": STEPS,
        "rows": [],
    }
    for batch, prompt in CASES:
        row = measure(batch, prompt)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
