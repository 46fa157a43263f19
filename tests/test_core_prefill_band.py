"""``--wgkv-prefill-band fa3`` in the backend's plan: FA3's window call goes with every forward's
prefill that is not dense, with or without cached prefixes (the window call's math is checked under
the interpreter, ``test_triton_fa3_band_interp.py``); its cu_seqlens are the forward's query indptr
and the layer's key indptr in int32, and on the keys the pool gives, its index window is the position
window."""

from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.attention import reference
from sglang_wgkv.attention.fa3_band import window_safe
from sglang_wgkv.attention.fa3_dense import dense_reference
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.integration.backend.prefill_vertical import served_case
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

    def prefill(*args, band=None, **kwargs):  # the reference attention, the band call and inputs recorded
        seen.append((band, args))
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


def _index_window_is_position_window(q_pos, k_pos, cu_q, cu_k, window) -> bool:
    """For every query: the keys FA3's window takes by index (``window`` up to the one aligned with it)
    are exactly the keys ``0 <= dist < window`` behind it by position."""
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        for i in range(q1 - q0):
            last = k1 - k0 - (q1 - q0) + i  # the key aligned with query i
            dist = q_pos[q0 + i] - k_pos[k0:k1]
            by_index = torch.zeros(k1 - k0, dtype=torch.bool)
            by_index[max(0, last - window + 1) : last + 1] = True
            if not torch.equal(by_index, (dist >= 0) & (dist < window)):
                return False
    return True


def test_window_call_goes_with_every_forward_whose_index_window_is_its_position_window():
    """Prompts, chunks after cached prefixes (global entries and a full ring: S > W), and a forward of
    both: every layer takes the window call with the layer's own key indptr, and on the keys the pool
    gives each of them FA3's index window is the position window."""
    backend, pool, seen = _backend()
    for r in (1, 2, 3):
        pool.alloc_request(r)
    forwards = [([1, 2], [40, 9]), ([1, 2], [30, 5]), ([2, 3], [3, 20])]
    for slots, lens in forwards:
        seen.clear()
        _forward(backend, pool, slots, lens)
        assert len(seen) == L and all(call is not None for call, *_ in seen)
        for lid, ((fn, cu_q, cu_k, most_rows, most_keys), args) in enumerate(seen):
            qo, kv, q_pos, k_pos = args[4], args[5], args[6], args[7]
            assert fn is dense_reference and cu_q.dtype == cu_k.dtype == torch.int32
            assert cu_q.tolist() == qo.tolist() and cu_k.tolist() == kv.tolist() and most_rows == max(lens)
            assert most_keys == int((kv[1:] - kv[:-1]).max()) == backend._longest_keys[lid]
            assert _index_window_is_position_window(q_pos, k_pos, cu_q, cu_k, W)
            # int32 positions (int64 masks cost the kernel ~1.25x), as the start-up compiles use them
            assert (
                q_pos.dtype
                == k_pos.dtype
                == served_case(torch.device("cpu"), torch.float16, (4, 2, 16))[6].dtype
            )
            assert q_pos.dtype == torch.int32
    assert int(pool.cached_len[1]) == 70 > W and int(pool.global_len[1].max()) > 0  # global entries were read


def test_window_safe_is_no_global_entry_or_a_full_ring():
    assert window_safe([0, 0], [3, 0], 16) and window_safe([[32, 0]], [[16, 5]], 16)
    assert not window_safe([32, 0], [15, 5], 16)


def test_dense_forwards_take_the_dense_call_not_the_window():
    """Prompts inside their ring run as one dense call (``fa3_dense``): no window call beside it."""
    backend, pool, seen = _backend(dense_call=dense_reference)
    pool.alloc_request(1)
    _forward(backend, pool, [1], [W])  # S + n <= W_local: dense
    assert backend._dense is not None and backend._band is None and seen == []
