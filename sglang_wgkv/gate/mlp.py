"""Write-Gate MLP: g = sigmoid(W2 GELU(W1 [RMSNorm(k_pre); RMSNorm(k_post)] + b1) + b2), per KV head."""

import math

import torch
from torch import nn
from torch.nn import functional as F

INFERENCE_ROW_BLOCK = 1024  # rows per block of a gate evaluation without autograd (LayerGate.logits)


class LayerGate(nn.Module):
    """All KV heads of one layer, evaluated together with batched matmuls.

    Parameters (H = KV heads, D = head_dim, I = hidden width: 4*D in the Llama layout, 1.5*D in Qwen3's):
    ``pre_norm [D]``, ``post_norm [D]`` (shared by the layer's heads), ``w1 [H, 2D, I]``, ``b1 [H, I]``,
    ``w2 [H, I]``, ``b2 [H]``.
    """

    def __init__(
        self, num_kv_heads: int, head_dim: int, hidden: int, eps: float = 1e-6, init_bias: float = 3.0
    ):
        super().__init__()
        inner = hidden
        self.num_kv_heads, self.head_dim, self.eps = num_kv_heads, head_dim, eps
        self.pre_norm = nn.Parameter(torch.ones(head_dim))
        self.post_norm = nn.Parameter(torch.ones(head_dim))
        self.w1 = nn.Parameter(torch.randn(num_kv_heads, 2 * head_dim, inner) / math.sqrt(2 * head_dim))
        self.b1 = nn.Parameter(torch.zeros(num_kv_heads, inner))
        self.w2 = nn.Parameter(torch.randn(num_kv_heads, inner) / math.sqrt(inner) * 0.1)
        # A fresh gate starts near "admit everything" so an untrained model behaves like dense.
        self.b2 = nn.Parameter(torch.full((num_kv_heads,), init_bias))

    def logits(self, k_pre: torch.Tensor, k_post: torch.Tensor) -> torch.Tensor:
        """k_pre, k_post: ``[T, H, D]`` (or ``[T, H*D]``) -> logits ``[T, H]`` in float32.

        Without autograd, rows go through in blocks of :data:`INFERENCE_ROW_BLOCK`: the float32
        ``[T, H, 2D]`` / ``[T, H, I]`` temporaries of a whole prefill chunk (59 MiB at 6K tokens of
        SmolLM2's shape, measured) stay those of one block (14 MiB)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        k_pre, k_post = k_pre.reshape(shape), k_post.reshape(shape)
        T = k_pre.shape[0]
        if torch.is_grad_enabled() or T <= INFERENCE_ROW_BLOCK:
            return self._logits(k_pre, k_post)
        out = torch.empty(T, self.num_kv_heads, dtype=torch.float32, device=k_pre.device)
        for start in range(0, T, INFERENCE_ROW_BLOCK):
            rows = slice(start, start + INFERENCE_ROW_BLOCK)
            out[rows] = self._logits(k_pre[rows], k_post[rows])
        return out

    def _logits(self, k_pre: torch.Tensor, k_post: torch.Tensor) -> torch.Tensor:
        # both norms in one pass over [T, H, 2, D], both layers as batched matmuls over heads: the
        # fewest ops, since a decode step's few rows cost what its ops cost on the CPU path
        T, H, D = k_pre.shape
        x = torch.stack([k_pre, k_post], dim=2).float()
        norm = torch.stack([self.pre_norm, self.post_norm]).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * norm
        x = x.view(T, H, 2 * D).transpose(0, 1)  # [H, T, 2D]
        hidden = F.gelu(torch.baddbmm(self.b1.float()[:, None, :], x, self.w1.float()), approximate="none")
        logits = torch.baddbmm(self.b2.float()[:, None, None], hidden, self.w2.float()[:, :, None])
        return logits[..., 0].t().contiguous()

    def forward(self, k_pre: torch.Tensor, k_post: torch.Tensor) -> torch.Tensor:
        """Gate values ``[T, H]`` in [0, 1], float32."""
        return torch.sigmoid(self.logits(k_pre, k_post))


class WriteGates(nn.Module):
    """One :class:`LayerGate` per decoder layer, with the :class:`GateConfig` that describes them."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            LayerGate(config.num_kv_heads, config.head_dim, config.hidden, config.eps)
            for _ in range(config.num_layers)
        )

    def forward(self, layer_id: int, k_pre: torch.Tensor, k_post: torch.Tensor) -> torch.Tensor:
        return self.layers[layer_id](k_pre, k_post)

    def select_heads(self, heads: list[int]) -> "WriteGates":
        """The gates of KV heads ``heads`` only (a tensor-parallel rank's share), same parameters."""
        from dataclasses import replace

        out = WriteGates(replace(self.config, num_kv_heads=len(heads)))
        idx = torch.as_tensor(heads, dtype=torch.long)
        with torch.no_grad():
            for src, dst in zip(self.layers, out.layers):
                dst.to(src.b2.dtype)
                dst.pre_norm.copy_(src.pre_norm), dst.post_norm.copy_(src.post_norm)
                for name in ("w1", "b1", "w2", "b2"):
                    getattr(dst, name).copy_(getattr(src, name).detach().cpu()[idx])
        return out.to(self.layers[0].b2.device)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError naming expected vs found when the gates do not fit the model."""
        c = self.config
        found = (c.num_layers, c.num_kv_heads, c.head_dim)
        expected = (num_layers, num_kv_heads, head_dim)
        if found != expected:
            raise ValueError(
                "gate checkpoint does not match the model: expected (layers, kv_heads, head_dim) = "
                f"{expected}, found {found}"
            )
