"""Device-side page allocator: a free stack plus refcounts, allocation without host syncs.

Page ids are ``0 .. num_pages-1``; id ``num_pages`` is the *dump page*: a scratch page that masked-off
writes are sent to so that every scatter has a fixed shape (no boolean indexing, no host sync). It is
never handed out and never counted.

Host syncs: neither :meth:`alloc_where` (the decode path) nor :meth:`free` (a request's end, an
eviction) syncs. The host keeps ``free_floor``, a lower bound on the free pages; :meth:`ensure` syncs
only when that bound cannot cover the next step's worst case. A page freed more often than it is
referenced is counted on the device and reported by :meth:`check_integrity`.

=====================================  =========================================================
``free_floor`` ...                     when
=====================================  =========================================================
set to the exact count                 :meth:`sync_free` (one host sync)
lowered by an allocation's worst case  at its launch (``alloc_where``; a replayed graph's caller)
raised by the pages a free surely      at its launch: ``free(pages, returned=n)``, ``n`` pages the
returns                                caller knows nothing else holds (a snapshot's ring copies)
raised to a queued count's value       :meth:`queue_refresh` copied ``num_free`` without waiting;
less the lowering launched since       once the copy has landed, the next check takes it (a
                                       server queues one behind each forward: the bound then
                                       lags the device by about a forward, never a sync)
=====================================  =========================================================

``expected_free`` adds to the floor what frees launched since the last landed count are expected to
return beyond their sure pages (``free(pages, expected=n)``: pages that return unless something else
holds them too): a guess, for deciding how much more to free, never for allocating. A count queued
after such a free includes it, so the expectation goes once a later count has landed.

==================  ==============================================================================
free_stack slot     holds
==================  ==============================================================================
``0 .. num_free-1``  the free pages (the top is the end)
``num_pages``       scratch: a free's entries that return no page write the dump page id there
==================  ==============================================================================
"""

import torch

from sglang_wgkv.memory.host_copy import QueuedCount


class PoolExhausted(RuntimeError):
    """Not enough free pages for a step's worst case. Raised before anything is modified."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"KV page pool exhausted: need up to {needed} pages, {free} free")
        self.needed, self.free = needed, free


class PageAllocator:
    def __init__(self, num_pages: int, device: torch.device | str = "cpu", reclaimer=None):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.dump_page = num_pages
        self.device = torch.device(device)
        # Stack top is the end; popping from the top hands out low ids first.
        self.free_stack = torch.full((num_pages + 1,), num_pages, dtype=torch.int64, device=self.device)
        self.free_stack[:num_pages] = torch.arange(num_pages - 1, -1, -1, device=self.device)
        self.over_freed = torch.zeros((), dtype=torch.int64, device=self.device)
        self.num_free = torch.tensor(num_pages, dtype=torch.int64, device=self.device)
        self.ref = torch.zeros(num_pages + 1, dtype=torch.int32, device=self.device)
        self._floor = num_pages
        self._lowered = 0  # every lowering of the floor so far (what a queued count has not seen)
        self._queued = None  # (QueuedCount of num_free, _lowered when queued, counts queued before it)
        self._counts = 0  # counts queued so far
        self._count = None  # the QueuedCount they reuse
        self._expected: list[tuple[int, int]] = []  # (counts queued before the free, pages expected)
        # Optional ``fn(worst_case)`` that releases pages it can spare (a prefix cache dropping
        # snapshots) before :meth:`ensure` gives up; it must not allocate.
        self.reclaimer = reclaimer
        # checks the floor could not cover, each an exact count (a host sync: under the overlap
        # scheduler a wait for the forward in flight); served in /server_info's wgkv stats
        self.checks_synced = 0

    # -- capacity -------------------------------------------------------------------------------
    @property
    def free_floor(self) -> int:
        """A lower bound on the free pages, for any allocation launched from now on (table above)."""
        return self._floor

    @free_floor.setter
    def free_floor(self, value: int) -> None:
        # callers lower it (``-=``) for the allocations they launch; a queued count subtracts these
        self._lowered += max(0, self._floor - value)
        self._floor = value

    @property
    def expected_free(self) -> int:
        """``free_floor`` and what frees not yet counted are expected to return (table above)."""
        return self._floor + sum(n for _, n in self._expected)

    def sync_free(self) -> int:
        """Exact free page count (one host sync); refreshes ``free_floor``."""
        self._floor = int(self.num_free.item())
        self._expected.clear()  # the count includes every free launched so far
        return self._floor

    def queue_refresh(self) -> None:
        """Copy the free count to the host behind the work queued on the current stream, without
        waiting; :meth:`can_allocate` raises the floor to it once it has landed. Call it where the
        current stream follows every allocation launched so far (after a forward's launch on its
        stream). A copy still in flight is kept (one at a time)."""
        self.take_queued()
        if self._queued is None:
            if self._count is None:
                self._count = QueuedCount(self.num_free, reuse=True)
            else:  # the last one has landed (taken above): its buffer is reused
                self._count.queue(self.num_free)
            self._queued = (self._count, self._lowered, self._counts)
            self._counts += 1

    def take_queued(self) -> None:
        """A landed queued count, less what was lowered since it was queued, raises the floor."""
        if self._queued is None:
            return
        count, lowered, before = self._queued
        value = count.value()
        if value is None:
            return
        self._queued = None
        self._floor = max(self._floor, value - (self._lowered - lowered))
        self._expected = [(at, n) for at, n in self._expected if at > before]  # the count has the rest

    def can_allocate(self, worst_case: int) -> bool:
        self.take_queued()
        if worst_case <= self._floor:
            return True
        self.checks_synced += 1
        return worst_case <= self.sync_free()

    def fits(self, worst_case: int) -> bool:
        """Whether ``worst_case`` pages can be handed out, after the reclaimer (if any) released what
        it could; syncs only when ``free_floor`` is too low."""
        if not self.can_allocate(worst_case) and self.reclaimer is not None:
            self.reclaimer(worst_case)
        return self.can_allocate(worst_case)

    def ensure(self, worst_case: int) -> None:
        """Raise :class:`PoolExhausted` unless :meth:`fits` ``worst_case``."""
        if not self.fits(worst_case):
            raise PoolExhausted(worst_case, self.free_floor)

    # -- allocation -----------------------------------------------------------------------------
    def alloc_where(self, need: torch.Tensor) -> torch.Tensor:
        """One fresh page for every True in ``need`` (any shape), the dump page elsewhere.

        No host sync. The caller must have called :meth:`ensure` for ``need.numel()`` pages.
        """
        flat = need.reshape(-1)
        rank = torch.cumsum(flat.to(torch.int64), 0) - 1
        idx = (self.num_free - 1 - rank).clamp(min=0)
        pages = torch.where(flat, self.free_stack[idx], self.dump_page)
        self.num_free -= flat.sum()
        self.ref.index_fill_(0, pages, 1)
        self.ref.narrow(0, self.dump_page, 1).zero_()  # not `ref[i] = 0`: a host scalar copy syncs
        self.free_floor -= flat.numel()
        return pages.view(need.shape)

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` fresh pages (host-known count): int64 ``[n]``. Raises PoolExhausted."""
        self.ensure(n)
        return self.alloc_where(torch.ones(n, dtype=torch.bool, device=self.device))

    def incref(self, pages: torch.Tensor) -> None:
        """Add one reference to each page in ``pages`` (duplicates count twice; dump page entries
        ignored)."""
        srt = torch.sort(pages.reshape(-1).long()).values
        if srt.numel() == 0:
            return
        self.ref[srt] = self.ref[srt] + _run_lengths(srt).to(self.ref.dtype)
        self.ref.narrow(0, self.dump_page, 1).zero_()  # not `ref[i] = 0`: a host scalar copy syncs

    def free(self, pages: torch.Tensor, returned: int = 0, expected: int = 0) -> None:
        """Drop one reference from each page (duplicates count twice; dump entries ignored); pages
        whose count reaches zero return to the free stack. No host sync: the entries are sorted so a
        page's duplicates sit together, its first entry returns it; a drop below zero is counted in
        ``over_freed`` (the page returns only if it was held) and the count clamped at zero.
        ``returned``: how many of ``pages`` the caller knows return (held by nothing else): the floor
        rises by that many at once; ``expected``: how many more it expects to return
        (``expected_free``)."""
        srt = torch.sort(pages.reshape(-1).long()).values
        self._floor += returned
        if expected:
            self._expected.append((self._counts, expected))
        if srt.numel() == 0:
            return
        live = srt != self.dump_page
        first = torch.ones_like(live)
        first[1:] = srt[1:] != srt[:-1]
        before = self.ref[srt]
        after = before - (_run_lengths(srt) * live).to(before.dtype)
        self.over_freed += (first & live & (after < 0)).sum()
        self.ref[srt] = after.clamp(min=0)
        self.ref.narrow(0, self.dump_page, 1).zero_()  # not `ref[i] = 0`: a host scalar copy syncs
        back = first & live & (after <= 0) & (before > 0)
        rank = torch.cumsum(back.to(torch.int64), 0) - 1
        dest = torch.where(back, self.num_free + rank, self.num_pages)
        self.free_stack[dest] = torch.where(back, srt, self.dump_page)
        self.num_free += back.sum()

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self, referenced: torch.Tensor) -> None:
        """``referenced``: every page id held by an owner (with repeats for shared pages).
        Raises RuntimeError on a leak, a double free or a refcount that does not match."""
        if int(self.over_freed):
            raise RuntimeError(
                f"page allocator: {int(self.over_freed)} pages freed more often than referenced"
            )
        n_free = int(self.num_free.item())
        free = self.free_stack[:n_free]
        if n_free and torch.unique(free).numel() != n_free:
            raise RuntimeError("page allocator: a page is on the free stack twice")
        if n_free and bool((self.ref[free] != 0).any()):
            raise RuntimeError("page allocator: a free page has a nonzero refcount")
        refs = referenced.reshape(-1).long()
        refs = refs[refs != self.dump_page]
        counts = torch.bincount(refs, minlength=self.num_pages + 1).to(torch.int32)
        counts[self.dump_page] = 0
        if not torch.equal(counts, self.ref):
            bad = torch.nonzero(counts != self.ref).flatten()[:8].tolist()
            raise RuntimeError(f"page allocator: refcounts disagree with owners at pages {bad}")
        in_use = int((self.ref[: self.num_pages] > 0).sum())
        if in_use + n_free != self.num_pages:
            raise RuntimeError(f"page allocator: leak: {in_use} in use + {n_free} free != {self.num_pages}")


def _run_lengths(srt: torch.Tensor) -> torch.Tensor:
    """How often each entry's value occurs in the sorted ``srt`` (per entry). Counting through
    ``index_add_`` instead piles a request's many dump-page entries onto one counter: serialized
    atomics, ~85 us a request's end at 8K-token rows (the M1D profile,
    ``launch/results/served_speed/M1D_M1P_h100_knee4``). Every entry of a run then writes the same
    count, so an index write of them is exact."""
    return torch.searchsorted(srt, srt, right=True) - torch.searchsorted(srt, srt)
