"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_triton_compact_interp.py``: the one-launch Triton plan (``build_vertical_slash_plan_triton``)
against the torch ``build_vertical_slash_plan`` on CPU.

``python tests/triton_plan_interp_check.py SEED [SEED ...]`` prints a line per seed and exits non-zero if any
differs.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sglang_wgkv.attention.triton_prefill import build_vertical_slash_plan_triton  # noqa: E402
from sglang_wgkv.attention.vertical_slash_plan import build_vertical_slash_plan  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402

FAR = -(2**30)  # the pool's position of gathered global entries (gather_context)


def case(seed: int):
    """A packed batch as the served extend builds it: per sequence, optional cached context (global
    entries at one far position, then ring positions), then the new tokens; some sequences with no
    new token, positions as int32 or int64, indptrs as int32 or int64."""
    gen = torch.Generator().manual_seed(seed)
    B = 1 + seed % 5
    H = 1 + seed % 4
    W = [4, 16, 64][seed % 3]
    q_pos, k_pos, qo, kv = [], [], [0], [0]
    for _ in range(B):
        prefix = int(torch.randint(0, 120, (1,), generator=gen)) if seed % 2 else 0
        n = int(torch.randint(0, 300, (1,), generator=gen))
        far = int(torch.randint(0, 40, (1,), generator=gen)) if prefix else 0
        ring = list(range(max(0, prefix - W), prefix))
        k_pos += [FAR] * far + ring + list(range(prefix, prefix + n))
        q_pos += list(range(prefix, prefix + n))
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + far + len(ring) + n)
    dt = torch.int32 if seed % 3 else torch.int64
    it = torch.int64 if seed % 4 == 1 else torch.int32
    Nk = kv[-1]
    admitted = torch.rand(Nk, H, generator=gen) < [0.0, 0.3, 1.0][seed % 3]
    return (
        admitted,
        torch.tensor(qo, dtype=it),
        torch.tensor(kv, dtype=it),
        torch.tensor(q_pos, dtype=dt),
        torch.tensor(k_pos, dtype=dt),
        W,
        [16, 64, 128][seed % 3],
    )


def check(seed: int) -> None:
    args = case(seed)
    align = [64, 128, 16][seed % 3]
    ref = build_vertical_slash_plan(*args, compact_align=align)
    out = build_vertical_slash_plan_triton(*args, compact_align=align)
    if out.compact_align != align:
        raise SystemExit(f"seed {seed}: compact_align {out.compact_align} != {align}")
    valid = ref.q_start < ref.q_end
    if not torch.equal(out.q_start, ref.q_start) or not torch.equal(out.q_end, ref.q_end):
        raise SystemExit(f"seed {seed}: query rows differ")
    if not torch.equal(out.vertical_len, ref.vertical_len):
        raise SystemExit(f"seed {seed}: vertical counts differ")
    for name in ("kv_start", "band_start", "band_end", "compact_start"):
        a, b = getattr(out, name), getattr(ref, name)
        if not torch.equal(a[valid], b[valid]):
            raise SystemExit(f"seed {seed}: {name} differs on blocks with rows")


if __name__ == "__main__":
    sys.exit(check_seeds(lambda s: check(int(s)), sys.argv[1:]))
