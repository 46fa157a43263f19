"""Prefix snapshots: what a prefix cache keeps of a request so another request can resume from it.

Admission is decided by a token's own keys, so the global cache of a prefix is a function of the
prefix alone and can be shared. A snapshot of slot r at length S holds, per (layer, KV head):

* the global pages, shared by refcount (read-only: appends go past the snapshot's length, and the
  partial last page is copied on restore, so no shared page is ever written);
* a private copy of the ring pages and their admission flags.

Restoring copies the ring (it is overwritten as the request decodes) and the partial last global page,
shares the full global pages, and sets the request's length to S.
"""

from dataclasses import dataclass

import torch

from sglang_wgkv.config import PAGE_SIZE


@dataclass
class PrefixSnapshot:
    length: int                # S, tokens covered
    rows: torch.Tensor         # [L, H, ring_cols + global_cols] page ids (dump past the used prefix)
    global_len: torch.Tensor   # [L, H]
    ring_flag: torch.Tensor    # [L, H, W]

    def pages(self, dump_page: int) -> torch.Tensor:
        return self.rows[self.rows != dump_page]


class SnapshotStore:
    """Owns the snapshots of one pool; registers their pages with the pool's integrity check."""

    def __init__(self, pool):
        self.pool = pool
        self._live: dict[int, PrefixSnapshot] = {}
        pool.register_ref_holder(self._held_pages)

    def _held_pages(self) -> torch.Tensor:
        if not self._live:
            return torch.empty(0, dtype=torch.int64, device=self.pool.device)
        return torch.cat([s.pages(self.pool.dump_page).long() for s in self._live.values()])

    def __len__(self):
        return len(self._live)

    def take(self, r: int) -> PrefixSnapshot:
        """Snapshot slot ``r`` at its cached length. Raises PoolExhausted if the ring copy does not fit."""
        pool = self.pool
        S = int(pool.cached_len[r])
        if not pool.active[r] or S == 0:
            raise ValueError(f"request slot {r} has nothing to snapshot")
        ring_used = -(-min(S, pool.window) // PAGE_SIZE)
        L, H = pool.num_layers, pool.num_kv_heads
        copies = pool.allocator.alloc(L * H * ring_used).view(L, H, ring_used)
        src = pool.page_table[r, :, :, :ring_used].long()
        pool.k_pages[copies] = pool.k_pages[src]
        pool.v_pages[copies] = pool.v_pages[src]
        rows = pool.page_table[r].clone()
        rows[:, :, :ring_used] = copies.to(rows.dtype)
        glob = rows[:, :, pool.ring_cols:pool.dump_col]
        pool.allocator.incref(glob[glob != pool.dump_page])
        snap = PrefixSnapshot(S, rows[:, :, : pool.dump_col], pool.global_len[r].clone(), pool.ring_flag[r].clone())
        self._live[id(snap)] = snap
        return snap

    def restore(self, r: int, snap: PrefixSnapshot) -> None:
        """Make the freshly allocated, empty slot ``r`` continue from ``snap``."""
        pool = self.pool
        if id(snap) not in self._live:
            raise ValueError("snapshot was released")
        if not pool.active[r] or pool.cached_len[r] != 0:
            raise ValueError(f"request slot {r} must be allocated and empty to restore a prefix")
        L, H, R = pool.num_layers, pool.num_kv_heads, pool.ring_cols
        ring_used = -(-min(snap.length, pool.window) // PAGE_SIZE)
        glen = snap.global_len.long()
        partial = (glen % PAGE_SIZE) != 0                                   # [L, H]
        n_partial = int(partial.sum())
        pool.allocator.ensure(L * H * ring_used + n_partial)
        rows = snap.rows.clone()
        ring = pool.allocator.alloc(L * H * ring_used).view(L, H, ring_used)
        pool.k_pages[ring] = pool.k_pages[snap.rows[:, :, :ring_used].long()]
        pool.v_pages[ring] = pool.v_pages[snap.rows[:, :, :ring_used].long()]
        rows[:, :, :ring_used] = ring.to(rows.dtype)
        # the partial last global page is copied (this request will append into it)
        last_col = R + (glen - 1).clamp(min=0) // PAGE_SIZE                 # [L, H]
        if n_partial:
            fresh = pool.allocator.alloc(n_partial)
            li, hi = torch.nonzero(partial, as_tuple=True)
            old = snap.rows[li, hi, last_col[li, hi]].long()
            pool.k_pages[fresh] = pool.k_pages[old]
            pool.v_pages[fresh] = pool.v_pages[old]
            rows[li, hi, last_col[li, hi]] = fresh.to(rows.dtype)
        shared = snap.rows[:, :, R:].clone()
        if n_partial:
            shared[li, hi, last_col[li, hi] - R] = pool.dump_page
        pool.allocator.incref(shared[shared != pool.dump_page])
        pool.page_table[r, :, :, : pool.dump_col] = rows
        pool.global_len[r] = snap.global_len.to(pool.global_len.dtype)
        pool.ring_flag[r] = snap.ring_flag
        pool.cached_len[r] = snap.length

    def release(self, snap: PrefixSnapshot) -> int:
        """Drop the snapshot's references; returns pages returned to the free stack."""
        if self._live.pop(id(snap), None) is None:
            raise ValueError("snapshot already released")
        return self.pool.allocator.free(snap.pages(self.pool.dump_page))
