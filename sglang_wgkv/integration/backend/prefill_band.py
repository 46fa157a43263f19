"""FA3 or the band launch for the local window of prefills
(``--wgkv-prefill-band``, :mod:`sglang_wgkv.attention.fa3_band`), chosen once at start-up:

| mode | the call | where FA3 does not load or differs from the band launch |
| --- | --- | --- |
| ``triton`` (default) | none: the band launch reads the whole band under the mask | - |
| ``fa3`` | ``flash_attn_varlen_func``'s causal window, the band launch adding the rest | the server refuses to start |
"""

from __future__ import annotations

import logging

import torch

from sglang_wgkv.integration.backend.prefill_vertical import CHECK_TOLERANCE

logger = logging.getLogger(__name__)

LOG_BAND = "wgkv: FA3 runs the prefill's local window"


def band_check(fn, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> float:
    """Max |difference| between the prefill with FA3 on the local window and the band launch alone on
    two batches of the model's heads (W_local 256, 25% admitted, int64 indptrs and int32 positions, as
    served): a 700- and a 33-token prompt, q, k and v views of one fused row; and the same rows as
    chunks after 0 and 300 cached tokens, the keys in the pool's layout (37 global entries and a full
    ring before the second's rows), q a view of its fused row. It compiles the band launch's FA3
    variant."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
    from sglang_wgkv.testing.prefill_cases import pool_layout_case

    diffs = []
    for prefixes in ([0, 0], [0, 300]):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            q, k, v, adm, qo, kv, *pos = pool_layout_case(
                [700, 33],
                prefixes,
                37,
                256,
                *shape,
                0.25,
                dtype,
                device=device,
                index_dtype=torch.int64,
                pos_dtype=torch.int32,
            )
        new_rows = (q, k, v) if not any(prefixes) else (q, k[: q.shape[0]], v[: q.shape[0]])
        fused = torch.cat([t.flatten(1) for t in new_rows], 1)
        q_view = fused[:, : q[0].numel()].view(q.shape)
        if not any(prefixes):  # the keys are the new rows themselves
            k = fused[:, q[0].numel() : q[0].numel() + k[0].numel()].view(k.shape)
            v = fused[:, q[0].numel() + k[0].numel() :].view(v.shape)
        args = (q_view, k, v, adm, qo, kv, *pos, 256)
        band = (fn, qo.to(torch.int32), kv.to(torch.int32), 700, int((kv[1:] - kv[:-1]).max()))
        with_fa3 = vertical_slash_attention(*args, band=band)
        one_pass = vertical_slash_attention(*args)
        diffs.append((with_fa3.float() - one_pass.float()).abs().max())
    return float(torch.stack(diffs).max())  # NaN stays NaN


def choose_band(mode: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], load=None):
    """``flash_attn_varlen_func`` for the local window under ``fa3``, None under ``triton``;
    RuntimeError where ``fa3`` cannot serve (FA3 missing, the check failing or differing)."""
    if mode == "triton":
        return None
    from sglang_wgkv.attention.fa3_dense import load_fa3_dense

    fn = (load or load_fa3_dense)(device)
    if fn is None:
        raise RuntimeError(
            "--wgkv-prefill-band fa3: sgl_kernel's FA3 does not load here (it needs a Hopper GPU and sgl_kernel.flash_attn)"
        )
    worst = band_check(fn, device, dtype, shape)
    if not worst <= CHECK_TOLERANCE:  # NaN fails too
        raise RuntimeError(
            f"--wgkv-prefill-band fa3: the start-up check differs from the band launch by {worst:.3g} "
            f"(> {CHECK_TOLERANCE})"
        )
    logger.info("%s (start-up check: max |diff| = %.2g)", LOG_BAND, worst)
    return fn
