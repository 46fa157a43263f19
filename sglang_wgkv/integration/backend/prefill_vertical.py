"""Who runs the served prefill's vertical range (``--wgkv-prefill-vertical``): FA3 or the one-pass
Triton kernel (:mod:`sglang_wgkv.attention.fa3_vertical`).

| setting | FA3 loads and passes the start-up check | it does not |
| --- | --- | --- |
| ``auto`` (default) | FA3 for forwards whose longest key range reaches :data:`FA3_MIN_KEYS` | Triton, a warning logged |
| ``fa3`` | FA3 for every extend | the server refuses to start |
| ``triton`` | Triton | Triton |

Where FA3 runs the vertical range, a prefill whose keys are all admitted (every request of it keeps
every token, none bounded or restored from a cached prefix) runs whole in one dense FA3 call
(:mod:`sglang_wgkv.attention.fa3_dense`, :func:`choose_dense`), checked at start-up like the vertical
call.
"""

from __future__ import annotations

import logging

import torch

from sglang_wgkv.attention.fa3_vertical import FA3Fn, load_fa3

logger = logging.getLogger(__name__)

# The forward's longest key range (one request's context and chunk) from which ``auto`` hands the
# vertical range to FA3: the shortest measured length where the FA3 path beat the Triton kernel
# (kernels/kernel_attention_fa3_vertical.json); on M1D's 2K-4K forwards it cost 17% of the output rate
# (serving/M1D_prefill_vertical_ab.json).
FA3_MIN_KEYS = 32768
CHECK_TOLERANCE = 0.05  # max |FA3 path - one-pass kernel| of the start-up case, bf16 outputs near 1
# the server log's start-up line, one per process (served_speed.py records the choice from it)
LOG_FA3 = "wgkv: FA3 runs the prefill's vertical range"
LOG_TRITON = "wgkv: the prefill's vertical range runs in the Triton kernel"
LOG_DENSE = "wgkv: FA3 runs whole the prefills whose keys are all admitted"
LOG_DENSE_OFF = "wgkv: prefills whose keys are all admitted run the vertical-slash path"


def served_case(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], p_admit: float = 0.25
) -> tuple:
    """A batch like a served chunk for the model's ``shape`` (query heads, KV heads, head_dim): a cached
    context with global entries at the far position and a short new prompt beside it, several pages a
    block, int64 indptrs and int32 positions as the served prefill passes them (Triton compiles per
    dtype); a fraction ``p_admit`` of the keys admitted."""
    from sglang_wgkv.testing.prefill_cases import packed_case

    # the server's RNG left as it was
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        return packed_case(
            [700, 33],
            [1500, 33],
            *shape,
            p_admit,
            dtype,
            far_prefix=600,
            device=device,
            index_dtype=torch.int64,
            pos_dtype=torch.int32,
        )


def warm_up(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """The one-pass prefill's launches (plan, compaction, kernel) compiled at start-up for the served
    dtypes, so that no request waits for them; a failure is logged, not raised (the first prefill then
    compiles, or reports what fails)."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    try:
        vertical_slash_attention(*served_case(device, dtype, shape), 256)
    except Exception as exc:  # a warm-up must not take the server down
        logger.warning("wgkv: the prefill warm-up failed (%s: %s)", type(exc).__name__, str(exc)[:300])


def startup_check(fa3: FA3Fn, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> float:
    """Max |difference| between the prefill with FA3 on the vertical range and the one-pass Triton
    kernel on :func:`served_case`: it compiles the launches the FA3 path will make."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    args = served_case(device, dtype, shape)
    with_fa3 = vertical_slash_attention(*args, 256, fa3=fa3)
    one_pass = vertical_slash_attention(*args, 256)
    return float((with_fa3.float() - one_pass.float()).abs().max())


def choose_fa3(
    mode: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], load=load_fa3
) -> FA3Fn | None:
    """The FA3 call the served prefill uses, or None for the one-pass Triton kernel, per the table
    above. RuntimeError for ``fa3`` when FA3 cannot serve."""
    if mode == "triton":
        logger.info("%s (--wgkv-prefill-vertical triton)", LOG_TRITON)
        return None
    fa3 = load(device)
    problem = None
    if fa3 is None:
        problem = "sgl_kernel's FA3 does not load here (it needs a Hopper GPU and sgl_kernel.flash_attn)"
    else:
        try:
            worst = startup_check(fa3, device, dtype, shape)
        except Exception as exc:  # a failed launch must not take the server down under ``auto``
            problem = f"the start-up check failed: {type(exc).__name__}: {str(exc)[:500]}"
        else:
            if not worst <= CHECK_TOLERANCE:  # NaN fails too
                problem = (
                    f"the start-up check differs from the Triton kernel by {worst:.3g} (> {CHECK_TOLERANCE})"
                )
    if problem is None:
        logger.info("%s (start-up check: max |diff| = %.2g)", LOG_FA3, worst)
        return fa3
    if mode == "fa3":
        raise RuntimeError(f"--wgkv-prefill-vertical fa3: {problem}")
    logger.warning("%s: %s", LOG_TRITON, problem)
    return None


def dense_check(fa3_dense, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> float:
    """Max |difference| between the dense FA3 call (:mod:`sglang_wgkv.attention.fa3_dense`) and the
    one-pass Triton kernel on :func:`served_case` with every key admitted (a request that keeps every
    token): it compiles the dense call's variant."""
    from sglang_wgkv.attention.fa3_dense import dense_attention
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    q, k, v, admitted, qo, kv, q_pos, k_pos = served_case(device, dtype, shape, p_admit=1.0)
    scale = shape[2] ** -0.5
    one_pass = vertical_slash_attention(q, k, v, admitted, qo, kv, q_pos, k_pos, 256, sm_scale=scale)
    lens_q, lens_k = (qo[1:] - qo[:-1]).tolist(), (kv[1:] - kv[:-1]).tolist()
    dense = dense_attention(
        fa3_dense, q, k, v, qo.to(torch.int32), kv.to(torch.int32), max(lens_q), max(lens_k), scale
    )
    return float((dense.float() - one_pass.float()).abs().max())


def choose_dense(
    fa3_vertical, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], load=None
):
    """The dense FA3 call for prefills whose keys are all admitted, or None: only where FA3 runs the
    vertical range (``fa3_vertical`` chosen, so never under ``--wgkv-prefill-vertical triton``) and the
    call passes :func:`dense_check`; a failure is logged, never raised."""
    if fa3_vertical is None:
        return None
    from sglang_wgkv.attention.fa3_dense import load_fa3_dense

    dense = (load or load_fa3_dense)(device)
    if dense is None:
        logger.warning("%s: sgl_kernel's flash_attn_varlen_func does not load", LOG_DENSE_OFF)
        return None
    try:
        worst = dense_check(dense, device, dtype, shape)
    except Exception as exc:  # a failed launch must not take the server down
        logger.warning(
            "%s: the start-up check failed: %s: %s", LOG_DENSE_OFF, type(exc).__name__, str(exc)[:500]
        )
        return None
    if not worst <= CHECK_TOLERANCE:
        logger.warning("%s: the start-up check differs by %.3g (> %s)", LOG_DENSE_OFF, worst, CHECK_TOLERANCE)
        return None
    logger.info("%s (start-up check: max |diff| = %.2g)", LOG_DENSE, worst)
    return dense


def vertical_from_log(log: str) -> str | None:
    """``fa3``, ``triton`` or ``mixed`` (processes that chose differently) from a server log's start-up
    lines; None where no process logged a choice (the reference attention, or not WG-KV)."""
    found = {name for name, line in (("fa3", LOG_FA3), ("triton", LOG_TRITON)) if line in log}
    return found.pop() if len(found) == 1 else ("mixed" if found else None)
