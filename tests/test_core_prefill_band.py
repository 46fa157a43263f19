"""``--wgkv-prefill-band fa3`` in the backend's plan: FA3's window call goes with a forward's prefill
only when none of its requests has a cached prefix and the forward is not dense (the window call's
math is checked under the interpreter, ``test_triton_fa3_band_interp.py``); its cu_seqlens are the
forward's query indptr in int32 and its longest sequence the longest chunk."""

from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.attention import reference
from sglang_wgkv.attention.fa3_dense import dense_reference
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.integration.requests.control import RequestAdmission
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.backend_harness import bare_backend, extend_batch, layer_of

pytestmark = pytest.mark.core

L, H, HQ, D, W = 2, 2, 4, 16, 16


def _backend(dense_call=None):
    pool = DualCachePool(L, H, D, 300, 4, 256, WGKVConfig(local_window=W, tau=0.5))
    gates = WriteGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=2 * D)).eval()
    gates.requires_grad_(False)
    tau = torch.full((4,), 0.5)
    backend = bare_backend(pool, gates, use_kernels=False, slot_tau=tau, num_q_heads=HQ)
    backend.req_pool = SimpleNamespace(
        slot_tau=tau, slot_admission=[RequestAdmission(admission=True)] * 4, slot_dense=[False] * 4
    )
    backend._band_fn = dense_reference
    backend._fa3_dense = dense_call
    seen = []

    def prefill(*args, band=None, **kwargs):  # the reference attention, the band argument recorded
        seen.append(band)
        return reference.vertical_slash_attention(*args, **kwargs)

    backend._prefill = prefill
    return backend, pool, seen


def _forward(backend, pool, slots, lens):
    prefix = [int(pool.cached_len[r]) for r in slots]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
    fb = extend_batch("extend", slots, prefix, lens, positions)
    backend.batch_slots = list(slots)
    backend.init_forward_metadata(fb)
    gen = torch.Generator().manual_seed(0)
    for i in range(L):
        q, k, v = (torch.randn(sum(lens), c * D, generator=gen) for c in (HQ, H, H))
        backend.forward_extend(q, k, v, layer_of(i, HQ, H, D), fb)


def test_window_call_goes_with_prefix_free_forwards_only():
    backend, pool, seen = _backend()
    for r in (1, 2):
        pool.alloc_request(r)
    _forward(backend, pool, [1, 2], [40, 9])  # no prefix: every layer takes the window call
    assert len(seen) == L and all(b is not None for b in seen)
    fn, cu, longest = seen[0]
    assert fn is dense_reference and cu.dtype == torch.int32 and cu.tolist() == [0, 40, 49] and longest == 40
    seen.clear()
    _forward(backend, pool, [1, 2], [30, 5])  # a chunk after a cached prefix: the band launch alone
    assert seen == [None] * L
    pool.alloc_request(3)
    seen.clear()
    _forward(backend, pool, [2, 3], [3, 20])  # one request with a prefix is enough to keep it off
    assert seen == [None] * L


def test_dense_forwards_take_the_dense_call_not_the_window():
    """Prompts inside their ring run as one dense call (``fa3_dense``): no window call beside it."""
    backend, pool, seen = _backend(dense_call=dense_reference)
    pool.alloc_request(1)
    _forward(backend, pool, [1], [W])  # S + n <= W_local: dense
    assert backend._dense is not None and backend._band is None and seen == []
