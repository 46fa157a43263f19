"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_triton_compact_interp.py``: the Triton compaction of admitted keys against the torch
``compact_admitted`` on CPU.

``python tests/triton_compact_interp_check.py SEED [SEED ...]`` prints a line per seed and exits non-zero if
any differs.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sglang_wgkv.attention.triton_prefill import compact_admitted_triton  # noqa: E402
from sglang_wgkv.attention.vertical_slash_plan import compact_admitted, compacted_rows, region_starts  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402


def check(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    B = 1 + seed % 4
    lens = torch.randint(0, 150, (B,), generator=gen).tolist()
    H, D = (1 + seed % 3, 16 if seed % 2 else 32)
    Nk = sum(lens)
    kv_indptr = torch.tensor([0] + lens).cumsum(0)
    p = [0.0, 0.3, 1.0][seed % 3]
    admitted = torch.rand(Nk, H, generator=gen) < p
    if seed % 4 == 3:  # strided rows and heads: k/v as views of a fused [Nk, 3, H, D] buffer
        fused = torch.randn(Nk, 3, H, D, generator=gen).to(torch.bfloat16)
        k, v = fused[:, 1], fused[:, 2]
        admitted = torch.rand(H, Nk, generator=gen).t() < p  # a transposed (non-contiguous) mask
    else:
        k = torch.randn(Nk, H, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(Nk, H, D, generator=gen).to(torch.bfloat16)
    align = [64, 16, 128, 176][seed % 4]  # 176: not a power of two (FA3 pages of its key tile)
    ref = compact_admitted(k, v, admitted, kv_indptr, align=align)
    rows = compacted_rows(Nk, B, align)
    # uninitialised buffers: every row a kernel reads (admitted, then zeros to the next multiple of
    # align) must be written
    out = tuple(torch.full((H, rows, D), float("nan")).to(torch.bfloat16) for _ in range(2))
    compact_admitted_triton(k, v, admitted, kv_indptr, out=out, block=16, align=align)
    starts = region_starts(kv_indptr, align).tolist()
    for b, (lo, hi) in enumerate(zip(kv_indptr[:-1].tolist(), kv_indptr[1:].tolist())):
        for h in range(H):
            n = int(admitted[lo:hi, h].sum())
            read = slice(starts[b], starts[b] + -(-n // align) * align)
            for name, a, want in (("k", out[0], ref[0]), ("v", out[1], ref[1])):
                if not torch.equal(a[h, read], want[h, read]):
                    raise SystemExit(
                        f"seed {seed}: sequence {b} head {h}: {name} rows differ (lens {lens}, p {p})"
                    )
            if not torch.equal(out[0][h, starts[b] : starts[b] + n], k[lo:hi, h][admitted[lo:hi, h]]):
                raise SystemExit(f"seed {seed}: sequence {b} head {h} not compacted in order")


if __name__ == "__main__":
    sys.exit(check_seeds(lambda s: check(int(s)), sys.argv[1:]))
