"""Triton split kernel of the folded decode: one (request, KV head) stream's chunk of tokens, read
through the pool's page table, with the fused ring write, the observation window and the fused merge.

Launched by :func:`~sglang_wgkv.attention.triton_decode.folded_decode` (which validates the inputs and
describes the launch); torch reference: :func:`sglang_wgkv.attention.reference.paged_decode_attention`.
"""

import triton
import triton.language as tl

from sglang_wgkv.attention.triton_decode_merge import _merge_group, _stream_chunk


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # Triton 3.6's interpreter multiplies bfloat16 operands as their raw uint16 bits: upcast there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["num_splits", "stride_yr", "obs_window", "stride_lb", "stride_lh"],
    do_not_specialize_on_alignment=[
        "PageTable",
        "GlobalLen",
        "Req",
        "RingTokens",
        "SplitsDone",
        "Pos",
        "ObsPos",
        "ObsRow",
        "KScale",
        "VScale",
    ],
)
def _split_kernel(
    Q,
    K,
    V,
    PageTable,
    GlobalLen,
    Req,
    RingTokens,
    PartO,
    PartLse,
    Out,
    SplitsDone,
    KNew,
    VNew,
    Pos,
    ObsQ,
    ObsPos,
    ObsRow,
    KScale,
    VScale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_vp,
    stride_vt,
    stride_nb,
    stride_nh,
    stride_vnb,
    stride_vnh,
    window,
    stride_xr,
    stride_xw,
    stride_xh,
    stride_yr,
    obs_window,
    stride_pr,
    stride_ph,
    stride_pc,
    stride_gr,
    stride_gh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    stride_db,
    qk_scale,
    num_kv_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    WRITE_NEW: tl.constexpr,
    OBSERVE: tl.constexpr,
    OBSERVE_POS: tl.constexpr,
    OBS_ROWS: tl.constexpr,
    FUSED: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    if PDL:  # launched early (programmatic dependent launch): every earlier kernel's writes visible from here
        tl.extra.cuda.gdc_wait()
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    r, n, chunk = _stream_chunk(Req, RingTokens, GlobalLen, b, h, stride_gr, stride_gh, num_splits, BLOCK_N)
    if OBSERVE:
        if split == 0:  # the evictor's window: this stream's queries (and, once per row, the position)
            p = tl.load(Pos + b)
            oslot = (p % obs_window).to(tl.int64)
            orow = r  # the slot's window row: the slot itself, or the evictor's map
            if OBS_ROWS:
                orow = tl.load(ObsRow + r).to(tl.int64)
            oheads = h * GROUP + tl.arange(0, GROUP_PAD)
            od = tl.arange(0, HEAD_DIM)
            ok = (tl.arange(0, GROUP_PAD) < GROUP)[:, None]
            oq = tl.load(
                Q + b.to(tl.int64) * stride_qb + oheads[:, None] * stride_qh + od[None, :], mask=ok, other=0.0
            )
            tl.store(
                ObsQ + orow * stride_xr + oslot * stride_xw + oheads[:, None] * stride_xh + od[None, :],
                oq.to(ObsQ.dtype.element_ty),
                mask=ok,
            )
            if OBSERVE_POS:
                if h == 0:
                    tl.store(ObsPos + orow * stride_yr + oslot, p.to(ObsPos.dtype.element_ty))
    used = tl.cdiv(n, tl.maximum(chunk, 1))  # non-empty splits
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    if start >= end:
        if FUSED:
            if (used == 0) & (split == 0):  # no split will count: write the empty stream's zeros here
                _merge_group(
                    Out,
                    PartO,
                    PartLse,
                    b,
                    h,
                    used,
                    stride_outb,
                    stride_outh,
                    stride_ob,
                    stride_oh,
                    stride_os,
                    stride_lb,
                    stride_lh,
                    GROUP,
                    MERGE_ROWS,
                    HEAD_DIM,
                    SPLITS_PAD,
                    BLOCK_S,
                )
        return
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    qhead = h * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + qhead[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if QUANT:  # the dots run in fp16: FP8 converts to it in one instruction per two values, to bf16 in two
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    pt_row = PageTable + r * stride_pr + h * stride_ph
    offs_n = tl.arange(0, BLOCK_N)
    # FP8 pages (QUANT): keys and values are used in stored units (an FP8 value converts exactly to
    # fp16); k_scale folds into the logits' scale and v_scale into the output, read from
    # device scalars so that a captured graph follows them.
    if QUANT:
        k_scale = tl.load(KScale)
        v_scale = tl.load(VScale)
    else:
        k_scale = 1.0
        v_scale = 1.0
    qk_scale = qk_scale * k_scale
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # The new token's ring slot (WRITE_NEW): its key, value and page are loaded here, ahead of the loop
    # (their latency hidden behind it), by the program whose chunk holds it; the loop skips the slot.
    new_tok = (tl.load(Pos + b) % window).to(tl.int32) if WRITE_NEW else -1
    holds_new = (new_tok >= start) & (new_tok < end)
    if WRITE_NEW:
        kn = tl.load(KNew + b.to(tl.int64) * stride_nb + h * stride_nh + offs_d, mask=holds_new, other=0.0)
        vn = tl.load(VNew + b.to(tl.int64) * stride_vnb + h * stride_vnh + offs_d, mask=holds_new, other=0.0)
        if QUANT:  # quantized once, here (saturating, as kv_quant.quantize; div_rn: IEEE division as torch's)
            kn = tl.clamp(tl.math.div_rn(kn.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
            vn = tl.clamp(tl.math.div_rn(vn.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX)
        kn = kn.to(K.dtype.element_ty)
        vn = vn.to(V.dtype.element_ty)
        new_page = tl.load(pt_row + (new_tok // PAGE) * stride_pc, mask=holds_new, other=0).to(tl.int64)
    for s in range(start, end, BLOCK_N):
        tok = s + offs_n
        ok = (tok < end) & (tok != new_tok)
        page = tl.load(pt_row + (tok // PAGE) * stride_pc, mask=ok, other=0).to(tl.int64)
        slot = (tok % PAGE)[:, None]
        k = tl.load(
            K + page[:, None] * stride_kp + slot * stride_kt + offs_d[None, :], mask=ok[:, None], other=0.0
        )
        v = tl.load(
            V + page[:, None] * stride_vp + slot * stride_vt + offs_d[None, :], mask=ok[:, None], other=0.0
        )
        if QUANT:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = _dot(q, tl.trans(k), UPCAST) * qk_scale
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A step whose only token is the new one has no score: m_new stays -inf, p and alpha 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    if WRITE_NEW:
        if holds_new:
            # One more online-softmax step with the new key and value (rounded to the pool's dtype, as
            # read back later), then the ring write.
            qk_n = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * qk_scale
            m_new = tl.maximum(m_i, qk_n)
            p_n = tl.math.exp2(qk_n - m_new)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + p_n
            acc = acc * alpha[:, None] + p_n[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
            tl.store(K + new_page * stride_kp + (new_tok % PAGE) * stride_kt + offs_d, kn)
            tl.store(V + new_page * stride_vp + (new_tok % PAGE) * stride_vt + offs_d, vn)
    o_ptr = (
        PartO + b.to(tl.int64) * stride_ob + qhead[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    )
    tl.store(o_ptr, acc * (v_scale / l_i)[:, None], mask=row_ok[:, None])
    tl.store(
        PartLse + b.to(tl.int64) * stride_lb + qhead * stride_lh + split, m_i + tl.math.log2(l_i), mask=row_ok
    )
    if FUSED:
        # The scalar atomic runs on one thread: the barrier orders every thread's partial stores before
        # it, and its release (at GPU scope) publishes them with the count. The acquire half makes the
        # other splits' partials visible to the program that counts last; the barrier after it passes
        # that ordering on to all its threads before they read them (.cg, in _merge_rows).
        tl.debug_barrier()
        done_ptr = SplitsDone + b.to(tl.int64) * stride_db + h
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == used - 1:
            tl.store(done_ptr, 0)  # every split of this launch has counted: zero for the next launch
            tl.debug_barrier()
            _merge_group(
                Out,
                PartO,
                PartLse,
                b,
                h,
                used,
                stride_outb,
                stride_outh,
                stride_ob,
                stride_oh,
                stride_os,
                stride_lb,
                stride_lh,
                GROUP,
                MERGE_ROWS,
                HEAD_DIM,
                SPLITS_PAD,
                BLOCK_S,
            )
