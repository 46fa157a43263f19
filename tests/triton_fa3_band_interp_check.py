"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_triton_fa3_band_interp.py``: the vertical-slash prefill with its local window in FA3's place
(``vertical_slash_attention(..., band=...)``, the torch statement of the FA3 call standing in for the
GPU kernel) against the torch reference attention, on batches in the pool's layout (chunks after a
cached prefix: global entries at a far position, the ring, the new rows), in buffers that start as NaN.

``python tests/triton_fa3_band_interp_check.py SEED [SEED ...]`` prints a line per seed and exits
non-zero if any differs. Seeds 0-3 run the prefix-free ``PREFILL_CASES``; later seeds draw batches
(GQA groups 1-8, W 8-64, empty sequences, all or none admitted; odd seeds after cached prefixes of
0-3 W with 0-40 global entries); ``choice`` runs the server's start-up choice (``choose_band``) with
a correct and a wrong stand-in; ``unsafe`` a layout ``window_safe`` refuses (global entries before a
short ring), where FA3's index window would take them in and the output must differ.
"""

import os
import sys
from unittest import mock

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from sglang_wgkv.attention import reference  # noqa: E402
from sglang_wgkv.attention.fa3_band import window_safe  # noqa: E402
from sglang_wgkv.attention.fa3_dense import dense_reference  # noqa: E402
from sglang_wgkv.attention.triton_prefill import PrefillConfig, vertical_slash_attention  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402
from sglang_wgkv.testing.prefill_cases import PREFILL_CASES, packed_case, pool_layout_case  # noqa: E402

NO_PREFIX = [c for c in PREFILL_CASES if c[0] == c[1] and not c[4]]
_empty = torch.empty
OUT_SEEDS = (1, 5)  # also run with `out` given


def nan_empty(*args, **kwargs):
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t


def case(seed: int):
    """(new rows, cached prefixes, global entries, W, p_admit, Hq, Hkv) of a seed."""
    if seed < len(NO_PREFIX):
        lens, _, W, p, _ = NO_PREFIX[seed]
        Hq, Hkv = (8, 2) if seed % 2 else (4, 4)
        return lens, [0] * len(lens), 0, W, p, Hq, Hkv
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 260, (1 + seed % 4,), generator=g).tolist()
    W = [8, 16, 64][seed % 3]
    prefixes = (
        torch.randint(0, 3 * W + 1, (len(lens),), generator=g).tolist() if seed % 2 else [0] * len(lens)
    )
    far = int(torch.randint(0, 41, (), generator=g)) if seed % 2 else 0
    p = [0.0, 0.3, 1.0, 0.6][seed % 4]
    Hq, Hkv = [(6, 2), (3, 3), (8, 1)][seed % 3]
    return lens, prefixes, far, W, p, Hq, Hkv


def check(seed: int) -> str:
    torch.manual_seed(seed)
    lens, prefixes, far, W, p, Hq, Hkv = case(seed)
    q, k, v, adm, qo, kv, qp, kp = pool_layout_case(lens, prefixes, far, W, Hq, Hkv, 64, p, torch.float16)
    cfg = PrefillConfig(32, 16, 4, 1)  # small blocks: many per sequence, bands cut at tile edges
    ref = reference.vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, W, sm_scale=0.11)
    keys = (kv[1:] - kv[:-1]).tolist()
    band = (
        dense_reference,
        qo.to(torch.int32),
        kv.to(torch.int32),
        max(lens, default=0),
        max(keys, default=0),
    )
    with mock.patch("torch.empty", nan_empty):
        out = vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, W, 0.11, config=cfg, band=band)
    err = (out.float() - ref.float()).abs().max().item() if q.shape[0] else 0.0
    if not torch.isfinite(out).all() or err > 4e-3:
        raise SystemExit(
            f"output differs by {err:.2e} (lens {lens}, prefixes {prefixes}, {far} global, W {W}, p {p}, "
            f"heads {Hq}/{Hkv})"
        )
    if seed in OUT_SEEDS:  # a mixed forward's output: its first rows of a larger buffer, written in place
        buf = torch.full((q.shape[0] + 3, Hq, 64), 7.0, dtype=q.dtype)
        got = vertical_slash_attention(
            q, k, v, adm, qo, kv, qp, kp, W, 0.11, config=cfg, band=band, out=buf[: q.shape[0]]
        )
        if got.data_ptr() != buf.data_ptr() or not torch.equal(buf[: q.shape[0]], out):
            raise SystemExit("the output written into `out` differs from the one allocated")
        if not (buf[q.shape[0] :] == 7.0).all():
            raise SystemExit("rows after `out` were written")
    return f"max |diff| {err:.1e} (lens {lens}, prefixes {prefixes}, {far} global, W {W}, p {p})"


def check_unsafe() -> str:
    """37 global entries before a prompt's own rows (no ring before them): ``window_safe`` says no,
    and the window call would differ from the reference, so the backend must not make it."""
    lens_q, lens_k, W, p, far = PREFILL_CASES[5]
    torch.manual_seed(0)
    q, k, v, adm, qo, kv, qp, kp = packed_case(lens_q, lens_k, 4, 2, 64, p, torch.float16, far)
    rings = [min(lk - lq, W) for lq, lk in zip(lens_q, lens_k)]
    if window_safe([far] * len(lens_q), rings, W):
        raise SystemExit("window_safe accepted global entries before a short ring")
    ref = reference.vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, W, sm_scale=0.11)
    band = (
        dense_reference,
        qo.to(torch.int32),
        kv.to(torch.int32),
        max(lens_q),
        int((kv[1:] - kv[:-1]).max()),
    )
    out = vertical_slash_attention(
        q, k, v, adm, qo, kv, qp, kp, W, 0.11, config=PrefillConfig(32, 16, 4, 1), band=band
    )
    err = (out.float() - ref.float()).abs().max().item()
    if err < 1e-2:
        raise SystemExit(f"the unsafe layout matched the reference ({err:.1e}): the case tests nothing")
    return f"window_safe refuses it; the window call would differ by {err:.1e}"


def check_choice() -> str:
    """The server's start-up choice (SmolLM2's heads): ``triton`` takes no call, ``fa3`` takes a correct
    stand-in and refuses to start with one whose outputs are 10% off."""
    from sglang_wgkv.integration.backend.prefill_band import choose_band

    cpu, shape = torch.device("cpu"), (9, 3, 64)
    if choose_band("triton", cpu, torch.float16, shape, load=lambda d: dense_reference) is not None:
        raise SystemExit("triton took a call")
    if choose_band("fa3", cpu, torch.float16, shape, load=lambda d: dense_reference) is not dense_reference:
        raise SystemExit("a correct FA3 was not chosen")

    def off_by_ten_percent(*args, **kwargs):
        out, lse = dense_reference(*args, **kwargs)
        return out * 1.1, lse

    try:
        choose_band("fa3", cpu, torch.float16, shape, load=lambda d: off_by_ten_percent)
    except RuntimeError as exc:
        if "differs" not in str(exc):
            raise SystemExit(f"refused for another reason: {exc}") from exc
    else:
        raise SystemExit("a wrong FA3 passed the start-up check")
    return "triton: none; a correct stand-in chosen, a wrong one refused"


if __name__ == "__main__":
    named = {"choice": check_choice, "unsafe": check_unsafe}
    sys.exit(check_seeds(lambda s: named[s]() if s in named else check(int(s)), sys.argv[1:]))
