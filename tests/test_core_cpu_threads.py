"""The torch decode layer on the CPU runs on one thread while its step reads few KV tokens
(``CPU_ONE_THREAD_KV_TOKENS``), on torch's threads past that; the thread count is restored after each
layer, also when it raises, and the outputs do not depend on it."""

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.integration.backend import decode_layer
from sglang_wgkv.integration.backend.decode_layer import torch_threads
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.backend_harness import bare_backend, layer_of, run_decode, run_extend

pytestmark = pytest.mark.core

L, H, HQ, D, W = 2, 2, 4, 16, 16
SLOTS, LENS = [1, 2], [40, 25]


def _decode(limit: int, monkeypatch) -> tuple[list[torch.Tensor], list[int | None]]:
    """Two decode steps after a prefill; the outputs and the threads each layer ran on."""
    monkeypatch.setattr(decode_layer, "CPU_ONE_THREAD_KV_TOKENS", limit)
    pool = DualCachePool(L, H, D, 200, 4, 128, WGKVConfig(local_window=W, tau=0.5))
    gates = WriteGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=2 * D)).eval()
    gates.requires_grad_(False)
    backend = bare_backend(pool, gates, use_kernels=False, slot_tau=torch.full((4,), 0.5), num_q_heads=HQ)
    for r in SLOTS:
        pool.alloc_request(r)
    gen = torch.Generator().manual_seed(0)

    def rows(n):
        return [torch.randn(n, c * D, generator=gen) for c in (HQ, H, H)]

    layers = [layer_of(i, HQ, H, D) for i in range(L)]
    run_extend(backend, layers, SLOTS, [0, 0], LENS, rows)
    threads = []
    for i in range(L):  # each layer's gate notes the threads it runs on
        gate = backend.gates.layers[i].forward
        monkeypatch.setattr(
            backend.gates.layers[i],
            "forward",
            lambda *a, g=gate: threads.append(torch.get_num_threads()) or g(*a),
        )
    outs = []
    for step in range(2):
        outs += run_decode(backend, layers, SLOTS, [n + 1 + step for n in LENS], rows)
    return outs, threads


def test_few_kv_tokens_decode_on_one_thread_with_the_same_outputs(monkeypatch):
    torch.set_num_threads(2)
    kv_tokens = H * sum(LENS)  # what the first step's rows hold
    one, one_threads = _decode(kv_tokens + 2 * H, monkeypatch)
    many, many_threads = _decode(kv_tokens - 1, monkeypatch)
    assert set(one_threads) == {1} and set(many_threads) == {2}
    assert torch.get_num_threads() == 2
    for a, b in zip(one, many):
        torch.testing.assert_close(a, b)


def test_thread_count_is_restored_when_the_layer_raises():
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == 2
    with torch_threads(None):
        assert torch.get_num_threads() == 2
