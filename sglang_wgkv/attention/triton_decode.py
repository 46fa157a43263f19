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

This module validates and launches; the kernels are in :mod:`~sglang_wgkv.attention.triton_decode_split`
and :mod:`~sglang_wgkv.attention.triton_decode_merge`, the launch shape and workspace in
:mod:`~sglang_wgkv.attention.decode_config`.
"""

import math
import os

import torch
import triton

from sglang_wgkv.attention.decode_config import (
    MAX_SPLIT_COUNT,
    DecodeConfig,
    FoldedDecodeWorkspace,
    choose_num_splits,
)
from sglang_wgkv.attention.triton_decode_merge import _merge_kernel
from sglang_wgkv.attention.triton_decode_split import _split_kernel
from sglang_wgkv.config import PAGE_SIZE
from sglang_wgkv.memory.kv_quant import is_fp8

_LOG2E = 1.4426950408889634
# The fused merge takes _MERGE_ROWS query heads at once (masked past the group) and loads _MERGE_TILE
# fp32 partials (rows x splits x D) per loop step. With these, ptxas (sm_90, 4 warps) gives the split
# kernel the registers it has without the merge for D 64/128/256 and groups 1-16, except D 256 group 1;
# 2 or 8 rows, or an 8192 tile, took more at some groups.
_MERGE_ROWS = 4
_MERGE_TILE = 4096
# The merge's split axis, padded to the most splits any batch takes rather than to this batch's count:
# one compiled variant for every batch size and length (testing/jit_keys.py).
_SPLITS_PAD = triton.next_power_of_2(MAX_SPLIT_COUNT)


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
    observe : ``(obs_q, obs_pos)`` or ``(obs_q, obs_pos, obs_row)``, with the ring write: the
        evictor's observation window of this layer, ``obs_q`` ``[N, W_obs, Hq, D]`` (last dim
        contiguous) and its positions ``obs_pos`` ``[N, W_obs]`` int64 or None (shared by the layers:
        give it once per step); ``obs_row`` ``[R]`` int64, the window row of each request slot
        (default: the slot itself). Row b's queries are stored at ``obs_q[row, pos[b] % W_obs]`` (in
        obs_q's dtype) and ``pos[b]`` at ``obs_pos[row, pos[b] % W_obs]``, ``row = obs_row[req[b]]``,
        as :meth:`SnapKVEvictor.observe_decode` does.
    k_scale, v_scale : FP8 pages' per-tensor scales of this layer, one-element float32 device tensors
        (read by the kernel: a captured graph follows in-place updates); unused otherwise.

    Returns ``[B, Hq, D]`` in q's dtype.
    """
    _check_inputs(q, k_pages, v_pages, page_table, global_len, req, ring_tokens, layer, (k_scale, v_scale))
    quant = is_fp8(k_pages.dtype)
    B, Hq, D = q.shape
    H = page_table.shape[2]
    cfg = config or DecodeConfig.for_pages(k_pages.dtype)
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
    obs_q, obs_pos, obs_row = (*observe, None)[:3] if observe is not None else (None, None, None)
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
        if obs_row is not None and (
            obs_row.dim() != 1 or obs_row.dtype != torch.int64 or obs_row.device != q.device
        ):
            raise ValueError(
                f"obs_row must be int64 [R] on q's device, got {obs_row.dtype} {tuple(obs_row.shape)}"
            )
    if B == 0:
        return out
    group = Hq // H
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    pt = page_table[:, layer]
    gl = global_len[:, layer]
    po, pl, done = ws.part_out, ws.part_lse, ws.splits_done
    splits_pad = _SPLITS_PAD
    options = cfg.launch_options(q.device.type)
    nk, nv, npos = (new_k, new_v, pos) if write_new else (q, q, req)  # placeholders: never read
    xq = obs_q if obs_q is not None else q.unsqueeze(0)  # placeholders: never written
    xp = obs_pos if obs_pos is not None else req.view(1, -1)
    xr = obs_row if obs_row is not None else req  # placeholder: never read
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
        xr,
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
        OBS_ROWS=obs_row is not None,
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
