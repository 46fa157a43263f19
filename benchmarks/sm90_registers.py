"""Registers, spills and shared memory of the decode split kernel on the H200 (sm_90a), from a CPU
cross-compile (Triton's bundled ptxas; sglang_wgkv/testing/sm90_compile.py), per launch configuration at the served
W1 shape (Llama-3.1-8B layer, batch 1, bf16, fused merge and ring write, the served split count).

No GPU needed, no timing: what ptxas allocates, and how many 4-warp programs fit an SM by registers
and by shared memory; kernel_decode.py / decode_fixed_cost.py time the same configurations on the
device. The compile takes the launch's specialization (16-byte alignment and divisibility of pointers
and integers): without it the gathers compile to 2-byte scalar loads without cp.async and the
registers read far above the real launch's (tests/test_sm90_compile.py).

usage: python -m benchmarks.sm90_registers [--out DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton

from benchmarks.common import environment, write_json
from sglang_wgkv.testing.sm90_compile import compile_sm90, split_kernel_launch

SM90_SHARED_PER_SM = 233472  # bytes of shared memory an H200 SM holds for its resident blocks (228 KiB)

CONFIGS = [  # (block_n, num_warps, num_stages, fused ring write, fused merge, maxnreg: 0 = uncapped)
    (64, 4, 2, True, True, 0),
    (64, 4, 2, False, True, 0),
    (64, 4, 2, False, False, 0),
    (32, 4, 2, True, True, 0),
    (64, 8, 2, True, True, 0),
    (128, 8, 2, True, True, 0),
    (32, 8, 2, True, True, 0),
    # register caps (--wgkv-decode-launch maxnreg)
    (64, 4, 2, True, True, 168),
    (64, 4, 2, True, True, 128),
    (32, 4, 2, True, True, 168),
    (32, 4, 2, True, True, 128),
    (16, 4, 2, True, True, 0),
    (16, 4, 2, True, True, 128),
]


def ptxas_stats(ptx: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", err).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err).groups())
    return {"registers": regs, "spill_store_bytes": stores, "spill_load_bytes": loads}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernels")
    args = ap.parse_args()
    from sglang_wgkv.attention import decode_config as dc

    splits = dc.choose_num_splits(1, 8, 131072, "cpu")
    rows = []
    for block_n, warps, stages, write, fused, maxnreg in CONFIGS:
        cfg = dc.DecodeConfig(
            block_n=block_n, num_warps=warps, num_stages=stages, fused_merge=fused, maxnreg=maxnreg
        )
        kernel, bound, options = split_kernel_launch(cfg, splits=splits, fused_write=write)
        compiled = compile_sm90(kernel, bound, options)
        row = {
            "block_n": block_n,
            "num_warps": warps,
            "num_stages": stages,
            "fused_write": write,
            "fused_merge": fused,
            "maxnreg": maxnreg,
            "shared_bytes": compiled.metadata.shared,
            **ptxas_stats(compiled.asm["ptx"]),
        }
        row["blocks_per_sm_by_registers"] = 65536 // (row["registers"] * 32 * warps)
        row["blocks_per_sm_by_shared"] = SM90_SHARED_PER_SM // max(row["shared_bytes"], 1)
        rows.append(row)
        print(row, flush=True)
    write_json(
        os.path.join(args.out, "sm90_registers.json"),
        {
            "env": environment(),
            "command": "python3 " + " ".join(sys.argv),
            "target": "sm_90a (ptxas -v)",
            "shape": {"batch": 1, "Hq": 32, "Hkv": 8, "head_dim": 128, "splits": splits, "dtype": "bfloat16"},
            "rows": rows,
            "served_default": {
                "block_n": dc.DecodeConfig.block_n,
                "num_warps": dc.DecodeConfig.num_warps,
                "num_stages": dc.DecodeConfig.num_stages,
            },
        },
        "sm90_registers",
    )


if __name__ == "__main__":
    main()
