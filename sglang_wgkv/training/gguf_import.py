"""Dequantize a Llama-architecture GGUF (e.g. the embedded SmolLM2) into a transformers model in memory.

Used where neither ``sglang_wgkv.embedded_model`` nor transformers' own GGUF loader (which needs
``accelerate``) is available, e.g. on the offline device. Needs the pure-Python ``gguf`` package.
"""

from pathlib import Path

import numpy as np
import torch

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader, key: str):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value.item() if value.size == 1 else value.tolist()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q/k rows; transformers keeps them split.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_config_from_gguf(path: str | Path):
    """A ``LlamaConfig`` read from a GGUF file's ``llama.*`` metadata."""
    from gguf import GGUFReader
    from transformers import LlamaConfig

    r = GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama only)")
    has_output = any(t.name == "output.weight" for t in r.tensors)
    return LlamaConfig(
        vocab_size=_field(r, "llama.vocab_size"),
        hidden_size=_field(r, "llama.embedding_length"),
        intermediate_size=_field(r, "llama.feed_forward_length"),
        num_hidden_layers=_field(r, "llama.block_count"),
        num_attention_heads=_field(r, "llama.attention.head_count"),
        num_key_value_heads=_field(r, "llama.attention.head_count_kv"),
        max_position_embeddings=_field(r, "llama.context_length"),
        rms_norm_eps=_field(r, "llama.attention.layer_norm_rms_epsilon"),
        rope_theta=_field(r, "llama.rope.freq_base"),
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
        tie_word_embeddings=not has_output,
    )


def llama_from_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu"):
    """Build a ``LlamaForCausalLM`` with the dequantized weights of the GGUF file at ``path``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import LlamaForCausalLM

    config = llama_config_from_gguf(path)
    r = GGUFReader(str(path))
    state = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
        name = t.name
        if name == "token_embd.weight":
            state["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            state["model.norm.weight"] = w
        elif name == "output.weight":
            state["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_MAP:
                raise ValueError(f"{path}: unexpected tensor {name}")
            if rest == "attn_q.weight":
                w = _unpermute(w, config.num_attention_heads)
            elif rest == "attn_k.weight":
                w = _unpermute(w, config.num_key_value_heads)
            state[f"model.layers.{idx}.{_LAYER_MAP[rest]}"] = w
        else:
            raise ValueError(f"{path}: unexpected tensor {name}")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, assign=True, strict=True
    )
    if config.tie_word_embeddings:
        model.tie_weights()
    # Non-persistent buffers (RoPE inv_freq) stayed on meta: rebuild the rotary module for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.to(device=device, dtype=dtype).eval()
