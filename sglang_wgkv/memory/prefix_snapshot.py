"""Prefix snapshots: what a prefix cache keeps of a request so another request can resume from it.

Admission is decided by a token's own keys, so the global cache of a prefix is a function of the
prefix alone and can be shared. A snapshot of slot r at length S holds, per (layer, KV head):

* the global pages, shared by refcount (read-only: appends go past the snapshot's length, and the
  partial last page is copied on restore, so no shared page is ever written);
* a private copy of the ring pages and their admission flags.

Restoring copies the ring (it is overwritten as the request decodes) and the partial last global page,
shares the full global pages, and sets the request's length to S.
"""

import collections
from dataclasses import dataclass

import torch

from sglang_wgkv.memory.host_copy import QueuedCount


@dataclass
class PrefixSnapshot:
    length: int  # S, tokens covered
    rows: torch.Tensor  # [L, H, ring_cols + global_cols] page ids (dump past the used prefix)
    global_len: torch.Tensor  # [L, H]
    ring_flag: torch.Tensor  # [L, H, W]
    # its ring copies (L * H * ring pages): pages nothing else holds, back on the free stack at release
    private_pages: int = 0
    # the pages its rows reference (ring copies and shared global pages), counted on the device and
    # read once landed: what its release returns at most (held_pages)
    held: QueuedCount | None = None

    def held_pages(self, bound: int) -> int:
        """The pages its rows reference, or ``bound`` (an upper bound) while that count is in flight."""
        value = self.held.value() if self.held is not None else None
        return bound if value is None else value

    def pages(self, dump_page: int) -> torch.Tensor:
        return self.rows[self.rows != dump_page]


class SnapshotStore:
    """The live snapshots of one pool (the pool takes, restores and releases their pages); registers
    their pages with the pool's integrity check. ``order()``, if given, runs before each take, restore
    and release (a server's: wait for the forward in flight, :mod:`sglang_wgkv.integration.plugin.overlap`)."""

    def __init__(self, pool, order=None):
        self.pool = pool
        self.order = order or (lambda: None)
        self._live: dict[int, PrefixSnapshot] = {}
        self._counting: collections.deque = collections.deque()  # held counts maybe in flight
        pool.register_ref_holder(self._held_pages)

    def _held_pages(self) -> torch.Tensor:
        if not self._live:
            return torch.empty(0, dtype=torch.int64, device=self.pool.device)
        return torch.cat([s.pages(self.pool.dump_page).long() for s in self._live.values()])

    def __len__(self):
        return len(self._live)

    def take(self, r: int) -> PrefixSnapshot:
        """Snapshot slot ``r`` at its cached length. Raises PoolExhausted if the ring copy does not fit."""
        self.order()
        snap = self.pool.take_snapshot(r)
        self._live[id(snap)] = snap
        if snap.held is not None:  # its pinned count returns to torch's cache once read: read the landed
            self._counting.append(snap.held)
            while self._counting and self._counting[0].value() is not None:  # (they land in order)
                self._counting.popleft()
        return snap

    def restore(self, r: int, snap: PrefixSnapshot) -> None:
        """Make the freshly allocated, empty slot ``r`` continue from ``snap``."""
        if id(snap) not in self._live:
            raise ValueError("snapshot was released")
        self.order()
        self.pool.restore_snapshot(r, snap)

    def release(self, snap: PrefixSnapshot) -> None:
        """Drop the snapshot's references (pages no one else holds return to the free stack)."""
        if self._live.pop(id(snap), None) is None:
            raise ValueError("snapshot already released")
        self.order()
        self.pool.release_snapshot(snap)
