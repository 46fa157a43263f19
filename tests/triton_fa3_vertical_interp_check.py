"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_triton_fa3_vertical_interp.py``: the vertical-slash prefill with its vertical range in FA3's
place (``vertical_slash_attention(..., fa3=...)``, the torch statement of the FA3 call standing in for
the GPU kernel) against the torch reference attention, and its launches against their torch
statements: the paged compaction (pad rows zeroed in uninitialised buffers) and the FA3 entries.

The one-pass kernel (``fa3=None``) runs beside it on the same uninitialised buffers.

``python tests/triton_fa3_vertical_interp_check.py SEED [SEED ...]`` prints a line per seed and exits
non-zero if any differs. Seeds 0-5 run ``PREFILL_CASES``; later seeds draw batches; ``choice`` runs the
server's start-up choice (``choose_fa3``) with a correct and a wrong stand-in.
"""

import os
import sys
from unittest import mock

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sglang_wgkv.attention import reference  # noqa: E402
from sglang_wgkv.attention.fa3_vertical import (  # noqa: E402
    PAGE,
    fa3_paged_reference,
    vertical_entries,
    vertical_entries_torch,
)
from sglang_wgkv.attention.triton_prefill import PrefillConfig, vertical_slash_attention  # noqa: E402
from sglang_wgkv.attention.triton_prefill_plan import (  # noqa: E402
    build_vertical_slash_plan_triton,
    compact_admitted_triton,
)
from sglang_wgkv.attention.vertical_slash_plan import _exclusive_count, compacted_rows  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402
from sglang_wgkv.testing.prefill_cases import PREFILL_CASES, packed_case  # noqa: E402

_empty, _new_empty = torch.empty, torch.Tensor.new_empty


def _poisoned(t):
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


def nan_empty(*args, **kwargs):
    """``torch.empty`` whose floating buffers hold NaN: what no kernel may read unwritten."""
    return _poisoned(_empty(*args, **kwargs))


def nan_new_empty(self, *args, **kwargs):
    return _poisoned(_new_empty(self, *args, **kwargs))


def case(seed: int):
    if seed < len(PREFILL_CASES):
        lens_q, lens_k, W, p, far = PREFILL_CASES[seed]
        Hq, Hkv = (8, 2) if seed % 2 else (4, 4)
    else:
        g = torch.Generator().manual_seed(seed)
        B = 1 + seed % 4
        lens_k = torch.randint(1, 260, (B,), generator=g).tolist()
        lens_q = [int(torch.randint(0, lk + 1, (1,), generator=g)) for lk in lens_k]
        W = [8, 16, 64][seed % 3]
        p = [0.0, 0.3, 1.0, 0.6][seed % 4]
        far = [0, 21, 70][seed % 3]
        Hq, Hkv = [(6, 2), (3, 3), (8, 1)][seed % 3]
    return lens_q, lens_k, W, p, far, Hq, Hkv


def check(seed: int) -> str:
    torch.manual_seed(seed)
    lens_q, lens_k, W, p, far, Hq, Hkv = case(seed)
    q, k, v, adm, qo, kv, qp, kp = packed_case(lens_q, lens_k, Hq, Hkv, 64, p, torch.float16, far)
    Nq, Nk = q.shape[0], k.shape[0]
    cfg = PrefillConfig(32, 16, 4, 1)  # small blocks: many per sequence at these lengths

    # the paged compaction: each sequence's admitted rows from a page bound, the pad to the next
    # page bound zeroed in buffers that start as NaN
    rows = compacted_rows(Nk, len(lens_k), PAGE)
    kc, vc = (nan_empty(Hkv, rows, 64, dtype=torch.float16) for _ in range(2))
    compact_admitted_triton(k, v, adm, kv, out=(kc, vc), align=PAGE)
    region = 0
    for b in range(len(lens_k)):
        lo, hi = int(kv[b]), int(kv[b + 1])
        for h in range(Hkv):
            want = k[lo:hi, h][adm[lo:hi, h]]
            n = want.shape[0]
            if not torch.equal(kc[h, region : region + n], want):
                raise SystemExit(f"sequence {b} head {h}: compacted rows differ")
            if not torch.equal(vc[h, region : region + n], v[lo:hi, h][adm[lo:hi, h]]):
                raise SystemExit(f"sequence {b} head {h}: compacted values differ")
            pad = slice(region + n, region + -(-n // PAGE) * PAGE)
            if not (kc[h, pad] == 0).all() or not (vc[h, pad] == 0).all():
                raise SystemExit(f"sequence {b} head {h}: pad rows not zeroed")
        region += -(-(hi - lo) // PAGE) * PAGE

    # the FA3 entries against their torch statement
    plan = build_vertical_slash_plan_triton(adm, qo, kv, qp, kp, W, cfg.block_m, _exclusive_count(adm))
    pages = rows // PAGE
    got = vertical_entries(plan, Nq, rows, pages)
    want = vertical_entries_torch(plan, Nq, rows, pages)
    for name, a, b in zip(("cu_seqlens_q", "cache_seqlens"), got[:2], want[:2]):
        if not torch.equal(a, b):
            raise SystemExit(f"{name} differs: {a.tolist()} vs {b.tolist()}")
    for e, n in enumerate(got[1].tolist()):
        used = -(-n // PAGE)
        if not torch.equal(got[2][e, :used], want[2][e, :used]):
            raise SystemExit(f"entry {e}: page table differs")

    # the attention: FA3's vertical part merged into the band launch
    ref = reference.vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, W, sm_scale=0.11)
    with mock.patch("torch.empty", nan_empty), mock.patch.object(torch.Tensor, "new_empty", nan_new_empty):
        out = vertical_slash_attention(
            q, k, v, adm, qo, kv, qp, kp, W, 0.11, config=cfg, fa3=fa3_paged_reference
        )
        one_pass = vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, W, 0.11, config=cfg)
    errs = []
    for name, got_out in (("with FA3", out), ("one-pass", one_pass)):
        err = (got_out.float() - ref.float()).abs().max().item() if Nq else 0.0
        if not torch.isfinite(got_out).all() or err > 4e-3:
            raise SystemExit(
                f"{name}: output differs by {err:.2e} (lens_q {lens_q}, lens_k {lens_k}, W {W}, p {p})"
            )
        errs.append(err)
    return f"max |diff| {errs[0]:.1e} with FA3, {errs[1]:.1e} one-pass, {int((got[1] > 0).sum())} FA3 entries with keys"


def check_choice() -> str:
    """The server's start-up choice with a correct and a wrong FA3 stand-in (SmolLM2's heads)."""
    from sglang_wgkv.integration.backend.prefill_vertical import choose_fa3, warm_up

    cpu, shape = torch.device("cpu"), (9, 3, 64)
    warm_up(cpu, torch.float16, shape)  # the backend's start-up launch of the one-pass prefill
    if (
        choose_fa3("fa3", cpu, torch.float16, shape, load=lambda d: fa3_paged_reference)
        is not fa3_paged_reference
    ):
        raise SystemExit("a correct FA3 was not chosen")

    def off_by_ten_percent(**kwargs):
        out, lse = fa3_paged_reference(**kwargs)
        return out * 1.1, lse

    if choose_fa3("auto", cpu, torch.float16, shape, load=lambda d: off_by_ten_percent) is not None:
        raise SystemExit("a wrong FA3 passed the start-up check")
    return "a correct stand-in chosen, a wrong one refused"


if __name__ == "__main__":
    sys.exit(check_seeds(lambda s: check_choice() if s == "choice" else check(int(s)), sys.argv[1:]))
