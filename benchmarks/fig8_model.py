"""A Llama-3.1-8B-shaped decoder with random weights for the Fig. 8 efficiency protocol.

Attention and MLP shapes are Llama-3.1-8B's (32 layers, hidden 4096, 32 query / 8 KV heads of 128,
MLP 14336, vocab 128256, RoPE theta 5e5); weights are random (attention cost does not depend on
content). The model is written out in torch ops so that the dense baseline and WG-KV share every
non-attention kernel; only the attention and the KV storage differ (see ``fig8_end_to_end``).
"""

import torch
from torch.nn import functional as F

LAYERS, HIDDEN, HQ, HKV, D, INTER, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
ROPE_THETA, EPS = 500000.0, 1e-5


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


class RandomLlama:
    def __init__(
        self, max_pos: int, device="cuda", dtype=torch.bfloat16, layers: int = LAYERS, seed: int = 0
    ):
        g = torch.Generator(device=device).manual_seed(seed)

        def w(out_f, in_f):
            return torch.randn(out_f, in_f, device=device, dtype=dtype, generator=g) / in_f**0.5

        self.layers = layers
        self.embed = torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype, generator=g)
        self.wqkv = [w((HQ + 2 * HKV) * D, HIDDEN) for _ in range(layers)]
        self.wo = [w(HIDDEN, HQ * D) for _ in range(layers)]
        self.w_gate_up = [w(2 * INTER, HIDDEN) for _ in range(layers)]
        self.w_down = [w(HIDDEN, INTER) for _ in range(layers)]
        self.ln1 = [torch.ones(HIDDEN, device=device, dtype=dtype) for _ in range(layers)]
        self.ln2 = [torch.ones(HIDDEN, device=device, dtype=dtype) for _ in range(layers)]
        self.norm = torch.ones(HIDDEN, device=device, dtype=dtype)
        self.lm_head = w(VOCAB, HIDDEN)
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
        ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos(), ang.sin()  # [max_pos, D/2]

    def weight_bytes(self) -> int:
        ts = [
            self.embed,
            self.lm_head,
            self.norm,
            *self.wqkv,
            *self.wo,
            *self.w_gate_up,
            *self.w_down,
            *self.ln1,
            *self.ln2,
        ]
        return sum(t.numel() * t.element_size() for t in ts)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x ``[T, H, D]`` rotated (half-split layout) at positions ``pos [T]``."""
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def qkv(self, layer: int, x: torch.Tensor, pos: torch.Tensor, chunk: int = 32768):
        """Returns q ``[T, HQ, D]`` (roped), k_pre, k, v ``[T, HKV, D]`` (k roped, k_pre not), computed
        in token chunks into contiguous buffers (bounded fp32 temporaries)."""
        T = x.shape[0]
        q = x.new_empty(T, HQ, D)
        k_pre, k, v = (x.new_empty(T, HKV, D) for _ in range(3))
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            qkv = F.linear(rms_norm(x[s:e], self.ln1[layer]), self.wqkv[layer])
            q[s:e] = self.rope(qkv[:, : HQ * D].view(e - s, HQ, D), pos[s:e])
            k_pre[s:e] = qkv[:, HQ * D : (HQ + HKV) * D].view(e - s, HKV, D)
            k[s:e] = self.rope(k_pre[s:e], pos[s:e])
            v[s:e] = qkv[:, (HQ + HKV) * D :].view(e - s, HKV, D)
        return q, k_pre, k, v

    def finish_layer(
        self, layer: int, x: torch.Tensor, attn: torch.Tensor, chunk: int = 32768
    ) -> torch.Tensor:
        """Output projection, residual and MLP, in token chunks (bounded activation memory); in place."""
        T = x.shape[0]
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            x[s:e] += F.linear(attn[s:e].reshape(e - s, HQ * D), self.wo[layer])
            gu = F.linear(rms_norm(x[s:e], self.ln2[layer]), self.w_gate_up[layer])
            x[s:e] += F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], self.w_down[layer])
        return x

    def logits_last(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x[-1:], self.norm), self.lm_head)
