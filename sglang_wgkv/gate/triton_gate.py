"""Triton decode gate: the write gate and the admission decision of one layer in one launch.

Same result as :class:`~sglang_wgkv.gate.mlp.LayerGate` followed by the admission rule of the
serving backend (``g >= tau``; or, with random admission, ``u < P`` with admission-off requests,
``tau = -inf``, keeping every token), for the few rows of a decode step. The torch path runs about
25 small kernels per layer (two RMSNorms, concatenation, two einsums, GELU, sigmoid, compares); at
batch 1 their launches, not their bytes, cost a decode step about a millisecond on a 32-layer model.

Grid ``(B * H, S)``: a program takes one (row, KV head) and one of ``S`` contiguous slices of the
hidden width I. It normalises the two keys, multiplies them by its slice of ``w1``, applies GELU and
dots with ``w2``, and stores its partial logit. The program that finishes last for its (row, head)
(an atomic arrival count) sums the ``S`` partial logits in slice order (deterministic), adds ``b2``
and writes the flag, then resets the count to zero for the next launch. Splitting I spreads the
``2D x I`` float32 weights of a head (512 KiB at D = 128, I = 512) over many SMs when ``B * H`` is
small (batch 1 at the Llama-3.1-8B shape would otherwise leave most SMs idle); with ``S = 1`` a program
does it all.

Nothing is allocated but the ``[B, H]`` flags and ``[B, H, S]`` partials, and nothing syncs: the
launch can be captured in a CUDA graph. The arrival counts (``[>= B * H]`` int32, zero between
launches) belong to the caller: :class:`DecodeGate` holds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLIT_COUNT = 32


# Index and per-forward buffers are views at batch-dependent offsets and strides: their alignment and
# divisibility left unspecialized, so one compiled variant serves every batch (testing/jit_keys.py).
@triton.jit(
    do_not_specialize=["num_splits", "slice_width", "stride_ub"],
    do_not_specialize_on_alignment=["Tau", "Uniform", "Partial", "Count", "Admit", "G"],
)
def _decode_gate_kernel(
    KPre,
    KPost,
    PreNorm,
    PostNorm,
    W1,
    B1,
    W2,
    B2,
    Tau,
    Uniform,
    Partial,
    Count,
    Admit,
    G,
    H,
    stride_pb,
    stride_ph,
    stride_qb,
    stride_qh,
    stride_ub,
    random_p,
    eps,
    num_splits,
    slice_width,
    HEAD_DIM: tl.constexpr,
    INNER: tl.constexpr,
    BLOCK_I: tl.constexpr,
    RANDOM: tl.constexpr,
    WRITE_G: tl.constexpr,
    MAX_S: tl.constexpr,
):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, HEAD_DIM)
    pre = tl.load(KPre + b * stride_pb + h * stride_ph + d).to(tl.float32)
    post = tl.load(KPost + b * stride_qb + h * stride_qh + d).to(tl.float32)
    pre = pre * tl.rsqrt(tl.sum(pre * pre, 0) / HEAD_DIM + eps) * tl.load(PreNorm + d).to(tl.float32)
    post = post * tl.rsqrt(tl.sum(post * post, 0) / HEAD_DIM + eps) * tl.load(PostNorm + d).to(tl.float32)
    w1 = W1 + h.to(tl.int64) * (2 * HEAD_DIM * INNER)
    acc = 0.0
    for i0 in range(s * slice_width, tl.minimum((s + 1) * slice_width, INNER), BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        live = i < INNER
        top = tl.load(w1 + d[:, None] * INNER + i[None, :], mask=live[None, :], other=0.0)
        bottom = tl.load(w1 + (d[:, None] + HEAD_DIM) * INNER + i[None, :], mask=live[None, :], other=0.0)
        hidden = tl.sum(pre[:, None] * top, 0) + tl.sum(post[:, None] * bottom, 0)
        hidden += tl.load(B1 + h * INNER + i, mask=live, other=0.0)
        gelu = 0.5 * hidden * (1.0 + tl.math.erf(hidden * 0.7071067811865476))
        acc += tl.sum(gelu * tl.load(W2 + h * INNER + i, mask=live, other=0.0), 0)
    tl.store(Partial + bh * MAX_S + s, acc)
    if tl.atomic_add(Count + bh, 1) == num_splits - 1:  # acq_rel: the other slices' stores are visible
        k = tl.arange(0, MAX_S)
        parts = tl.load(Partial + bh * MAX_S + k, mask=k < num_splits, other=0.0, volatile=True)
        g = 1.0 / (1.0 + tl.exp(-(tl.sum(parts, 0) + tl.load(B2 + h))))
        tau = tl.load(Tau + b)
        if RANDOM:
            admit = (tl.load(Uniform + b * stride_ub + h) < random_p) | (tau == float("-inf"))
        else:
            admit = g >= tau
        if WRITE_G:
            tl.store(G + bh, g)
        tl.store(Admit + bh, admit.to(tl.uint8))
        tl.atomic_xchg(Count + bh, 0)


def float32_weights(gates) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, ``(pre_norm, post_norm, w1, b1, w2, b2)`` of ``gates`` as float32 contiguous tensors
    (views where they already are): what the Triton gates read."""
    return [
        tuple(
            getattr(layer, name).detach().float().contiguous()
            for name in ("pre_norm", "post_norm", "w1", "b1", "w2", "b2")
        )
        for layer in gates.layers
    ]


class DecodeGate:
    """The fused decode gate of every layer of a :class:`~sglang_wgkv.gate.mlp.WriteGates`.

    Parameters
    ----------
    gates : the model's gates (any float dtype; kept as float32 contiguous copies or views).
    max_rows : the largest ``B * H`` a launch may have (sizes the arrival counts).
    """

    def __init__(self, gates, max_rows: int):
        self.layers = float32_weights(gates)
        first = gates.layers[0]
        self.num_kv_heads, self.head_dim, self.eps = first.num_kv_heads, first.head_dim, first.eps
        self.inner = first.w1.shape[-1]
        self.device = first.w1.device
        self.count = torch.zeros(max_rows, dtype=torch.int32, device=self.device)

    def num_splits(self, rows: int, sms: int) -> int:
        """Slices of I per (row, head): about two programs per SM, at least 32 hidden units each
        (at batch 1 x 8 heads and I = 512, 16 slices of 32 KiB of float32 weights each)."""
        want = -(-2 * sms // max(1, rows))
        return int(max(1, min(want, MAX_SPLIT_COUNT, -(-self.inner // 32))))

    def __call__(
        self,
        layer: int,
        k_pre: torch.Tensor,
        k_post: torch.Tensor,
        tau: torch.Tensor,
        uniform: torch.Tensor | None = None,
        random_p: float | None = None,
        num_splits: int = 1,
        g_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Admission flags ``[B, H]`` (bool) of one layer's new keys.

        k_pre, k_post : ``[B, H, D]`` (last dim contiguous; any row / head strides);
        tau : ``[B]`` or ``[B, 1]`` float32 threshold per row (``-inf``: admission off);
        uniform : ``[B, H]`` float32 draws (head stride 1) when ``random_p`` is set;
        g_out : optional contiguous ``[B, H]`` float32 that receives the gate values.
        """
        B, H, D = k_post.shape
        if k_pre.shape != (B, H, D) or H != self.num_kv_heads or D != self.head_dim:
            raise ValueError(
                f"k_pre/k_post [B, {self.num_kv_heads}, {self.head_dim}] expected, got "
                f"{tuple(k_pre.shape)}, {tuple(k_post.shape)}"
            )
        if k_pre.stride(2) != 1 or k_post.stride(2) != 1:
            raise ValueError("k_pre and k_post need a contiguous last dim")
        tau = tau.reshape(-1)
        if tau.shape != (B,) or tau.dtype != torch.float32:
            raise ValueError(f"tau must be float32 [B], got {tau.dtype} {tuple(tau.shape)}")
        if (random_p is None) != (uniform is None):
            raise ValueError("uniform draws and random_p go together")
        if uniform is not None and (uniform.shape != (B, H) or uniform.stride(1) != 1):
            raise ValueError(f"uniform must be [B, H] with head stride 1, got {tuple(uniform.shape)}")
        if B * H > self.count.numel():
            raise ValueError(f"{B * H} (row, head) pairs, the arrival counts hold {self.count.numel()}")
        if g_out is not None and (
            g_out.shape != (B, H) or g_out.dtype != torch.float32 or not g_out.is_contiguous()
        ):
            raise ValueError(
                f"g_out must be a contiguous float32 [B, H], got {g_out.dtype} {tuple(g_out.shape)}"
            )
        if not 1 <= num_splits <= MAX_SPLIT_COUNT:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLIT_COUNT}], got {num_splits}")
        admit = torch.empty(B, H, dtype=torch.uint8, device=k_post.device)
        if B == 0:
            return admit.bool()
        partial = torch.empty(B * H, MAX_SPLIT_COUNT, dtype=torch.float32, device=k_post.device)
        block_i = 32
        slice_width = -(-self.inner // num_splits)
        slice_width = -(-slice_width // block_i) * block_i
        num_splits = -(-self.inner // slice_width)
        pre_norm, post_norm, w1, b1, w2, b2 = self.layers[layer]
        u = uniform if uniform is not None else tau
        _decode_gate_kernel[(B * H, num_splits)](
            k_pre,
            k_post,
            pre_norm,
            post_norm,
            w1,
            b1,
            w2,
            b2,
            tau,
            u,
            partial,
            self.count,
            admit,
            g_out if g_out is not None else partial,
            H,
            k_pre.stride(0),
            k_pre.stride(1),
            k_post.stride(0),
            k_post.stride(1),
            u.stride(0) if uniform is not None else 0,
            float(random_p or 0.0),
            float(self.eps),
            num_splits,
            slice_width,
            HEAD_DIM=D,
            INNER=self.inner,
            BLOCK_I=block_i,
            RANDOM=uniform is not None,
            WRITE_G=g_out is not None,
            MAX_S=MAX_SPLIT_COUNT,
            num_warps=4,
        )
        return admit.view(torch.bool)


def reference_decode_gate(gate_layer, k_pre, k_post, tau, uniform=None, random_p=None) -> torch.Tensor:
    """The torch oracle of :class:`DecodeGate` for one layer: flags ``[B, H]`` bool."""
    g = gate_layer(k_pre, k_post)
    tau = tau.reshape(-1, 1).to(g.dtype)
    if random_p is None:
        return g >= tau
    return (uniform < random_p) | torch.isneginf(tau)
