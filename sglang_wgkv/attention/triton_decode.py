"""Triton split-KV decode straight from the dual-cache pool's page table (no plan, no host data).

Same result as :func:`sglang_wgkv.attention.reference.paged_decode_attention` over
``build_folded_indices(*DualCachePool.decode_page_rows(layer)[:3])``, read without that index build:
after ``write_decode`` the stream (request slot r, layer l, KV head h) holds exactly the tokens
``i in [0, ring_tokens + global_len[r, l, h])``, token i at page ``page_table[r, l, h, i // 16]``,
offset ``i % 16`` (ring pages are full whenever a global token exists). Decode has no positional
mask, so the order of the tokens does not matter.

Two launches, both with host-fixed grids (CUDA-graph safe, no host sync):

1. split: grid ``(B * H, num_splits)``. A program takes one (request, KV head) and one contiguous
   chunk of its tokens, ``chunk = ceil(ceil(n / num_splits) / BLOCK_N) * BLOCK_N`` computed on the
   device from the actual length n (programs past the end exit at once). Per step it loads the page
   ids of ``BLOCK_N`` tokens, gathers their K/V rows, scores the GQA group (padded to 16 rows) with
   one ``tl.dot`` and runs an online softmax; it writes a normalised partial output and its
   log2-sum-exp to the workspace.
2. merge: grid ``(B * Hq,)``. Recomputes the chunk, weighs the non-empty splits by their
   log-sum-exp and writes the output in q's dtype.
"""

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_wgkv.config import PAGE_SIZE

_LOG2E = 1.4426950408889634
MAX_SPLIT_COUNT = 128


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split kernel: tokens per step (a multiple of 16), warps, pipeline stages."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_n < PAGE_SIZE or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= {PAGE_SIZE}, got {self.block_n}")


class FoldedDecodeWorkspace:
    """Partial outputs ``[max_batch, Hq, max_splits, D]`` and log2-sum-exps ``[max_batch, Hq, max_splits]``.

    Allocated once; :func:`folded_decode` with this workspace allocates nothing, so it can be captured
    in a CUDA graph. Runs that share a workspace must not overlap (one stream).
    """

    def __init__(self, max_batch: int, num_q_heads: int, head_dim: int, max_splits: int, device,
                 dtype: torch.dtype = torch.float32):
        if not 1 <= max_splits <= MAX_SPLIT_COUNT:
            raise ValueError(f"max_splits must be in [1, {MAX_SPLIT_COUNT}], got {max_splits}")
        self.max_batch, self.num_q_heads, self.head_dim, self.max_splits = max_batch, num_q_heads, head_dim, max_splits
        self.part_out = torch.empty(max_batch, num_q_heads, max_splits, head_dim, dtype=dtype, device=device)
        self.part_lse = torch.empty(max_batch, num_q_heads, max_splits, dtype=torch.float32, device=device)


def choose_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, device=None) -> int:
    """Splits per (request, KV head): about four programs per SM, chunks of at least 256 tokens.

    Host-only; keep it fixed for a captured batch size (``max_kv_len`` = the context limit then).
    """
    sms = 132
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    streams = max(1, batch * num_kv_heads)
    want = -(-4 * sms // streams)
    return int(max(1, min(want, -(-max_kv_len // 256), MAX_SPLIT_COUNT)))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # Triton 3.6's interpreter multiplies bfloat16 operands as their raw uint16 bits: upcast there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _stream_chunk(Req, RingTokens, GlobalLen, b, h, stride_gr, stride_gh, num_splits, BLOCK_N: tl.constexpr):
    """(request slot, tokens n, tokens per split) of stream (b, h); shared by both launches."""
    r = tl.load(Req + b).to(tl.int64)
    n = tl.load(RingTokens + b).to(tl.int32) + tl.load(GlobalLen + r * stride_gr + h * stride_gh).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    return r, n, chunk


@triton.jit
def _split_kernel(
    Q, K, V, PageTable, GlobalLen, Req, RingTokens, PartO, PartLse,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_vp, stride_vt,
    stride_pr, stride_ph, stride_pc, stride_gr, stride_gh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale, num_kv_heads, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    r, n, chunk = _stream_chunk(Req, RingTokens, GlobalLen, b, h, stride_gr, stride_gh, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    if start >= end:
        return
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    qhead = h * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + qhead[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    pt_row = PageTable + r * stride_pr + h * stride_ph
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Every step holds at least one token of the stream, so m_i is finite after the first one.
    for s in range(start, end, BLOCK_N):
        tok = s + offs_n
        ok = tok < end
        page = tl.load(pt_row + (tok // PAGE) * stride_pc, mask=ok, other=0).to(tl.int64)
        slot = (tok % PAGE)[:, None]
        k = tl.load(K + page[:, None] * stride_kp + slot * stride_kt + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + page[:, None] * stride_vp + slot * stride_vt + offs_d[None, :], mask=ok[:, None], other=0.0)
        qk = _dot(q, tl.trans(k), UPCAST) * qk_scale
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    o_ptr = PartO + b.to(tl.int64) * stride_ob + qhead[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr, acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(PartLse + b.to(tl.int64) * stride_lb + qhead * stride_lh + split, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _merge_kernel(
    Out, GlobalLen, Req, RingTokens, PartO, PartLse,
    stride_outb, stride_outh, stride_gr, stride_gh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    num_q_heads, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // num_q_heads
    qh = pid % num_q_heads
    _, n, chunk = _stream_chunk(Req, RingTokens, GlobalLen, b, qh // GROUP, stride_gr, stride_gh, num_splits,
                                BLOCK_N)
    used = tl.cdiv(n, tl.maximum(chunk, 1))
    offs_d = tl.arange(0, HEAD_DIM)
    lse_row = PartLse + b.to(tl.int64) * stride_lb + qh * stride_lh
    o_row = PartO + b.to(tl.int64) * stride_ob + qh * stride_oh
    all_s = tl.arange(0, SPLITS_PAD)
    lse = tl.load(lse_row + all_s, mask=all_s < used, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(used > 0, m, 0.0)  # an empty stream (no token) outputs zeros, like the reference
    denom = tl.sum(tl.math.exp2(lse - m), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    for s0 in range(0, used, BLOCK_S):
        s = s0 + offs_s
        ok = s < used
        w = tl.math.exp2(tl.load(lse_row + s, mask=ok, other=float("-inf")) - m)
        part = tl.load(o_row + s[:, None] * stride_os + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b.to(tl.int64) * stride_outb + qh * stride_outh + offs_d, out.to(Out.dtype.element_ty))


def _check_inputs(q, k_pages, v_pages, page_table, global_len, req, ring_tokens, layer):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if D not in (64, 128, 256):
        raise ValueError(f"head_dim must be 64, 128 or 256, got {D}")
    if k_pages.shape != v_pages.shape or k_pages.dim() != 3 or k_pages.shape[1:] != (PAGE_SIZE, D):
        raise ValueError(f"k_pages/v_pages must be [P, {PAGE_SIZE}, {D}], got {tuple(k_pages.shape)}, "
                         f"{tuple(v_pages.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"q/k_pages/v_pages must share dtype float16 or bfloat16, got {q.dtype}, "
                         f"{k_pages.dtype}, {v_pages.dtype}")
    if page_table.dim() != 4 or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 [R, L, H, C], got {page_table.dtype} {tuple(page_table.shape)}")
    R, L, H, _ = page_table.shape
    if global_len.shape != (R, L, H) or global_len.dtype != torch.int32:
        raise ValueError(f"global_len must be int32 [{R}, {L}, {H}], got {global_len.dtype} {tuple(global_len.shape)}")
    if Hq % H:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {H}")
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range [0, {L})")
    if req.shape != (B,) or ring_tokens.shape != (B,):
        raise ValueError(f"req and ring_tokens must be [{B}], got {tuple(req.shape)}, {tuple(ring_tokens.shape)}")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")


def folded_decode(q, k_pages, v_pages, page_table, global_len, req, ring_tokens, layer: int,
                  sm_scale: float | None = None, num_splits: int | None = None,
                  workspace: FoldedDecodeWorkspace | None = None, out=None,
                  config: DecodeConfig | None = None) -> torch.Tensor:
    """Decode attention of one layer over the dual-cache pool.

    Parameters
    ----------
    q : ``[B, Hq, D]`` float16/bfloat16; query heads ``h*group .. (h+1)*group - 1`` read KV head h.
    k_pages, v_pages : ``[P, 16, D]`` the pool's pages, q's dtype.
    page_table : ``[R, L, H, C]`` int32; global_len : ``[R, L, H]`` int32 (the pool's tensors).
    req : ``[B]`` request slots; ring_tokens : ``[B]`` ring tokens after this step's write
        (``min(pos + 1, W)``); any integer dtype.
    layer : the layer whose page-table rows are read.
    sm_scale : softmax scale (``1 / sqrt(D)`` when None).
    num_splits : chunks per (request, KV head) (:func:`choose_num_splits` when None: fix it when
        capturing a graph); at most ``workspace.max_splits``.
    workspace, out : preallocated buffers (``out`` ``[B, Hq, D]`` in q's dtype); with both given
        nothing is allocated. Nothing is ever synchronised with the host.
    config : launch shape of the split kernel (:class:`DecodeConfig` defaults when None).

    Returns ``[B, Hq, D]`` in q's dtype.
    """
    _check_inputs(q, k_pages, v_pages, page_table, global_len, req, ring_tokens, layer)
    B, Hq, D = q.shape
    H = page_table.shape[2]
    cfg = config or DecodeConfig()
    if num_splits is None:
        num_splits = choose_num_splits(B, H, page_table.shape[3] * PAGE_SIZE, q.device)
    if workspace is None:
        workspace = FoldedDecodeWorkspace(B, Hq, D, num_splits, q.device)
    ws = workspace
    if not 1 <= num_splits <= ws.max_splits or B > ws.max_batch or (ws.num_q_heads, ws.head_dim) != (Hq, D):
        raise ValueError(f"workspace [{ws.max_batch}, {ws.num_q_heads}, {ws.max_splits}, {ws.head_dim}] does not "
                         f"fit B={B}, Hq={Hq}, D={D}, num_splits={num_splits}")
    tensors = (q, k_pages, v_pages, page_table, global_len, req, ring_tokens, ws.part_out, ws.part_lse)
    if any(t.device != q.device for t in tensors):
        raise ValueError("all inputs and the workspace must be on one device")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("inputs must be on a CUDA device (or run under TRITON_INTERPRET=1)")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {q.dtype} [{B}, {Hq}, {D}] contiguous in D, got {out.dtype} {tuple(out.shape)}")
    if B == 0:
        return out
    group = Hq // H
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    pt = page_table[:, layer]
    gl = global_len[:, layer]
    po, pl = ws.part_out, ws.part_lse
    _split_kernel[(B * H, num_splits)](
        q, k_pages, v_pages, pt, gl, req, ring_tokens, po, pl,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), v_pages.stride(0), v_pages.stride(1),
        pt.stride(0), pt.stride(1), pt.stride(2), gl.stride(0), gl.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        scale * _LOG2E, H, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_N=cfg.block_n,
        PAGE=PAGE_SIZE, UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    splits_pad = triton.next_power_of_2(num_splits)
    _merge_kernel[(B * Hq,)](
        out, gl, req, ring_tokens, po, pl,
        out.stride(0), out.stride(1), gl.stride(0), gl.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        Hq, num_splits,
        GROUP=group, HEAD_DIM=D, BLOCK_N=cfg.block_n, SPLITS_PAD=splits_pad, BLOCK_S=min(splits_pad, 16),
        num_warps=4,
    )
    return out
