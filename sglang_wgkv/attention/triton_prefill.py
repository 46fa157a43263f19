"""Triton vertical-slash prefill attention (same contract as
:func:`sglang_wgkv.attention.reference.vertical_slash_attention`).

One program = one query block (``BLOCK_M`` queries of one sequence) x one query head. It runs a
single online softmax over two key ranges (see :mod:`.vertical_slash_plan`):

1. the admitted keys of its KV head that lie at least ``W`` before the block, compacted and
   contiguous: an unmasked dense loop (the bulk of the work at long context);
2. the band ``(p_lo - W, p_hi]`` of original keys, with the exact vertical-slash mask.

Either range may come from FA3 instead (``sgl_kernel``, Hopper), its output and log-sum-exp the
softmax state this kernel starts from: the vertical range (:mod:`.fa3_vertical`), or the local
window (:mod:`.fa3_band`), which leaves this kernel only the band's admitted keys at least ``W``
behind their query, ``(p_lo - W, p_hi - W]``.

Blocks are launched longest-first (reverse order) so that the causal tail does not straggle. The work
lists (compaction, plan) are built by :mod:`.triton_prefill_plan`.
"""

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sglang_wgkv.attention.fa3_band import BandFA3, fa3_band
from sglang_wgkv.attention.fa3_vertical import PAGE, FA3Fn, fa3_vertical
from sglang_wgkv.attention.triton_prefill_plan import (
    build_vertical_slash_plan_triton,
    compact_admitted_triton,
)
from sglang_wgkv.attention.vertical_slash_plan import (
    COMPACT_ALIGN,
    VerticalSlashPlan,
    _exclusive_count,
    compacted_rows,
)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape: queries per block, keys per step, warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_config(head_dim: int) -> PrefillConfig:
    return PrefillConfig(128, 64, 8 if head_dim >= 128 else 4, 3)


def compact_align(config: PrefillConfig) -> int:
    """Rows the compacted regions align to under ``config``: a multiple of its key tile (the tail tile
    is read whole) and of FA3's page (:data:`~.fa3_vertical.PAGE`)."""
    return math.lcm(COMPACT_ALIGN, config.block_n, PAGE)


@triton.jit
def _update(q, k, v, m_i, l_i, acc, visible, qk_scale, MASKED: tl.constexpr):
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rows that have seen nothing yet keep m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _fa3_state(OV, LseV, rows, col, m_valid, offs_d, stride_vn, stride_vg, stride_lg):
    """FA3's normalised output (``OV[row, col]``) and log-sum-exp (``LseV[col, row]``) as the online
    softmax state: acc / l = out, l * 2**m = exp(lse), taken as l = 1, m = lse * log2(e)."""
    o = tl.load(
        OV + rows[:, None] * stride_vn + col * stride_vg + offs_d[None, :], mask=m_valid[:, None], other=0.0
    )
    lse = tl.load(LseV + col * stride_lg + rows, mask=m_valid, other=float("-inf"))
    return lse * 1.4426950408889634, tl.where(m_valid, 1.0, 0.0), o.to(tl.float32)


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=[
        "compact_rows",
        "num_blocks",
        "num_q",
        "stride_an",
        "stride_vn",
        "stride_vg",
        "stride_lg",
    ],
    do_not_specialize_on_alignment=[
        "Adm",
        "QPos",
        "KPos",
        "BQStart",
        "BQEnd",
        "BCompactStart",
        "BBandStart",
        "BBandEnd",
        "BVertical",
        "OV",
        "LseV",
    ],
)
def _vertical_slash_fwd(
    q_desc,
    k_desc,
    v_desc,
    kc_desc,
    vc_desc,
    O,
    Adm,
    QPos,
    KPos,
    BQStart,
    BQEnd,
    BCompactStart,
    BBandStart,
    BBandEnd,
    BVertical,
    OV,
    LseV,
    stride_on,
    stride_oh,
    stride_an,
    stride_vn,
    stride_vg,
    stride_lg,
    compact_rows,
    qk_scale,
    window,
    num_blocks,
    num_kv_heads,
    num_q,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VERTICAL_GIVEN: tl.constexpr,
    BAND_GIVEN: tl.constexpr,
):
    head = tl.program_id(0)
    blk = num_blocks - 1 - tl.program_id(1)
    q_start = tl.load(BQStart + blk)
    q_end = tl.load(BQEnd + blk)
    if q_start >= q_end:
        return
    kvh = head // GROUP
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < q_end
    # Rows past q_end belong to the next sequence (or lie past the end): read, never written.
    q = q_desc.load([q_start, head * HEAD_DIM])
    q_pos = tl.load(QPos + offs_m, mask=m_valid, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # 1. compacted admitted keys, fully visible: unmasked full tiles, then one masked tail tile
    #    (its rows past the admitted count are the zeros the compaction writes up to the region's tile).
    n_vert = tl.load(BVertical + blk * num_kv_heads + kvh)
    if BAND_GIVEN:
        # FA3 ran the local window (fa3_band), every query's keys 0 <= dist < W: its output
        # ``[Nq, Hq, D]`` and log-sum-exp ``[Hq, Nq]`` (each query sees itself)
        m_i, l_i, acc = _fa3_state(
            OV, LseV, offs_m.to(tl.int64), head, m_valid, offs_d, stride_vn, stride_vg, stride_lg
        )
    if VERTICAL_GIVEN:
        # FA3 ran them (fa3_vertical): its output folded to ``[Hkv * Nq, G, D]``
        if n_vert > 0:
            rows = (kvh * num_q + offs_m).to(tl.int64)
            m_i, l_i, acc = _fa3_state(
                OV, LseV, rows, head - kvh * GROUP, m_valid, offs_d, stride_vn, stride_vg, stride_lg
            )
    else:
        row0 = kvh * compact_rows + tl.load(BCompactStart + blk)
        n_full = (n_vert // BLOCK_N) * BLOCK_N
        for start in range(0, n_full, BLOCK_N):
            k = kc_desc.load([row0 + start, 0])
            v = vc_desc.load([row0 + start, 0])
            m_i, l_i, acc = _update(q, k, v, m_i, l_i, acc, None, qk_scale, False)
        if n_full < n_vert:
            k = kc_desc.load([row0 + n_full, 0])
            v = vc_desc.load([row0 + n_full, 0])
            visible = (n_full + offs_n < n_vert)[None, :]
            m_i, l_i, acc = _update(q, k, v, m_i, l_i, acc, visible, qk_scale, True)

    # 2. the band: original keys with the exact vertical-slash mask (rows past the tensor read 0).
    band_start = tl.load(BBandStart + blk)
    band_end = tl.load(BBandEnd + blk)
    if BAND_GIVEN:
        # only keys at least W behind some query remain: positions up to p_hi - W, the band's first
        # keys (the band lies in the ring and new rows, whose positions run on one by one)
        p_hi = tl.max(tl.where(m_valid, q_pos, -1))
        first = tl.load(KPos + band_start, mask=band_start < band_end, other=0)
        narrow = tl.minimum(tl.maximum(p_hi - window + 1 - first, 0), band_end - band_start)
        band_end = band_start + narrow.to(tl.int32)  # int64 positions; the descriptor's offsets are int32
    for start in range(band_start, band_end, BLOCK_N):
        n = start + offs_n
        n_valid = n < band_end
        k = k_desc.load([start, kvh * HEAD_DIM])
        v = v_desc.load([start, kvh * HEAD_DIM])
        k_pos = tl.load(KPos + n, mask=n_valid, other=0)
        adm = tl.load(Adm + n.to(tl.int64) * stride_an + kvh, mask=n_valid, other=0)
        dist = q_pos[:, None] - k_pos[None, :]
        if BAND_GIVEN:
            visible = n_valid[None, :] & (dist >= window) & (adm[None, :] != 0)
        else:
            visible = n_valid[None, :] & (dist >= 0) & ((dist < window) | (adm[None, :] != 0))
        m_i, l_i, acc = _update(q, k, v, m_i, l_i, acc, visible, qk_scale, True)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        O + offs_m[:, None].to(tl.int64) * stride_on + head * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=m_valid[:, None],
    )


def _check_inputs(q, k, v, admitted, qo_indptr, kv_indptr, q_pos, k_pos, local_window):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"q [Nq, Hq, D], k/v [Nk, Hkv, D] expected, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    Nq, Hq, D = q.shape
    Nk, Hkv, Dk = k.shape
    if Dk != D or D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 and equal for q and k, got {D}, {Dk}")
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {Hkv}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v must share dtype float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if admitted.shape != (Nk, Hkv) or admitted.dtype != torch.bool:
        raise ValueError(f"admitted must be bool [{Nk}, {Hkv}], got {admitted.dtype} {tuple(admitted.shape)}")
    if q_pos.shape != (Nq,) or k_pos.shape != (Nk,):
        raise ValueError(
            f"q_pos [{Nq}] and k_pos [{Nk}] expected, got {tuple(q_pos.shape)}, {tuple(k_pos.shape)}"
        )
    if qo_indptr.shape != kv_indptr.shape or qo_indptr.dim() != 1 or qo_indptr.numel() < 2:
        raise ValueError(
            f"qo_indptr and kv_indptr must both be [B + 1], got {tuple(qo_indptr.shape)}, "
            f"{tuple(kv_indptr.shape)}"
        )
    if local_window <= 0:
        raise ValueError(f"local_window must be positive, got {local_window}")
    tensors = (q, k, v, admitted, qo_indptr, kv_indptr, q_pos, k_pos)
    if any(t.device != q.device for t in tensors):
        raise ValueError("all inputs must be on one device")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("inputs must be on a CUDA device (or run under TRITON_INTERPRET=1)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != D or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(
                f"{name} must have contiguous heads (stride(1) == D, stride(2) == 1), "
                f"16-byte aligned rows and base; got strides {t.stride()}"
            )


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} contiguous in D, got {out.dtype} {tuple(out.shape)}"
        )
    return out


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    admitted: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    local_window: int,
    sm_scale: float | None = None,
    *,
    plan: VerticalSlashPlan | None = None,
    compacted: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: PrefillConfig | None = None,
    fa3: FA3Fn | None = None,
    band: BandFA3 | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hard vertical-slash attention over a packed variable-length batch, on the GPU.

    Parameters are those of the reference (q ``[Nq, Hq, D]``, k/v ``[Nk, Hkv, D]``, admitted
    ``[Nk, Hkv]`` bool, qo_indptr/kv_indptr ``[B + 1]``, q_pos ``[Nq]``, k_pos ``[Nk]``), plus:

    plan : work lists from :func:`build_vertical_slash_plan_triton` (built here when None) or
        ``vertical_slash_plan.build_vertical_slash_plan``; reusable across layers that share
        ``admitted`` and positions.
    compacted : ``(k_compact, v_compact)`` from :func:`compact_admitted_triton` (or the torch
        :func:`compact_admitted`; built here when None), with the plan's ``compact_align``.
    config : launch shape (:func:`default_config` when None); ``plan.block_m`` must match it, and
        ``plan.compact_align`` must be :func:`compact_align` of it (the kernel reads whole tiles).
    fa3 : ``flash_attn_with_kvcache`` (:func:`~.fa3_vertical.load_fa3`) or a stand-in with its
        contract: the vertical range runs there (:mod:`.fa3_vertical`) and this kernel adds the band
        to its output; ``compacted`` is then built here.
    band : ``(flash_attn_varlen_func, qo_indptr and kv_indptr in int32, most rows, most keys)`` for keys
        in the pool's layout (:mod:`.fa3_band`: far global entries, then positions one by one up to
        each sequence's last query, a full window of them where there are global entries): FA3 runs
        the local window and this kernel adds the rest. Not with ``fa3``.
    out : ``[Nq, Hq, D]`` in q's dtype, contiguous in D (a mixed forward's first rows): written and
        returned in place of a new tensor.

    Positions must not decrease within each sequence. Returns ``[Nq, Hq, D]`` in q's dtype; nothing is
    synchronised with the host.
    """
    _check_inputs(q, k, v, admitted, qo_indptr, kv_indptr, q_pos, k_pos, local_window)
    Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[:2]
    cfg = config or default_config(D)
    align = compact_align(cfg)
    # the admitted-key counts both work lists start from, computed once
    excl = _exclusive_count(admitted) if plan is None or compacted is None else None
    if plan is None:
        # The one-launch plan: several times faster than the torch plan at 32K-128K keys, with the same
        # values (checked on the GPU and in the interpreter).
        plan = build_vertical_slash_plan_triton(
            admitted, qo_indptr, kv_indptr, q_pos, k_pos, local_window, cfg.block_m, excl, align
        )
    elif (plan.block_m, plan.compact_align) != (cfg.block_m, align):
        raise ValueError(
            f"plan (block_m {plan.block_m}, compact_align {plan.compact_align}) != config's ({cfg.block_m}, {align})"
        )
    rows = compacted_rows(Nk, kv_indptr.numel() - 1, align)
    if compacted is not None and any(c.shape != (Hkv, rows, D) for c in compacted):
        raise ValueError(f"compacted buffers must be [{Hkv}, {rows}, {D}] (compact_align {align})")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = _output(q, out)
    if band is not None and fa3 is not None:
        raise ValueError("FA3 runs either the vertical range (fa3) or the local window (band), not both")
    if fa3 is not None and compacted is not None:
        raise ValueError("with fa3 the compacted keys are laid out in pages and built here")
    if Nq == 0:
        return out
    o_v = lse_v = out  # FA3's output and log-sum-exp: not read where neither FA3 call runs
    if compacted is None:
        kc, vc = compact_admitted_triton(k, v, admitted, kv_indptr, excl=excl, align=align)
    else:
        kc, vc = compacted
    if band is not None:
        o_v, lse_v = fa3_band(q, k, v, *band, scale, local_window)
    elif fa3 is not None:
        o_v, lse_v = fa3_vertical(q, kc, vc, plan, scale, fa3)
    stride_vn, stride_vg = o_v.stride(0), o_v.stride(1)
    stride_lg = lse_v.stride(0)
    adm = admitted.contiguous().view(torch.uint8)
    num_blocks = plan.q_start.numel()
    bm, bn = cfg.block_m, cfg.block_n
    # 2-D views for the tensor-memory-accelerator loads: one row per token, heads side by side.
    q_desc = TensorDescriptor(q, [Nq, Hq * D], [q.stride(0), 1], [bm, D])
    k_desc = TensorDescriptor(k, [Nk, Hkv * D], [k.stride(0), 1], [bn, D])
    v_desc = TensorDescriptor(v, [Nk, Hkv * D], [v.stride(0), 1], [bn, D])
    kc_desc = TensorDescriptor(kc, [kc.shape[0] * kc.shape[1], D], [kc.stride(1), 1], [bn, D])
    vc_desc = TensorDescriptor(vc, [vc.shape[0] * vc.shape[1], D], [vc.stride(1), 1], [bn, D])
    grid = (Hq, num_blocks)
    _vertical_slash_fwd[grid](
        q_desc,
        k_desc,
        v_desc,
        kc_desc,
        vc_desc,
        out,
        adm,
        q_pos,
        k_pos,
        plan.q_start,
        plan.q_end,
        plan.compact_start,
        plan.band_start,
        plan.band_end,
        plan.vertical_len,
        o_v,
        lse_v,
        out.stride(0),
        out.stride(1),
        adm.stride(0),
        stride_vn,
        stride_vg,
        stride_lg,
        kc.shape[1],
        scale * 1.4426950408889634,
        local_window,
        num_blocks,
        Hkv,
        Nq,
        GROUP=Hq // Hkv,
        HEAD_DIM=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        VERTICAL_GIVEN=fa3 is not None,
        BAND_GIVEN=band is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
