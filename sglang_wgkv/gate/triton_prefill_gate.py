"""Triton prefill gate: the write gate of one layer over a prefill chunk in one launch.

Same values as :class:`~sglang_wgkv.gate.mlp.LayerGate` (``g = sigmoid(w2 . GELU(w1 [RMSNorm(k_pre);
RMSNorm(k_post)] + b1) + b2)`` per KV head), for the ``T`` new keys of a prefill chunk. The torch
path runs two float32 RMSNorms, a concatenation, an einsum over ``w1`` that cuBLAS serves with a
float32 SIMT sgemm, GELU, an einsum with ``w2`` and a sigmoid: about ten elementwise kernels over
``[T, H, D]`` float32 and a matmul without tensor cores: a visible share of a served prefill chunk's
GPU time at the Llama-3.1-8B shape (32 layers, H = 8, D = 128, I = 512).

Grid ``(cdiv(T, BLOCK_T), H)``: a program takes ``BLOCK_T`` rows of one KV head, loads both keys
and RMS-normalises them in float32 in registers, then walks the hidden width in blocks of
``BLOCK_I``: ``hidden = pre_n @ w1[h, :D, i] + post_n @ w1[h, D:, i] + b1[h, i]`` on the tensor cores,
exact-erf GELU, and ``acc += sum(gelu * w2[h, i])``; it stores ``sigmoid(acc + b2[h])``. Nothing of
``[T, H, I]`` or ``[T, H, 2D]`` reaches memory.

The matmuls take float32 operands with ``input_precision="bf16x3"`` or ``"tf32x3"`` (three bf16 or
TF32 products per product: about float32 accuracy; :func:`served_launch`). Admission is ``g >= tau``,
so a logit must stay within about ``1e-5`` of the float32 torch gate; plain TF32's 10-bit mantissa
would not keep it there.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from sglang_wgkv.gate.prefill_gate_launch import (
    FOLD_PRECISION,
    SPLIT_PRECISION,
    GateLaunch,
    served_check_cases,
    served_launch,
)

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the split launch's halves: float16 under Triton's interpreter, which computes no bf16 dot correctly
_SPLIT_HALF = torch.float16 if _INTERPRETED else torch.bfloat16


_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NO_ADMIT, _THRESHOLD, _RANDOM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Largest |g - g_torch| :func:`checked_prefill_gate` accepts (the tf32x3 dots give ~1e-6).
CHECK_TOLERANCE = 1e-4

logger = logging.getLogger(__name__)


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["T", "stride_ut"], do_not_specialize_on_alignment=["G", "Tau", "Uniform", "Admit"]
)
def _prefill_gate_kernel(
    KPre,
    KPost,
    PreNorm,
    PostNorm,
    W1,
    W1Hi,
    W1Lo,
    B1,
    W2,
    B2,
    G,
    Tau,
    Uniform,
    Admit,
    T,
    H,
    stride_pt,
    stride_ph,
    stride_qt,
    stride_qh,
    stride_ut,
    random_p,
    eps,
    HEAD_DIM: tl.constexpr,
    INNER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
    WRITE_G: tl.constexpr,
    ADMIT: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    FOLD: tl.constexpr,
    HALF: tl.constexpr,
):
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live_t = t < T
    t = t.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    pre_in = tl.load(
        KPre + t[:, None] * stride_pt + h * stride_ph + d[None, :], mask=live_t[:, None], other=0.0
    )
    post_in = tl.load(
        KPost + t[:, None] * stride_qt + h * stride_qh + d[None, :], mask=live_t[:, None], other=0.0
    )
    pre, post = pre_in.to(tl.float32), post_in.to(tl.float32)
    # Rows past T are zeros: rsqrt(eps) * 0 stays 0, and their gate values are never stored.
    pre_s = tl.rsqrt(tl.sum(pre * pre, 1) / HEAD_DIM + eps)
    post_s = tl.rsqrt(tl.sum(post * post, 1) / HEAD_DIM + eps)
    if FOLD:  # the keys as the dots take them; the rows' norms after the dots
        pre_h, post_h = pre_in.to(HALF), post_in.to(HALF)
        pre_over_post = pre_s / post_s
    else:
        pre = pre * pre_s[:, None] * tl.load(PreNorm + d)[None, :]
        post = post * post_s[:, None] * tl.load(PostNorm + d)[None, :]
    w_off = h.to(tl.int64) * (2 * HEAD_DIM * INNER)
    if SPLIT:  # the keys' halves once a program, not once a hidden block inside each dot
        pre_hi = pre.to(HALF)
        pre_lo = (pre - pre_hi.to(tl.float32)).to(HALF)
        post_hi = post.to(HALF)
        post_lo = (post - post_hi.to(tl.float32)).to(HALF)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i0 in range(0, INNER, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        live = i < INNER
        # Hidden units past I load zero weights and bias: GELU(0) * 0 adds nothing.
        top_at = w_off + d[:, None] * INNER + i[None, :]
        bottom_at = top_at + HEAD_DIM * INNER
        if FOLD:  # x @ (hi + lo), the pre half scaled to the post half's norm between the two
            hidden = tl.dot(
                pre_h, tl.load(W1Lo + top_at, mask=live[None, :], other=0.0), out_dtype=tl.float32
            )
            hidden = tl.dot(pre_h, tl.load(W1Hi + top_at, mask=live[None, :], other=0.0), hidden)
            hidden = hidden * pre_over_post[:, None]
            hidden = tl.dot(post_h, tl.load(W1Lo + bottom_at, mask=live[None, :], other=0.0), hidden)
            hidden = tl.dot(post_h, tl.load(W1Hi + bottom_at, mask=live[None, :], other=0.0), hidden)
            hidden = hidden * post_s[:, None]
        elif SPLIT:  # bf16x3 by hand: the small products first, then hi x hi, all into float32
            top_hi = tl.load(W1Hi + top_at, mask=live[None, :], other=0.0)
            bottom_hi = tl.load(W1Hi + bottom_at, mask=live[None, :], other=0.0)
            hidden = tl.dot(pre_lo, top_hi, out_dtype=tl.float32)
            hidden = tl.dot(pre_hi, tl.load(W1Lo + top_at, mask=live[None, :], other=0.0), hidden)
            hidden = tl.dot(post_lo, bottom_hi, hidden)
            hidden = tl.dot(post_hi, tl.load(W1Lo + bottom_at, mask=live[None, :], other=0.0), hidden)
            hidden = tl.dot(pre_hi, top_hi, hidden)
            hidden = tl.dot(post_hi, bottom_hi, hidden)
        else:
            top = tl.load(W1 + top_at, mask=live[None, :], other=0.0)
            bottom = tl.load(W1 + bottom_at, mask=live[None, :], other=0.0)
            hidden = tl.dot(pre, top, input_precision=PRECISION)
            hidden = tl.dot(post, bottom, hidden, input_precision=PRECISION)
        hidden += tl.load(B1 + h * INNER + i, mask=live, other=0.0)[None, :]
        gelu = 0.5 * hidden * (1.0 + tl.math.erf(hidden * 0.7071067811865476))
        acc += tl.sum(gelu * tl.load(W2 + h * INNER + i, mask=live, other=0.0)[None, :], 1)
    g = 1.0 / (1.0 + tl.exp(-(acc + tl.load(B2 + h))))
    if WRITE_G:
        tl.store(G + t * H + h, g, mask=live_t)
    if ADMIT != _NO_ADMIT:  # the decode step's flags (as DecodeGate decides them)
        tau = tl.load(Tau + t, mask=live_t, other=0.0)
        if ADMIT == _RANDOM:
            admit = (tl.load(Uniform + t * stride_ut + h, mask=live_t, other=1.0) < random_p) | (
                tau == float("-inf")
            )
        else:
            admit = g >= tau
        tl.store(Admit + t * H + h, admit.to(tl.uint8), mask=live_t)


class PrefillGate:
    """The fused prefill gate of every layer of a :class:`~sglang_wgkv.gate.mlp.WriteGates`.

    Parameters
    ----------
    gates : the model's gates (any float dtype; kept as float32 contiguous copies or views).
        ``head_dim`` must be a power of two, at least 16 (a ``tl.dot`` operand dimension).
    weights : the per-layer float32 tuples of a :class:`~sglang_wgkv.gate.triton_gate.DecodeGate`
        of the same gates (``DecodeGate.layers``), shared instead of copied again.
    launch : the launch shape of every call (default: :func:`served_launch` of its rows).
    """

    def __init__(self, gates, weights: list[tuple] | None = None, launch: GateLaunch | None = None):
        from sglang_wgkv.gate.triton_gate import float32_weights

        self.launch = launch  # None: :func:`served_launch` of each call's rows

        self.layers = weights if weights is not None else float32_weights(gates)
        self._w1_halves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # split launches' w1
        self._w1_folded: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # fold launches' w1
        if len(self.layers) != len(gates.layers):
            raise ValueError(f"{len(self.layers)} layers of weights for {len(gates.layers)} gate layers")
        first = gates.layers[0]
        self.num_kv_heads, self.head_dim, self.eps = first.num_kv_heads, first.head_dim, first.eps
        self.inner = first.w1.shape[-1]
        self.device = first.w1.device
        D = self.head_dim
        if D < 16 or D & (D - 1):
            raise ValueError(f"the prefill gate needs a power-of-two head_dim >= 16, got {D}")

    def __call__(
        self, layer: int, k_pre: torch.Tensor, k_post: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gate values ``[T, H]`` float32 in [0, 1] of one layer's ``T`` new keys.

        layer : index into the gates' layers;
        k_pre, k_post : ``[T, H, D]`` bf16 / fp16 / fp32 on the gates' device (last dim contiguous;
            any row / head strides, e.g. views of a fused qkv buffer);
        out : optional contiguous float32 ``[T, H]`` that receives the values (returned).
        """
        T, H = self._check(layer, k_pre, k_post)
        out = self._g_out(out, T, H, "out")
        if out is None:
            out = torch.empty(T, H, dtype=torch.float32, device=self.device)
        if T:
            self._launch(layer, k_pre, k_post, out, None, None, None, 0.0)
        return out

    def admit(
        self,
        layer: int,
        k_pre: torch.Tensor,
        k_post: torch.Tensor,
        tau: torch.Tensor,
        uniform: torch.Tensor | None = None,
        random_p: float | None = None,
        g_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Admission flags ``[T, H]`` (bool) of one layer's new keys, decided as
        :class:`~sglang_wgkv.gate.triton_gate.DecodeGate` decides them, in the same one launch as
        the gate values (the decode step's gate at large batches: :data:`~sglang_wgkv.gate.prefill_gate_launch.DECODE_MIN_ROWS`).

        tau : ``[T]`` or ``[T, 1]`` float32 threshold per row (``-inf``: admission off): admit
            ``g >= tau``; with ``random_p``: admit ``uniform < random_p`` (or ``tau == -inf``),
            ``uniform`` ``[T, H]`` float32 draws (head stride 1);
        g_out : optional contiguous ``[T, H]`` float32 that receives the gate values.
        """
        T, H = self._check(layer, k_pre, k_post)
        tau = tau.reshape(-1).contiguous()  # the kernel reads Tau + row
        if tau.shape != (T,) or tau.dtype != torch.float32 or tau.device != self.device:
            raise ValueError(f"tau must be float32 [T] on {self.device}, got {tau.dtype} {tuple(tau.shape)}")
        if (random_p is None) != (uniform is None):
            raise ValueError("uniform draws and random_p go together")
        if uniform is not None and (
            uniform.shape != (T, H)
            or uniform.stride(1) != 1
            or uniform.dtype != torch.float32
            or uniform.device != self.device
        ):
            raise ValueError(
                f"uniform must be float32 [T, H] with head stride 1, got {uniform.dtype} "
                f"{tuple(uniform.shape)}"
            )
        g_out = self._g_out(g_out, T, H, "g_out")
        flags = torch.empty(T, H, dtype=torch.uint8, device=self.device)
        if T:
            self._launch(layer, k_pre, k_post, g_out, flags, tau, uniform, float(random_p or 0.0))
        return flags.view(torch.bool)

    def _g_out(self, out, T, H, name):
        if out is not None and (
            out.shape != (T, H)
            or out.dtype != torch.float32
            or not out.is_contiguous()
            or out.device != self.device
        ):
            raise ValueError(
                f"{name} must be a contiguous float32 [T, H] on {self.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )
        return out

    def _launch(self, layer, k_pre, k_post, g, flags, tau, uniform, random_p):
        T, H, D = k_post.shape
        pre_norm, post_norm, w1, b1, w2, b2 = self.layers[layer]
        admit = (_NO_ADMIT if flags is None else _RANDOM if uniform is not None else _THRESHOLD).value
        any_f32 = g if g is not None else tau  # placeholders where a pointer is not read
        shape = self.launch or served_launch(T, self.device)
        fold = shape.precision == FOLD_PRECISION and k_pre.dtype == k_post.dtype != torch.float32
        split = shape.precision == SPLIT_PRECISION or (shape.precision == FOLD_PRECISION and not fold)
        # the interpreter computes no bf16 dot correctly: there bf16 keys go to float16 (exactly, at
        # keys' magnitudes)
        half = (torch.float16 if _INTERPRETED else k_pre.dtype) if fold else _SPLIT_HALF
        if fold:
            w1_hi, w1_lo = self.w1_folded(layer, half)
        else:
            w1_hi, w1_lo = self.w1_halves(layer) if split else (w1, w1)
        _prefill_gate_kernel[(triton.cdiv(T, shape.block_t), H)](
            k_pre,
            k_post,
            pre_norm,
            post_norm,
            w1,
            w1_hi,
            w1_lo,
            b1,
            w2,
            b2,
            any_f32,
            tau if tau is not None else any_f32,
            uniform if uniform is not None else any_f32,
            flags if flags is not None else any_f32,
            T,
            H,
            k_pre.stride(0),
            k_pre.stride(1),
            k_post.stride(0),
            k_post.stride(1),
            uniform.stride(0) if uniform is not None else 0,
            random_p,
            float(self.eps),
            HEAD_DIM=D,
            INNER=self.inner,
            BLOCK_T=shape.block_t,
            BLOCK_I=shape.block_i,
            WRITE_G=g is not None,
            ADMIT=admit,
            PRECISION="ieee" if split or fold else shape.precision,
            SPLIT=split,
            FOLD=fold,
            HALF=tl.bfloat16 if half == torch.bfloat16 else tl.float16,
            num_warps=shape.num_warps,
            num_stages=shape.num_stages,
        )

    def w1_halves(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``w1`` of ``layer`` as two bf16 tensors (float16 under the interpreter) whose sum is it to
        about float32 precision (the high half, then the rest rounded): made on a layer's first split
        launch and kept."""
        if layer not in self._w1_halves:
            w1 = self.layers[layer][2]
            hi = w1.to(_SPLIT_HALF)
            self._w1_halves[layer] = (hi, (w1 - hi.float()).to(_SPLIT_HALF))
        return self._w1_halves[layer]

    def w1_folded(self, layer: int, half: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``w1`` of ``layer`` with the RMSNorm weights folded in (each input row scaled by its norm
        weight: pre-RoPE rows, then post-RoPE ones), as two ``half`` tensors whose sum is it to about
        float32 precision: made on a layer's first fold launch with keys of that dtype, and kept."""
        if (layer, half) not in self._w1_folded:
            pre_norm, post_norm, w1 = self.layers[layer][:3]
            folded = w1 * torch.cat([pre_norm, post_norm])[None, :, None]
            hi = folded.to(half)
            self._w1_folded[layer, half] = (hi, (folded - hi.float()).to(half))
        return self._w1_folded[layer, half]

    def _check(self, layer, k_pre, k_post) -> tuple[int, int]:
        T, H, D = k_post.shape
        if k_pre.shape != (T, H, D) or H != self.num_kv_heads or D != self.head_dim:
            raise ValueError(
                f"k_pre/k_post [T, {self.num_kv_heads}, {self.head_dim}] expected, got "
                f"{tuple(k_pre.shape)}, {tuple(k_post.shape)}"
            )
        if k_pre.dtype not in _INPUT_DTYPES or k_post.dtype not in _INPUT_DTYPES:
            raise ValueError(f"k_pre/k_post must be bf16, fp16 or fp32, got {k_pre.dtype}, {k_post.dtype}")
        if k_pre.stride(2) != 1 or k_post.stride(2) != 1:
            raise ValueError("k_pre and k_post need a contiguous last dim")
        if k_pre.device != self.device or k_post.device != self.device:
            raise ValueError(f"k_pre/k_post must be on {self.device}, got {k_pre.device}, {k_post.device}")
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer {layer} out of range for {len(self.layers)} gate layers")
        return T, H


def checked_prefill_gate(
    gates,
    weights: list[tuple] | None = None,
    rows: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    random_p: float | None = None,
) -> PrefillGate | None:
    """A :class:`PrefillGate` of ``gates`` after one check on their device against the torch gate
    (every layer, each of ``rows`` random keys of ``dtype`` (default: :func:`served_check_cases`),
    the served keys' dtype, through the values
    alone, the extend's admission with ``random_p`` and the decode step's: every launch shape and
    variant a served forward makes is compiled here, before the server takes a request); None, with a warning in
    the log, when it does not compile there, fails to launch or differs by more than
    :data:`CHECK_TOLERANCE`. A server then prefills with the torch gate instead of failing at its
    first request."""
    c = gates.config
    try:
        gate = PrefillGate(gates, weights)
        cases = served_check_cases(gate.device) if rows is None else [(n, None) for n in rows]
        gen = torch.Generator(device=gate.device).manual_seed(0)
        worst = 0.0
        for (n, launch), layer in ((case, layer) for case in cases for layer in range(len(gates.layers))):
            gate.launch = launch
            k_pre, k_post = (
                torch.randn(n, c.num_kv_heads, c.head_dim, generator=gen, device=gate.device).to(dtype)
                for _ in range(2)
            )
            want = gates(layer, k_pre, k_post)
            g = torch.empty(n, c.num_kv_heads, dtype=torch.float32, device=gate.device)
            tau = torch.full((n,), c.tau, device=gate.device)
            uniform = None
            if random_p is not None:
                uniform = torch.rand(n, c.num_kv_heads, generator=gen, device=gate.device)
            flags = gate.admit(layer, k_pre, k_post, tau, uniform, random_p, g_out=g)
            for got in (gate(layer, k_pre, k_post), g):
                worst = max(worst, float((got - want).abs().max()))
            # the decode step's variant (no values out) must decide as the extend's does
            if not torch.equal(gate.admit(layer, k_pre, k_post, tau, uniform, random_p), flags):
                worst = float("inf")
        gate.launch = None  # served: each call's rows choose
    except Exception as exc:  # a compile or launch failure must not take the server down
        logger.warning(
            "wgkv: the Triton prefill gate failed its start-up check (%s: %s); the prefill uses "
            "the torch gate",
            type(exc).__name__,
            str(exc)[:500],
        )
        return None
    if not worst <= CHECK_TOLERANCE:  # NaN fails too
        logger.warning(
            "wgkv: the Triton prefill gate differs from the torch gate by %.3g (> %g) at start-up; "
            "the prefill uses the torch gate",
            worst,
            CHECK_TOLERANCE,
        )
        return None
    logger.info("wgkv: Triton prefill gate (start-up check: max |g - g_torch| = %.2g)", worst)
    return gate
