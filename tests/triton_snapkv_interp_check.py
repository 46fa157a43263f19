"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_evictor_scores.py``: the Triton SnapKV scores (``memory/triton_snapkv.py``) against the torch
reference ``snapkv_scores`` on CPU: GQA groups of 1-4 heads (3: padded to 4), empty query and ring
slots, streams of 0 to 150 global entries, ring keys visible per query position, bf16 and float32,
and an FP8 pool's stored keys (e4m3, e5m2) with a scale per stream, dequantized in registers.

``python tests/triton_snapkv_interp_check.py SEED [SEED ...]`` prints a line per seed and exits non-zero if
any differs.
"""

import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sglang_wgkv.memory.kv_quant import dequantize, quantize  # noqa: E402
from sglang_wgkv.memory.snapkv_score import snapkv_scores  # noqa: E402
from sglang_wgkv.memory.triton_snapkv import snapkv_scores_triton  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402


def check(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    S = 1 + seed % 3
    G = [1, 2, 3, 4][seed % 4]
    D = 16 if seed % 2 else 32
    Wq = [5, 16, 21][seed % 3]
    Nr = [16, 24][seed % 2]
    dtype = torch.bfloat16 if seed % 3 == 1 else torch.float32
    g_len = torch.randint(0, 150, (S,), generator=gen)
    g_len[0] = max(int(g_len[0]), 1)
    Ng = int(g_len.max()) + seed % 5  # padding past the longest stream
    q = (torch.randn(S, Wq, G, D, generator=gen) * 2).to(dtype)
    g_keys = torch.randn(S, Ng, D, generator=gen).to(dtype)
    r_keys = torch.randn(S, Nr, D, generator=gen).to(dtype)
    # ring positions 1000.. (some slots empty); queries among them (some slots empty)
    r_pos = torch.arange(1000, 1000 + Nr).repeat(S, 1)
    r_pos[:, torch.randperm(Nr, generator=gen)[: Nr // 4]] = -1
    q_pos = torch.randint(999, 1000 + Nr, (S, Wq), generator=gen)
    q_pos[:, torch.randperm(Wq, generator=gen)[: Wq // 3]] = -1
    if seed % 7 == 6:
        q_pos[-1] = -1  # a stream whose window is empty: every score 0 before pooling
    scale = 1 / math.sqrt(D)
    kernel = [5, 13, 1][seed % 3]
    k_scale = None
    if seed % 4 == 3:  # an FP8 pool: stored keys, each stream's layer scale
        fp8 = torch.float8_e4m3fn if seed % 8 == 3 else torch.float8_e5m2
        k_scale = torch.rand(S, generator=gen) * 0.5 + 0.05
        g_keys = quantize(g_keys.float(), k_scale[:, None, None], fp8)
        r_keys = quantize(r_keys.float(), k_scale[:, None, None], fp8)
        want = snapkv_scores(
            q,
            q_pos,
            dequantize(g_keys, k_scale[:, None, None], dtype),
            g_len,
            dequantize(r_keys, k_scale[:, None, None], dtype),
            r_pos,
            scale,
            kernel,
        )
    else:
        want = snapkv_scores(q, q_pos, g_keys, g_len, r_keys, r_pos, scale, kernel)
    # query blocks of the default size (64 rows: 1-4 blocks here) or of 4 queries (2-6 blocks)
    got = snapkv_scores_triton(
        q,
        q_pos,
        g_keys,
        g_len,
        r_keys,
        r_pos,
        scale,
        kernel,
        block_n=16,
        block_q=4 if seed % 4 >= 2 else None,
        k_scale=k_scale,
    )
    if got.shape != want.shape:
        raise SystemExit(f"seed {seed}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        raise SystemExit(f"seed {seed}: padding differs (g_len {g_len.tolist()})")
    if not torch.allclose(got[fin], want[fin], rtol=2e-5, atol=1e-6):
        err = (got[fin] - want[fin]).abs().max().item()
        raise SystemExit(f"seed {seed}: scores differ by {err} (S {S}, G {G}, D {D}, Wq {Wq}, {dtype})")


if __name__ == "__main__":
    sys.exit(check_seeds(lambda s: check(int(s)), sys.argv[1:]))
