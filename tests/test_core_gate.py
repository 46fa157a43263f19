"""Write gate: batched per-head MLP, checkpoint formats, and clear errors."""

import json

import pytest
import torch
from torch.nn import functional as F

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.gate import (
    GateConfig,
    GateOutputError,
    WriteGates,
    admission_flags,
    check_gate_output,
    load_gates,
    load_official_pt,
    save_gates,
)
from sglang_wgkv.memory import DualCachePool, PoolExhausted

pytestmark = pytest.mark.core


def _gates(L=3, H=2, D=16, hidden=None, seed=0):
    torch.manual_seed(seed)
    gates = WriteGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=hidden, model_id="toy"))
    for p in gates.parameters():
        p.data.normal_()
    return gates


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_batched_gate_equals_per_head_loop():
    gates = _gates()
    T, H, D = 7, 2, 16
    kp, kq = torch.randn(T, H, D), torch.randn(T, H, D)
    g = gates(1, kp, kq)
    lg = gates.layers[1]
    for h in range(H):
        x = torch.cat([_rms(kp[:, h], lg.pre_norm), _rms(kq[:, h], lg.post_norm)], -1)
        want = torch.sigmoid(F.gelu(x @ lg.w1[h] + lg.b1[h]) @ lg.w2[h] + lg.b2[h])
        torch.testing.assert_close(g[:, h], want, atol=1e-5, rtol=1e-5)


def _official_state(gates):
    """Write ``gates`` in the authors' grouped-conv layout."""
    c = gates.config
    inner = c.hidden
    state = {}
    for i, lg in enumerate(gates.layers):
        p = f"model.layers.{i}.self_attn.g_predictors."
        state[p + "pre_key_norm.weight"] = lg.pre_norm.detach().clone()
        state[p + "post_key_norm.weight"] = lg.post_norm.detach().clone()
        state[p + "conv1.weight"] = (
            lg.w1.detach().transpose(1, 2).reshape(c.num_kv_heads * inner, 2 * c.head_dim, 1).clone()
        )
        state[p + "conv1.bias"] = lg.b1.detach().reshape(-1).clone()
        state[p + "conv2.weight"] = lg.w2.detach()[:, :, None].clone()
        state[p + "conv2.bias"] = lg.b2.detach().clone()
    return state


def _official_forward(state, i, kp, kq, eps=1e-6):
    """Independent evaluation with grouped 1x1 convolutions, as the authors' module computes it."""
    p = f"model.layers.{i}.self_attn.g_predictors."
    T, H, D = kp.shape
    x = torch.cat(
        [_rms(kp, state[p + "pre_key_norm.weight"], eps), _rms(kq, state[p + "post_key_norm.weight"], eps)],
        -1,
    )
    x = x.reshape(T, H * 2 * D).t()[None]  # [1, C, T]
    hid = F.gelu(F.conv1d(x, state[p + "conv1.weight"], state[p + "conv1.bias"], groups=H))
    return torch.sigmoid(F.conv1d(hid, state[p + "conv2.weight"], state[p + "conv2.bias"], groups=H))[0].t()


@pytest.mark.parametrize("T", [1, 7, 8, 9, 16, 23])
def test_blocked_inference_equals_one_pass(monkeypatch, T):
    """Without autograd the gate runs rows in blocks (bounded temporaries); every row's value is the
    one-pass value across block edges and a short last block (to rounding: a one-row block's matmul
    sums in another order)."""
    from sglang_wgkv.gate import mlp

    monkeypatch.setattr(mlp, "INFERENCE_ROW_BLOCK", 8)
    gates = _gates()
    kp, kq = torch.randn(T, 2, 16), torch.randn(T, 2, 16)
    one_pass = gates(2, kp, kq).detach()  # autograd on: never blocked
    with torch.no_grad():
        blocked = gates(2, kp, kq)
    assert blocked.shape == (T, 2)
    torch.testing.assert_close(blocked, one_pass, rtol=1e-6, atol=1e-7)


# The two published layouts: Llama gates with I = 4 * head_dim, Qwen3 gates with I = 1.5 * head_dim
# (192 for head_dim 128; here 48 for head_dim 32, which is no multiple of head_dim either).
@pytest.mark.parametrize(
    "layout, H, D, hidden", [("llama", 3, 8, 32), ("qwen3", 2, 32, 48), ("qwen3-d128", 1, 128, 192)]
)
def test_official_pt_round_trip(tmp_path, layout, H, D, hidden):
    gates = _gates(L=2, H=H, D=D, hidden=hidden)
    state = _official_state(gates)
    torch.save(state, tmp_path / "gates.pt")
    loaded = load_official_pt(tmp_path / "gates.pt")
    c = loaded.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.hidden) == (2, H, D, hidden)
    assert tuple(loaded.layers[0].w1.shape) == (H, 2 * D, hidden) and tuple(loaded.layers[0].b1.shape) == (
        H,
        hidden,
    )
    assert tuple(loaded.layers[0].w2.shape) == (H, hidden) and tuple(loaded.layers[0].b2.shape) == (H,)
    kp, kq = torch.randn(5, H, D), torch.randn(5, H, D)
    for i in range(2):
        torch.testing.assert_close(
            loaded(i, kp, kq), _official_forward(state, i, kp, kq), atol=1e-5, rtol=1e-5
        )
    # and through our own format, which stores the width itself
    save_gates(loaded, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "gates.json").read_text())["hidden"] == hidden
    again = load_gates(tmp_path / "ours")
    assert again.config == loaded.config
    torch.testing.assert_close(again(1, kp, kq), loaded(1, kp, kq))


def test_official_pt_heads_own_their_hidden_channels(tmp_path):
    """A weight change in head 1's conv1 rows moves head 1's gate only (grouped-conv channel order)."""
    gates = _gates(L=1, H=2, D=32, hidden=48)
    state = _official_state(gates)
    kp, kq = torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    before = load_official_pt(_saved(state, tmp_path / "a.pt"))(0, kp, kq)
    state["model.layers.0.self_attn.g_predictors.conv1.bias"][48:] += 5.0
    after = load_official_pt(_saved(state, tmp_path / "b.pt"))(0, kp, kq)
    torch.testing.assert_close(after, _official_forward(state, 0, kp, kq), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[:, 0], before[:, 0])
    assert not torch.allclose(after[:, 1], before[:, 1])


def _saved(state, path):
    torch.save(state, path)
    return path


def test_gate_config_reads_expand_and_stores_hidden(tmp_path):
    base = {"num_layers": 2, "num_kv_heads": 3, "head_dim": 64}
    assert GateConfig.from_dict({**base, "expand": 4}).hidden == 256
    assert GateConfig.from_dict({**base, "expand": 4, "hidden": 256}).hidden == 256
    assert GateConfig.from_dict(base).hidden == 256  # the default width
    assert GateConfig.from_dict({**base, "hidden": 96}).hidden == 96
    with pytest.raises(ValueError, match="contradicts expand"):
        GateConfig.from_dict({**base, "expand": 4, "hidden": 96})
    with pytest.raises(ValueError, match="hidden must be a positive integer"):
        GateConfig(num_layers=2, num_kv_heads=3, head_dim=64, hidden=0)
    with pytest.raises(ValueError, match="hidden must be a positive integer"):
        GateConfig(num_layers=2, num_kv_heads=3, head_dim=64, hidden=1.5)
    # a directory written before the width was stored (``"expand"`` in gates.json) still loads
    gates = _gates(L=2, H=3, D=16)
    save_gates(gates, tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "gates.json").read_text())
    cfg["expand"] = cfg.pop("hidden") // cfg["head_dim"]
    (tmp_path / "old" / "gates.json").write_text(json.dumps(cfg))
    old = load_gates(tmp_path / "old")
    assert old.config == gates.config
    kp, kq = torch.randn(4, 3, 16), torch.randn(4, 3, 16)
    torch.testing.assert_close(old(1, kp, kq), gates(1, kp, kq))


def test_official_pt_bad_shape_is_refused(tmp_path):
    state = _official_state(_gates(L=2, H=2, D=8))
    state["model.layers.1.self_attn.g_predictors.conv2.bias"] = torch.zeros(5)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"layer 1 conv2.bias has shape \(5,\), expected \(2,\)"):
        load_official_pt(tmp_path / "bad.pt")


def test_corrupt_files_are_refused(tmp_path):
    (tmp_path / "trunc.pt").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(ValueError, match="cannot read gate file"):
        load_gates(tmp_path / "trunc.pt")
    save_gates(_gates(), tmp_path / "g")
    (tmp_path / "g" / "gates.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corrupt gate weights"):
        load_gates(tmp_path / "g")
    save_gates(_gates(), tmp_path / "h")
    (tmp_path / "h" / "gates.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt gate config"):
        load_gates(tmp_path / "h")
    with pytest.raises(ValueError, match="not a gate checkpoint"):
        load_gates(tmp_path / "nothing-here")


def test_config_shape_mismatch_is_refused(tmp_path):
    save_gates(_gates(L=3, H=2, D=16), tmp_path / "g")
    cfg = json.loads((tmp_path / "g" / "gates.json").read_text())
    cfg["num_kv_heads"] = 4
    (tmp_path / "g" / "gates.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="w1 has shape"):
        load_gates(tmp_path / "g")


def test_model_mismatch_names_expected_and_found():
    gates = _gates(L=3, H=2, D=16)
    gates.check_model(3, 2, 16)
    with pytest.raises(
        ValueError, match=r"expected \(layers, kv_heads, head_dim\) = \(30, 3, 64\), found \(3, 2, 16\)"
    ):
        gates.check_model(30, 3, 64)


def test_nan_gate_output_is_reported():
    gates = _gates(L=1, H=2, D=16)
    g = gates(0, torch.full((3, 2, 16), float("nan")), torch.randn(3, 2, 16))
    with pytest.raises(GateOutputError, match="layer 0"):
        check_gate_output(g, layer_id=0)
    check_gate_output(gates(0, torch.randn(3, 2, 16), torch.randn(3, 2, 16)))


def test_random_admission_rate():
    g = torch.zeros(20000, 3)
    flags = admission_flags(g, 0.1, random_admission=0.25, generator=torch.Generator().manual_seed(0))
    assert abs(flags.float().mean().item() - 0.25) < 0.01
    assert not admission_flags(g, 0.1).any()


def test_bad_config_values():
    with pytest.raises(ValueError, match="multiple of 16"):
        WGKVConfig(local_window=100)
    with pytest.raises(ValueError, match="tau"):
        WGKVConfig(tau=1.5)
    with pytest.raises(ValueError, match="random_admission"):
        WGKVConfig(random_admission=-0.1)


def test_pool_exhaustion_leaves_pool_intact():
    pool = DualCachePool(
        2,
        2,
        8,
        num_pages=12,
        max_requests=2,
        max_context_len=256,
        config=WGKVConfig(local_window=32),
        dtype=torch.float32,
    )
    pool.alloc_request(0)
    pool.begin_extend([0], [0], [30])  # 2 ring pages x 4 streams = 8 pages
    for layer in range(2):
        pool.write_extend(
            layer, torch.randn(30, 2, 8), torch.randn(30, 2, 8), torch.ones(30, 2, dtype=torch.bool)
        )
    before = (pool.num_free_pages(), pool.page_table.clone(), pool.cached_len.copy())
    pool.alloc_request(1)
    with pytest.raises(PoolExhausted, match="need up to 8 pages, 4 free"):
        pool.begin_extend([1], [0], [20])
    assert pool.num_free_pages() == before[0]
    assert torch.equal(pool.page_table, before[1]) and (pool.cached_len == before[2]).all()
    pool.check_integrity()
    pool.free_request(0)
    pool.begin_extend([1], [0], [20])  # now it fits
    pool.free_request(1)
    pool.check_integrity()
    assert pool.num_free_pages() == 12


def test_pool_rejects_inconsistent_calls():
    pool = DualCachePool(
        1,
        1,
        8,
        num_pages=8,
        max_requests=2,
        max_context_len=64,
        config=WGKVConfig(local_window=16),
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="not allocated"):
        pool.begin_extend([0], [0], [4])
    pool.alloc_request(0)
    with pytest.raises(ValueError, match="already allocated"):
        pool.alloc_request(0)
    with pytest.raises(ValueError, match="prefix 3 != cached length 0"):
        pool.begin_extend([0], [3], [4])
    with pytest.raises(ValueError, match="exceed max_context_len"):
        pool.begin_extend([0], [0], [65])
    with pytest.raises(ValueError, match="cached lengths"):
        pool.begin_decode([0], [5])


def test_deferred_gate_check_buffers_count_each_layers_values_once():
    """The deferred check's per-forward buffer (its CUDA mode, driven on the CPU): a gate's values
    written into :meth:`slot` or copied by :meth:`record` are checked once at ``end_forward``; the
    rows padding each layer to 16-byte alignment never count, and a forward of another shape starts
    a new buffer."""
    from sglang_wgkv.gate import GateOutputError
    from sglang_wgkv.gate.admission import DeferredGateCheck

    check = DeferredGateCheck(3, "cpu", deferred=True)
    for layer in range(3):
        g = check.slot(layer, (5, 2))
        assert g.shape == (5, 2) and g.is_contiguous() and g.data_ptr() % 16 == 0
        g.fill_(0.5)
        check.record(g, layer)
    check.end_forward()
    check.poll()  # nothing out of range
    bad = torch.full((7, 2), 0.25)
    bad[6, 1] = float("nan")
    check.record(torch.full((7, 2), 0.5), 0)
    check.record(bad, 2)  # a copy into the new shape's buffer
    check.end_forward()
    with pytest.raises(GateOutputError, match="1 NaN/out-of-range values \\(first in layer 2\\)"):
        check.poll()
