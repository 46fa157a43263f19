"""Backbone runner, student attentions and GGUF import on tiny random models (CPU)."""

import numpy as np
import pytest
import torch

from sglang_wgkv.attention.reference import soft_gated_attention, vertical_slash_attention
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.training.attention import (
    HardGatedAttention,
    SoftGatedAttention,
    gate_values,
    kv_fraction,
    masked_attention,
    sparsity_penalty,
    visibility_mask,
)
from sglang_wgkv.training.backbone import Backbone, dense_attention

pytestmark = pytest.mark.training


def tiny_lm(kind: str = "llama", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()


def tiny_gates(
    bb: Backbone, seed: int = 0, init_bias: float = 0.0, window: int = 8, lam: float = 0.0
) -> WriteGates:
    torch.manual_seed(seed)
    s = bb.shape
    g = WriteGates(
        GateConfig(
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            local_window=window,
            lam=lam,
        )
    )
    for layer in g.layers:
        torch.nn.init.constant_(layer.b2, init_bias)
    return g


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_dense_runner_matches_hf(kind):
    lm = tiny_lm(kind)
    ids = torch.randint(0, 97, (2, 37))
    ref = lm(ids, output_hidden_states=True).hidden_states[-1]
    h, aux = Backbone(lm)(ids, dense_attention)
    torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)
    assert len(aux) == 2


def test_runner_passes_pre_and_post_rope_keys():
    lm = tiny_lm("qwen3")
    seen = {}

    def spy(layer, q, k_pre, k_post, v, scale):
        seen[layer] = (k_pre, k_post)
        return dense_attention(layer, q, k_pre, k_post, v, scale)

    Backbone(lm)(torch.randint(0, 97, (1, 12)), spy)
    k_pre, k_post = seen[0]
    torch.testing.assert_close(k_pre[:, :, 0], k_post[:, :, 0])  # position 0: RoPE is the identity
    assert not torch.allclose(k_pre[:, :, 5], k_post[:, :, 5])
    torch.testing.assert_close(k_pre.norm(dim=-1), k_post.norm(dim=-1))  # a rotation keeps the norm


def test_soft_flex_matches_sdpa_with_gradients():
    torch.manual_seed(0)
    B, Hq, Hkv, T, D, W = 2, 4, 2, 48, 16, 8
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    logit = torch.randn(B, Hkv, T, requires_grad=True)
    att = SoftGatedAttention([], W, backend="flex")
    g = torch.sigmoid(logit)
    out_flex = att._flex_attention(q, k, v, torch.log(g + 1e-6), D**-0.5)
    (gf,) = torch.autograd.grad(out_flex.square().sum(), logit)
    out_ref = soft_gated_attention(q, k, v, torch.sigmoid(logit), W, 1e-6)
    (gr,) = torch.autograd.grad(out_ref.square().sum(), logit)
    torch.testing.assert_close(out_flex, out_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gf, gr, atol=1e-3, rtol=1e-3)


def _split_vs_reference(backend, T, D, W, device="cpu", grads=True):
    torch.manual_seed(0)
    B, Hq, Hkv = 2, 6, 2
    leaves = [
        torch.randn(B, Hq, T, D, device=device, requires_grad=grads),
        torch.randn(B, Hkv, T, D, device=device, requires_grad=grads),
        torch.randn(B, Hkv, T, D, device=device, requires_grad=grads),
        torch.randn(B, Hkv, T, device=device, requires_grad=grads),
    ]
    q, k, v, logit = leaves
    weight = torch.randn(B, Hq, T, D, device=device)
    out = SoftGatedAttention([], W, backend=backend).attend(q, k, v, torch.sigmoid(logit), 0.3)
    out_ref = soft_gated_attention(q, k, v, torch.sigmoid(logit), W, 1e-6, sm_scale=0.3)
    tol = 1e-5 if device == "cpu" else 2e-4  # fused GPU kernels sum in another order
    torch.testing.assert_close(out, out_ref, atol=tol, rtol=tol)
    if grads:
        for a, b in zip(
            torch.autograd.grad((out * weight).sum(), leaves),
            torch.autograd.grad((out_ref * weight).sum(), leaves),
        ):
            torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol)


SPLIT_SHAPES = [(48, 16, 8), (37, 64, 16), (20, 24, 32)]  # (T, D, W); the last: window beyond T


@pytest.mark.parametrize("T, D, W", SPLIT_SHAPES)
def test_soft_split_matches_sdpa_with_gradients(T, D, W):
    """The two-copies-per-key form (no bias tensor) equals the reference in values and in the
    gradients of the gate logits, the queries, keys and values."""
    _split_vs_reference("split", T, D, W)


@pytest.mark.parametrize("T, D, W", SPLIT_SHAPES)
def test_soft_flex_split_matches_sdpa(T, D, W):
    """The same through FlexAttention's block mask (values; CPU FlexAttention has no backward)."""
    with torch.no_grad():
        _split_vs_reference("flex_split", T, D, W, grads=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["split", "flex_split"])
@pytest.mark.parametrize("T, D, W", [(300, 64, 128), (1024, 64, 256)])
def test_soft_split_gradients_on_cuda(backend, T, D, W):
    """fp32 on the GPU: the fused kernels (SDPA efficient / compiled FlexAttention) in forward and backward."""
    _split_vs_reference(backend, T, D, W, device="cuda")


def test_open_gates_reproduce_dense_model():
    lm = tiny_lm()
    bb = Backbone(lm)
    ids = torch.randint(0, 97, (1, 40))
    dense, _ = bb(ids, dense_attention)
    gates = tiny_gates(bb, init_bias=30.0)  # g == 1 up to float rounding
    soft, g = bb(ids, SoftGatedAttention([gates], local_window=8))
    hard, kept = bb(ids, HardGatedAttention([gates], local_window=8, tau=0.5))
    torch.testing.assert_close(soft, dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hard, dense, atol=1e-5, rtol=1e-5)
    assert all(k.all() for k in kept)


def test_hard_gated_attention_matches_core_vertical_slash():
    torch.manual_seed(1)
    Hq, Hkv, T, D, W = 4, 2, 40, 16, 8
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    kept = torch.rand(1, Hkv, T) < 0.3
    out = masked_attention(q, k, v, visibility_mask(kept, W), D**-0.5)
    pos = torch.arange(T)
    ref = vertical_slash_attention(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        kept[0].t(),
        torch.tensor([0, T]),
        torch.tensor([0, T]),
        pos,
        pos,
        W,
    )
    torch.testing.assert_close(out[0].transpose(0, 1), ref, atol=1e-5, rtol=1e-5)


def test_visibility_mask_full_rows():
    kept = torch.zeros(1, 1, 6, dtype=torch.bool)
    m = visibility_mask(kept, local_window=1, full_rows=3)[0, 0]
    assert m[:3].tolist() == torch.ones(3, 6).tril().bool()[:3].tolist()
    assert m[4].tolist() == [False, False, False, False, True, False]


def test_gate_values_per_batch_element():
    bb = Backbone(tiny_lm())
    g1, g2 = tiny_gates(bb, seed=1), tiny_gates(bb, seed=2)
    k_pre, k_post = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    g = gate_values([g1, g2], 0, k_pre, k_post)
    assert g.shape == (2, 2, 10)
    torch.testing.assert_close(g[1], g2.layers[0](k_pre[1].transpose(0, 1), k_post[1].transpose(0, 1)).t())
    with pytest.raises(ValueError):
        gate_values([g1, g2, g1], 0, k_pre, k_post)


def test_kv_fraction_and_sparsity_penalty():
    kept = torch.zeros(1, 2, 20, dtype=torch.bool)
    kept[0, 0, :6] = True  # head 0 admits 6 of the 12 keys older than the ring; head 1 admits none
    total, glob = kv_fraction(kept, 20, local_window=8)
    assert total.item() == pytest.approx(((6 + 8) + 8) / 2 / 20)
    assert glob.item() == pytest.approx((6 / 12 + 0) / 2)
    g = torch.full((2, 3, 20), 0.5)
    g[..., 12:] = 7.0  # the last W positions are never seen beyond the window: excluded
    assert sparsity_penalty(g, 8).tolist() == pytest.approx([0.75, 0.75])


def test_gguf_import_roundtrip(tmp_path):
    gguf = pytest.importorskip("gguf")
    from sglang_wgkv.training.gguf_import import llama_from_gguf

    lm = tiny_lm("llama", seed=3)
    cfg = lm.config
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(
        cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
    )
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(t, n_head):  # what llama.cpp's converter does to q/k rows
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    sd = {k: v.numpy().astype(np.float32) for k, v in lm.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = llama_from_gguf(tmp_path / "tiny.gguf")
    ids = torch.randint(0, 97, (1, 20))
    torch.testing.assert_close(loaded(ids).logits, lm(ids).logits, atol=1e-4, rtol=1e-4)
