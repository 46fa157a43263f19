"""Triton split-KV decode straight from the dual-cache pool's page table (no plan, no host data).

Same result as :func:`sglang_wgkv.attention.reference.paged_decode_attention` over
``build_folded_indices(*DualCachePool.decode_page_rows(layer)[:3])``, read without that index build:
after ``write_decode`` the stream (request slot r, layer l, KV head h) holds exactly the tokens
``i in [0, ring_tokens + global_len[r, l, h])``, token i at page ``page_table[r, l, h, i // 16]``,
offset ``i % 16`` (ring pages are full whenever a global token exists). Decode has no positional
mask, so the order of the tokens does not matter.

Host-fixed grids (CUDA-graph safe, no host sync, no per-call memset):

1. split: grid ``(B * H, num_splits)``. A program takes one (request, KV head) and one contiguous
   chunk of its tokens, ``chunk = ceil(ceil(n / num_splits) / BLOCK_N) * BLOCK_N`` computed on the
   device from the actual length n (programs past the end exit at once, so a stream has
   ``cdiv(n, chunk)`` non-empty splits). Per step it loads the page ids of ``BLOCK_N`` tokens,
   gathers their K/V rows, scores the GQA group (padded to 16 rows) with one ``tl.dot`` and runs an
   online softmax; it writes a normalised partial output and its log2-sum-exp to the workspace.
   With the step's new keys and values given (``new_k``/``new_v``, the decode step's ring write
   fused), the program whose chunk holds the new token's ring slot ``pos % window`` takes that token
   from them (one more softmax step, after its loop, which skips the slot) and writes it to its page:
   no other program reads that slot in the launch, so the write races with nothing.
   With an observation window given (``observe``, the SnapKV evictor's query ring), the split-0
   program of each stream also stores its GQA group's queries at window slot ``pos % W_obs`` (and,
   with the window's position row, the stream of KV head 0 stores ``pos`` there): the evictor's
   per-layer record of the step, without launches of its own.
2. merge: weighs a stream's non-empty splits by their log-sum-exp (``exp2(lse - max) / sum``) and
   writes the output in q's dtype; an empty stream (n == 0) outputs zeros, like the reference.
   :attr:`DecodeConfig.fused_merge` says where it runs:

   * fused (the default; one launch): each non-empty split, after storing its partials, counts
     itself on its stream's counter in the workspace (an acquire-release atomic add at GPU scope);
     the program that takes the last count (``cdiv(n, chunk) - 1``) resets the counter to 0, so the
     next launch or graph replay starts from zero, and merges the stream's GROUP query heads. An
     empty stream has no split to count: its split-0 program writes the zeros.
   * two launches: a merge kernel, grid ``(B * Hq,)``, after the split kernel.
"""

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_wgkv.config import PAGE_SIZE
from sglang_wgkv.memory.kv_quant import is_fp8

_LOG2E = 1.4426950408889634
MAX_SPLIT_COUNT = 128
# The fused merge takes _MERGE_ROWS query heads at once (masked past the group) and loads _MERGE_TILE
# fp32 partials (rows x splits x D) per loop step. With these, ptxas (sm_90, 4 warps) gives the split
# kernel the registers it has without the merge for D 64/128/256 and groups 1-16, except D 256 group 1;
# 2 or 8 rows, or an 8192 tile, took more at some groups.
_MERGE_ROWS = 4
_MERGE_TILE = 4096


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split kernel: tokens per step (a multiple of 16), warps, pipeline stages;
    whether the split kernel merges the splits itself (one launch) or a merge kernel follows;
    ``pdl``: programmatic dependent launch (sm90+, CUDA only): the split kernel may be launched while
    the kernel before it drains and waits for it (``griddepcontrol.wait``) before its first load, so
    the launch gap overlaps the previous kernel's tail (measured by ``benchmarks/decode_fixed_cost.py``);
    ``programs_per_sm``: the split count's target (:func:`choose_num_splits`); and ``maxnreg``: a cap on
    the registers per thread (0: the compiler's choice; CUDA only). On sm_90 the default shape takes 120
    registers and 38 KiB of shared memory (four programs of 4 warps per SM by registers, six by shared
    memory; ``benchmarks/sm90_registers.py``, ptxas on CPU at the launch's specialization), and its K/V
    gathers are ``cp.async`` copies. No other shape beat it at the served W1 length
    (``benchmarks/results/kernels/decode_launch_configs.json``).

    The served path uses the defaults unless ``--wgkv-decode-launch`` (:meth:`parse`) says otherwise:
    a switch for measuring launch shapes in service (issue 15), not a tuning knob for users."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fused_merge: bool = True
    pdl: bool = False
    programs_per_sm: int = 4
    maxnreg: int = 0

    def __post_init__(self):
        if self.block_n < PAGE_SIZE or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= {PAGE_SIZE}, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 8:
            raise ValueError(
                f"num_warps must be 1, 2, 4, 8 or 16 and num_stages 1-8, got {self.num_warps}, "
                f"{self.num_stages}"
            )
        if not 1 <= self.programs_per_sm <= 64:
            raise ValueError(f"programs_per_sm must be 1-64, got {self.programs_per_sm}")
        if self.maxnreg and not (24 <= self.maxnreg <= 255 and self.maxnreg % 8 == 0):
            raise ValueError(
                f"maxnreg must be 0 (the compiler's choice) or a multiple of 8 in 24-255, got {self.maxnreg}"
            )

    def launch_options(self, device_type: str) -> dict:
        """The split kernel's launch options on ``device_type``: warps and stages; on CUDA also PDL and
        the register cap where asked (the interpreter has neither)."""
        cuda = device_type == "cuda"
        return {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **({"launch_pdl": True} if cuda and self.pdl else {}),
            **({"maxnreg": self.maxnreg} if cuda and self.maxnreg else {}),
        }

    @classmethod
    def parse(cls, spec: str) -> "DecodeConfig":
        """``"block_n=32,pdl=1"`` -> DecodeConfig (unnamed fields keep their defaults; ``""``: all).
        ValueError naming the field on an unknown name or a bad value."""
        kwargs: dict = {}
        ints, flags = (
            ("block_n", "num_warps", "num_stages", "programs_per_sm", "maxnreg"),
            ("fused_merge", "pdl"),
        )
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, eq, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not eq or name not in ints + flags:
                raise ValueError(
                    f"decode launch {item!r}: expected NAME=VALUE with NAME one of {', '.join(ints + flags)}"
                )
            if name in ints:
                if not value.isdigit():
                    raise ValueError(f"decode launch {name} must be a positive integer, got {value!r}")
                kwargs[name] = int(value)
            elif value in ("0", "1", "false", "true"):
                kwargs[name] = value in ("1", "true")
            else:
                raise ValueError(f"decode launch {name} must be 0/1 or false/true, got {value!r}")
        return cls(**kwargs)


class FoldedDecodeWorkspace:
    """Partial outputs ``[max_batch, Hq, max_splits, D]``, log2-sum-exps ``[max_batch, Hq, max_splits]``
    and, for the fused merge, ``splits_done`` ``[max_batch, num_kv_heads]`` int32: the splits of each
    stream that have stored their partials in the running launch, zero between launches (zeroed here
    once; the last split of each stream resets its counter).

    Allocated once; :func:`folded_decode` with this workspace allocates nothing, so it can be captured
    in a CUDA graph. Runs that share a workspace must not overlap (one stream).
    ``num_kv_heads`` defaults to ``num_q_heads``, which fits any GQA grouping of those heads.
    """

    def __init__(
        self,
        max_batch: int,
        num_q_heads: int,
        head_dim: int,
        max_splits: int,
        device,
        dtype: torch.dtype = torch.float32,
        *,
        num_kv_heads: int | None = None,
    ):
        if not 1 <= max_splits <= MAX_SPLIT_COUNT:
            raise ValueError(f"max_splits must be in [1, {MAX_SPLIT_COUNT}], got {max_splits}")
        num_kv_heads = num_q_heads if num_kv_heads is None else num_kv_heads
        if not 1 <= num_kv_heads <= num_q_heads or num_q_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_q_heads {num_q_heads}, got {num_kv_heads}")
        self.max_batch, self.num_q_heads, self.head_dim, self.max_splits = (
            max_batch,
            num_q_heads,
            head_dim,
            max_splits,
        )
        self.num_kv_heads = num_kv_heads
        self.part_out = torch.empty(max_batch, num_q_heads, max_splits, head_dim, dtype=dtype, device=device)
        self.part_lse = torch.empty(max_batch, num_q_heads, max_splits, dtype=torch.float32, device=device)
        self.splits_done = torch.zeros(max_batch, num_kv_heads, dtype=torch.int32, device=device)


def choose_num_splits(
    batch: int, num_kv_heads: int, max_kv_len: int, device=None, programs_per_sm: int = 4
) -> int:
    """Splits per (request, KV head): about ``programs_per_sm`` programs per SM, chunks of at least
    256 tokens.

    Host-only; keep it fixed for a captured batch size (``max_kv_len`` = the context limit then).
    """
    sms = 132
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    streams = max(1, batch * num_kv_heads)
    want = -(-programs_per_sm * sms // streams)
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
    """The GROUP query heads of KV head h, ``MERGE_ROWS`` at a time (see :data:`_MERGE_ROWS`)."""
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


@triton.jit
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
            oheads = h * GROUP + tl.arange(0, GROUP_PAD)
            od = tl.arange(0, HEAD_DIM)
            ok = (tl.arange(0, GROUP_PAD) < GROUP)[:, None]
            oq = tl.load(
                Q + b.to(tl.int64) * stride_qb + oheads[:, None] * stride_qh + od[None, :], mask=ok, other=0.0
            )
            tl.store(
                ObsQ + r * stride_xr + oslot * stride_xw + oheads[:, None] * stride_xh + od[None, :],
                oq.to(ObsQ.dtype.element_ty),
                mask=ok,
            )
            if OBSERVE_POS:
                if h == 0:
                    tl.store(ObsPos + r * stride_yr + oslot, p.to(ObsPos.dtype.element_ty))
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
    pt_row = PageTable + r * stride_pr + h * stride_ph
    offs_n = tl.arange(0, BLOCK_N)
    # FP8 pages (QUANT): keys and values are used in stored units (an FP8 value converts exactly to
    # q's 16-bit dtype); k_scale folds into the logits' scale and v_scale into the output, read from
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
        if QUANT:  # quantized once, here (saturating, as kv_quant.quantize)
            kn = tl.clamp(kn.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
            vn = tl.clamp(vn.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
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


@triton.jit
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


def _check_inputs(q, k_pages, v_pages, page_table, global_len, req, ring_tokens, layer, scales):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if D not in (64, 128, 256):
        raise ValueError(f"head_dim must be 64, 128 or 256, got {D}")
    if k_pages.shape != v_pages.shape or k_pages.dim() != 3 or k_pages.shape[1:] != (PAGE_SIZE, D):
        raise ValueError(
            f"k_pages/v_pages must be [P, {PAGE_SIZE}, {D}], got {tuple(k_pages.shape)}, "
            f"{tuple(v_pages.shape)}"
        )
    pages_ok = k_pages.dtype == v_pages.dtype and (k_pages.dtype == q.dtype or is_fp8(k_pages.dtype))
    if q.dtype not in (torch.float16, torch.bfloat16) or not pages_ok:
        raise ValueError(
            f"q must be float16 or bfloat16 and k_pages/v_pages share q's dtype or one FP8 dtype, got "
            f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    if is_fp8(k_pages.dtype) and not all(
        isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == torch.float32 and t.device == q.device
        for t in scales
    ):
        raise ValueError("FP8 pages need k_scale and v_scale: one-element float32 tensors on q's device")
    if page_table.dim() != 4 or page_table.dtype != torch.int32:
        raise ValueError(
            f"page_table must be int32 [R, L, H, C], got {page_table.dtype} {tuple(page_table.shape)}"
        )
    R, L, H, _ = page_table.shape
    if global_len.shape != (R, L, H) or global_len.dtype != torch.int32:
        raise ValueError(
            f"global_len must be int32 [{R}, {L}, {H}], got {global_len.dtype} {tuple(global_len.shape)}"
        )
    if Hq % H:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {H}")
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range [0, {L})")
    if req.shape != (B,) or ring_tokens.shape != (B,):
        raise ValueError(
            f"req and ring_tokens must be [{B}], got {tuple(req.shape)}, {tuple(ring_tokens.shape)}"
        )
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")


def folded_decode(
    q,
    k_pages,
    v_pages,
    page_table,
    global_len,
    req,
    ring_tokens,
    layer: int,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    workspace: FoldedDecodeWorkspace | None = None,
    out=None,
    config: DecodeConfig | None = None,
    new_k=None,
    new_v=None,
    pos=None,
    window: int | None = None,
    observe=None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one layer over the dual-cache pool.

    Parameters
    ----------
    q : ``[B, Hq, D]`` float16/bfloat16; query heads ``h*group .. (h+1)*group - 1`` read KV head h.
    k_pages, v_pages : ``[P, 16, D]`` the pool's pages, q's dtype or FP8 (float8_e4m3fn/e5m2, read
        as ``float(page) * scale``; the fused ring write stores ``fp8(new / scale)``, saturated).
    page_table : ``[R, L, H, C]`` int32; global_len : ``[R, L, H]`` int32 (the pool's tensors).
    req : ``[B]`` request slots; ring_tokens : ``[B]`` ring tokens after this step's write
        (``min(pos + 1, W)``); any integer dtype.
    layer : the layer whose page-table rows are read.
    sm_scale : softmax scale (``1 / sqrt(D)`` when None).
    num_splits : chunks per (request, KV head) (:func:`choose_num_splits` when None: fix it when
        capturing a graph); at most ``workspace.max_splits``.
    workspace, out : preallocated buffers (``out`` ``[B, Hq, D]`` in q's dtype); with both given
        nothing is allocated. Nothing is ever synchronised with the host.
    config : launch shape and merge placement (:class:`DecodeConfig` defaults when None).
    new_k, new_v, pos, window : the step's ring write, fused (all four or none): ``new_k``/``new_v``
        ``[B, H, D]`` (float16/bfloat16, last dim contiguous), ``pos`` ``[B]`` the
        decoded positions. Token ``pos % window`` of each stream is then read from ``new_k``/``new_v``
        (rounded to the pages' dtype), not from the pages, and the program that holds it writes it
        there: the pool afterwards equals ``write_decode_rows`` + this call without them. The slot
        must lie within the stream (``pos % window < ring_tokens``: true for ``min(pos + 1, window)``).
    observe : ``(obs_q, obs_pos)``, with the ring write: the evictor's observation window of this
        layer, ``obs_q`` ``[R, W_obs, Hq, D]`` (last dim contiguous) and its positions ``obs_pos``
        ``[R, W_obs]`` int64 or None (shared by the layers: give it once per step). Row b's queries
        are stored at ``obs_q[req[b], pos[b] % W_obs]`` (in obs_q's dtype) and ``pos[b]`` at
        ``obs_pos[req[b], pos[b] % W_obs]``, as :meth:`SnapKVEvictor.observe_decode` does.
    k_scale, v_scale : FP8 pages' per-tensor scales of this layer, one-element float32 device tensors
        (read by the kernel: a captured graph follows in-place updates); unused otherwise.

    Returns ``[B, Hq, D]`` in q's dtype.
    """
    _check_inputs(q, k_pages, v_pages, page_table, global_len, req, ring_tokens, layer, (k_scale, v_scale))
    quant = is_fp8(k_pages.dtype)
    B, Hq, D = q.shape
    H = page_table.shape[2]
    cfg = config or DecodeConfig()
    if num_splits is None:
        num_splits = choose_num_splits(B, H, page_table.shape[3] * PAGE_SIZE, q.device, cfg.programs_per_sm)
    if workspace is None:
        workspace = FoldedDecodeWorkspace(B, Hq, D, num_splits, q.device, num_kv_heads=H)
    ws = workspace
    if (
        not 1 <= num_splits <= ws.max_splits
        or B > ws.max_batch
        or (ws.num_q_heads, ws.head_dim) != (Hq, D)
        or H > ws.num_kv_heads
    ):
        raise ValueError(
            f"workspace [{ws.max_batch}, {ws.num_q_heads} (KV {ws.num_kv_heads}), {ws.max_splits}, "
            f"{ws.head_dim}] does not fit B={B}, Hq={Hq}, H={H}, D={D}, num_splits={num_splits}"
        )
    tensors = (
        q,
        k_pages,
        v_pages,
        page_table,
        global_len,
        req,
        ring_tokens,
        ws.part_out,
        ws.part_lse,
        ws.splits_done,
    )
    if any(t.device != q.device for t in tensors):
        raise ValueError("all inputs and the workspace must be on one device")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("inputs must be on a CUDA device (or run under TRITON_INTERPRET=1)")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} [{B}, {Hq}, {D}] contiguous in D, got {out.dtype} {tuple(out.shape)}"
        )
    write_new = new_k is not None
    if (new_v is not None, pos is not None, window is not None) != (write_new,) * 3:
        raise ValueError("new_k, new_v, pos and window go together")
    if write_new:
        if (
            new_k.shape != (B, H, D)
            or new_v.shape != new_k.shape
            or new_k.stride(2) != 1
            or new_v.stride(2) != 1
        ):
            raise ValueError(
                f"new_k/new_v must be [{B}, {H}, {D}], contiguous in D; got "
                f"{tuple(new_k.shape)} {new_k.stride()}, {tuple(new_v.shape)} {new_v.stride()}"
            )
        if new_k.dtype not in (torch.float16, torch.bfloat16) or new_v.dtype != new_k.dtype:
            raise ValueError(
                f"new_k/new_v must share dtype float16 or bfloat16, got {new_k.dtype}, {new_v.dtype}"
            )
        if pos.shape != (B,) or window < 1 or any(t.device != q.device for t in (new_k, new_v, pos)):
            raise ValueError(
                f"pos must be [{B}] on q's device and window >= 1, got {tuple(pos.shape)}, {window}"
            )
    obs_q, obs_pos = observe if observe is not None else (None, None)
    if observe is not None:
        if not write_new:
            raise ValueError("observe needs the ring write's pos (new_k, new_v, pos, window)")
        if obs_q.dim() != 4 or obs_q.shape[2:] != (Hq, D) or obs_q.stride(3) != 1 or obs_q.device != q.device:
            raise ValueError(
                f"obs_q must be [R, W_obs, {Hq}, {D}] on q's device, contiguous in D; got "
                f"{tuple(obs_q.shape)} {obs_q.stride()}"
            )
        if obs_pos is not None and (
            obs_pos.shape != obs_q.shape[:2]
            or obs_pos.dtype != torch.int64
            or obs_pos.stride(1) != 1
            or obs_pos.device != q.device
        ):
            raise ValueError(
                f"obs_pos must be int64 {tuple(obs_q.shape[:2])}, got {obs_pos.dtype} {tuple(obs_pos.shape)}"
            )
    if B == 0:
        return out
    group = Hq // H
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    pt = page_table[:, layer]
    gl = global_len[:, layer]
    po, pl, done = ws.part_out, ws.part_lse, ws.splits_done
    splits_pad = triton.next_power_of_2(num_splits)
    options = cfg.launch_options(q.device.type)
    nk, nv, npos = (new_k, new_v, pos) if write_new else (q, q, req)  # placeholders: never read
    xq = obs_q if obs_q is not None else q.unsqueeze(0)  # placeholders: never written
    xp = obs_pos if obs_pos is not None else req.view(1, -1)
    _split_kernel[(B * H, num_splits)](
        q,
        k_pages,
        v_pages,
        pt,
        gl,
        req,
        ring_tokens,
        po,
        pl,
        out,
        done,
        nk,
        nv,
        npos,
        xq,
        xp,
        k_scale if quant else gl,  # placeholders: never read
        v_scale if quant else gl,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        v_pages.stride(0),
        v_pages.stride(1),
        nk.stride(0),
        nk.stride(1),
        nv.stride(0),
        nv.stride(1),
        window or 1,
        xq.stride(0),
        xq.stride(1),
        xq.stride(2),
        xp.stride(0),
        xq.shape[1],
        pt.stride(0),
        pt.stride(1),
        pt.stride(2),
        gl.stride(0),
        gl.stride(1),
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        out.stride(0),
        out.stride(1),
        done.stride(0),
        scale * _LOG2E,
        H,
        num_splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=D,
        BLOCK_N=cfg.block_n,
        PAGE=PAGE_SIZE,
        UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        WRITE_NEW=write_new,
        OBSERVE=obs_q is not None,
        OBSERVE_POS=obs_pos is not None,
        FUSED=cfg.fused_merge,
        MERGE_ROWS=_MERGE_ROWS,
        SPLITS_PAD=splits_pad,
        BLOCK_S=min(splits_pad, _MERGE_TILE // (_MERGE_ROWS * D)),
        PDL="launch_pdl" in options,
        QUANT=quant,
        FP8_MAX=torch.finfo(k_pages.dtype).max if quant else 0.0,
        **options,
    )
    if cfg.fused_merge:
        return out
    _merge_kernel[(B * Hq,)](
        out,
        gl,
        req,
        ring_tokens,
        po,
        pl,
        out.stride(0),
        out.stride(1),
        gl.stride(0),
        gl.stride(1),
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        Hq,
        num_splits,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_N=cfg.block_n,
        SPLITS_PAD=splits_pad,
        BLOCK_S=min(splits_pad, 16),
        num_warps=4,
    )
    return out
