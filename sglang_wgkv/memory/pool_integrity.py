"""The dual-cache pool's integrity check: every page owned once, page-table rows that agree with the
lengths, no global cache longer than what left its ring."""

import torch

from sglang_wgkv.config import PAGE_SIZE

# Page-table entries the integrity check handles at once (bounds its temporaries: ~16 MB of int32).
INTEGRITY_CHUNK_ENTRIES = 1 << 22


class PoolIntegrityError(RuntimeError):
    pass


class PoolIntegrity:
    """:meth:`check_integrity` of :class:`~sglang_wgkv.memory.dual_pool.DualCachePool` (a mixin: the
    pool owns the page table, lengths, allocator and reference holders)."""

    def _row_chunks(self):
        """``(first slot, page-table rows [slots, L, H, dump_col])`` views, a bounded number of entries
        at a time: the integrity check then needs temporaries of one chunk, not of the whole table
        (the table of a default CPU server is hundreds of MB; whole-table temporaries cost GBs)."""
        per_slot = self.num_layers * self.num_kv_heads * (self.dump_col + 1)
        step = max(1, INTEGRITY_CHUNK_ENTRIES // per_slot)
        for first in range(0, self.max_requests, step):
            yield first, self.page_table[first : first + step, ..., : self.dump_col]

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError on a leaked, doubly owned or misplaced page, or a bad length.
        Temporaries are bounded by :data:`INTEGRITY_CHUNK_ENTRIES` page-table entries (plus the
        pages in use)."""
        W, R = self.window, self.ring_cols
        held = [rows[rows != self.dump_page] for _, rows in self._row_chunks()]
        held += [fn().reshape(-1).to(self.device) for fn in self._ref_holders]
        try:
            self.allocator.check_integrity(torch.cat(held))
        except RuntimeError as e:
            raise PoolIntegrityError(str(e)) from e
        if bool((self.page_table[..., self.dump_col] != self.dump_page).any()):
            raise PoolIntegrityError("a dump column holds a real page")
        n = torch.as_tensor(self.cached_len, device=self.device)
        col = torch.arange(self.dump_col, device=self.device)
        for first, rows in self._row_chunks():
            last = first + rows.shape[0]
            ring_pages = (torch.clamp(n[first:last], max=W) + PAGE_SIZE - 1) // PAGE_SIZE  # [S]
            gpages = (self.global_len[first:last].long() + PAGE_SIZE - 1) // PAGE_SIZE  # [S, L, H]
            expect = (col < ring_pages[:, None, None, None]) | ((col >= R) & (col < R + gpages[..., None]))
            has = rows != self.dump_page
            if not torch.equal(expect, has):
                bad = torch.nonzero(expect != has)[0].tolist()
                bad[0] += first
                raise PoolIntegrityError(
                    f"page table row (slot, layer, head, col) {bad} disagrees with lengths"
                )
        if bool((self.global_len.long() > torch.clamp(n - W, min=0)[:, None, None]).any()):
            raise PoolIntegrityError("a global cache is longer than the tokens that left its ring")
        inactive = torch.as_tensor(~self.active, device=self.device)
        if bool((self.global_len[inactive] != 0).any()):
            raise PoolIntegrityError("a free request slot has a global length")
