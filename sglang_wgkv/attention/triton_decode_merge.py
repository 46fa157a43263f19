"""Triton kernels of the folded decode's merge: the log-sum-exp weighing of a stream's split partials,
run fused at the end of the split kernel or as its own launch (:func:`_merge_kernel`).

Launched by :func:`~sglang_wgkv.attention.triton_decode.folded_decode` (which validates the inputs);
torch reference: :func:`sglang_wgkv.attention.reference.paged_decode_attention`.
"""

import triton
import triton.language as tl


@triton.jit
def _stream_chunk(Req, RingTokens, GlobalLen, b, h, stride_gr, stride_gh, num_splits, BLOCK_N: tl.constexpr):
    """(request slot, tokens n, tokens per split) of stream (b, h); shared by both launches."""
    r = tl.load(Req + b).to(tl.int64)
    n = tl.load(RingTokens + b).to(tl.int32) + tl.load(GlobalLen + r * stride_gr + h * stride_gh).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    return r, n, chunk


@triton.jit
def _merge_rows(
    Out,
    PartO,
    PartLse,
    b,
    heads,
    head_ok,
    used,
    stride_outb,
    stride_outh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """``out[b, heads]`` (``heads`` ``[ROWS]``, rows with ``head_ok``): the partials of splits
    ``0 .. used - 1`` weighed by ``exp2(lse - max)`` over their sum; zeros where ``used == 0``."""
    # .cg (L2, not L1): in the fused merge other SMs wrote these lines during this launch, and an
    # earlier launch may have left them in this SM's L1; they are read once either way.
    b64 = b.to(tl.int64)
    lse_row = PartLse + b64 * stride_lb + heads[:, None] * stride_lh  # [ROWS, 1]
    o_row = PartO + b64 * stride_ob + heads[:, None, None] * stride_oh  # [ROWS, 1, 1]
    all_s = tl.arange(0, SPLITS_PAD)[None, :]
    lse = tl.load(
        lse_row + all_s, mask=head_ok[:, None] & (all_s < used), other=float("-inf"), cache_modifier=".cg"
    )
    m = tl.where(head_ok & (used > 0), tl.max(lse, 1), 0.0)
    denom = tl.sum(tl.math.exp2(lse - m[:, None]), 1)
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    offs_s = tl.arange(0, BLOCK_S)[None, :]
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        s = s0 + offs_s  # [1, BLOCK_S]
        ok = head_ok[:, None] & (s < used)
        w = tl.math.exp2(
            tl.load(lse_row + s, mask=ok, other=float("-inf"), cache_modifier=".cg") - m[:, None]
        )
        part = tl.load(
            o_row + s[:, :, None] * stride_os + offs_d, mask=ok[:, :, None], other=0.0, cache_modifier=".cg"
        )
        acc += tl.sum(w[:, :, None] * part, 1)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        Out + b64 * stride_outb + heads[:, None] * stride_outh + tl.arange(0, HEAD_DIM)[None, :],
        out.to(Out.dtype.element_ty),
        mask=head_ok[:, None],
    )


@triton.jit
def _merge_group(
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
    GROUP: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The GROUP query heads of KV head h, ``MERGE_ROWS`` at a time (see :data:`~sglang_wgkv.attention.triton_decode._MERGE_ROWS`)."""
    rows = tl.arange(0, MERGE_ROWS)
    for g0 in tl.static_range(0, GROUP, MERGE_ROWS):
        _merge_rows(
            Out,
            PartO,
            PartLse,
            b,
            h * GROUP + g0 + rows,
            g0 + rows < GROUP,
            used,
            stride_outb,
            stride_outh,
            stride_ob,
            stride_oh,
            stride_os,
            stride_lb,
            stride_lh,
            MERGE_ROWS,
            HEAD_DIM,
            SPLITS_PAD,
            BLOCK_S,
        )


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["num_splits", "stride_lb", "stride_lh"],
    do_not_specialize_on_alignment=["GlobalLen", "Req", "RingTokens"],
)
def _merge_kernel(
    Out,
    GlobalLen,
    Req,
    RingTokens,
    PartO,
    PartLse,
    stride_outb,
    stride_outh,
    stride_gr,
    stride_gh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    num_q_heads,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // num_q_heads
    qh = pid % num_q_heads
    _, n, chunk = _stream_chunk(
        Req, RingTokens, GlobalLen, b, qh // GROUP, stride_gr, stride_gh, num_splits, BLOCK_N
    )
    head = qh + tl.arange(0, 1)
    _merge_rows(
        Out,
        PartO,
        PartLse,
        b,
        head,
        head < num_q_heads,
        tl.cdiv(n, tl.maximum(chunk, 1)),
        stride_outb,
        stride_outh,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        1,
        HEAD_DIM,
        SPLITS_PAD,
        BLOCK_S,
    )
