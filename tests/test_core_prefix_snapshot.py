"""Prefix snapshots: a restored request continues exactly like the original; shared pages stay intact."""

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.prefix_snapshot import SnapshotStore
from sglang_wgkv.testing.pool_driver import run_decode, run_extend

pytestmark = pytest.mark.core


# admitting every token, a prefix of W + 32 leaves every stream's last global page full (restore
# shares it) and W + 37 partial (restore copies it)
@pytest.mark.parametrize(
    "prefix,W,p_admit",
    [(10, 16, 0.5), (50, 16, 0.5), (45, 32, 0.5), (100, 16, 0.5), (48, 16, 1.0), (53, 16, 1.0)],
)
def test_restored_request_continues_identically(prefix, W, p_admit):
    torch.manual_seed(prefix)
    L, H, G, D, steps = 2, 2, 2, 16, 30
    T = prefix + steps
    q, k, v = torch.randn(L, T, H * G, D), torch.randn(L, T, H, D), torch.randn(L, T, H, D)
    admit = torch.rand(L, T, H) < p_admit
    pool = DualCachePool(L, H, D, 512, 4, T + 1, WGKVConfig(local_window=W), dtype=torch.float32)
    store = SnapshotStore(pool)

    def decode_from(slot, start):
        outs = []
        for t in range(start, T):
            outs.append(
                run_decode(
                    pool, [slot], [t], q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], admit[:, t : t + 1]
                )
            )
        return torch.cat(outs, 1)

    pool.alloc_request(0)
    run_extend(pool, [0], [0], [prefix], q[:, :prefix], k[:, :prefix], v[:, :prefix], admit[:, :prefix], W)
    snap = store.take(0)
    pool.check_integrity()
    want = decode_from(0, prefix)  # the original request goes on (writes its own pages)
    pool.check_integrity()
    for slot in (1, 2):  # two requests resume from the same snapshot
        pool.alloc_request(slot)
        store.restore(slot, snap)
        pool.check_integrity()
        torch.testing.assert_close(decode_from(slot, prefix), want)
        pool.check_integrity()
    for slot in (0, 1, 2):
        pool.free_request(slot)
    pool.check_integrity()
    store.release(snap)
    pool.check_integrity()
    assert pool.num_free_pages() == 512 and len(store) == 0


def test_snapshot_errors():
    pool = DualCachePool(1, 1, 8, 64, 2, 64, WGKVConfig(local_window=16), dtype=torch.float32)
    store = SnapshotStore(pool)
    pool.alloc_request(0)
    with pytest.raises(ValueError, match="nothing to snapshot"):
        store.take(0)
    run_extend(
        pool,
        [0],
        [0],
        [5],
        torch.randn(1, 5, 1, 8),
        torch.randn(1, 5, 1, 8),
        torch.randn(1, 5, 1, 8),
        torch.ones(1, 5, 1, dtype=torch.bool),
        16,
    )
    snap = store.take(0)
    with pytest.raises(ValueError, match="allocated and empty"):
        store.restore(0, snap)
    store.release(snap)
    with pytest.raises(ValueError, match="already released"):
        store.release(snap)
