"""The page allocator's free: references dropped per entry, each page back on the free stack once,
a drop below zero counted (never a page on the stack twice) and reported by the integrity check; the
host's floor of free pages a lower bound however it is raised (frees that surely return pages, counts
queued without waiting)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_wgkv.memory.page_allocator import PageAllocator

pytestmark = pytest.mark.core


def _held(alloc: PageAllocator) -> torch.Tensor:
    """Every page id with its reference count, as an owner list for ``check_integrity``."""
    ids = torch.arange(alloc.num_pages + 1)
    return torch.repeat_interleave(ids, alloc.ref.long().clamp(min=0))


def test_free_returns_each_page_once_and_keeps_shared_ones():
    alloc = PageAllocator(8)
    pages = alloc.alloc(5)  # pages 0..4
    alloc.incref(pages[:2])  # 0 and 1 shared by a second owner
    alloc.free(torch.tensor([[4, 3], [3, 8], [0, 8]]))  # 3 twice (held once: over-freed), dump page 8
    assert int(alloc.num_free) == 3 + 2 and int(alloc.over_freed) == 1
    assert alloc.ref[:5].tolist() == [1, 2, 1, 0, 0]
    free = alloc.free_stack[: int(alloc.num_free)].tolist()
    assert sorted(free) == [3, 4, 5, 6, 7] and len(set(free)) == len(free)
    with pytest.raises(RuntimeError, match="freed more often than referenced"):
        alloc.check_integrity(_held(alloc))
    assert int(alloc.free_stack[alloc.num_pages]) == alloc.dump_page  # the scratch slot


def test_freeing_a_free_page_never_puts_it_on_the_stack_twice():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    alloc.free(pages[:1])  # already free
    free = alloc.free_stack[: int(alloc.num_free)].tolist()
    assert int(alloc.num_free) == 4 and sorted(free) == [0, 1, 2, 3]
    assert int(alloc.over_freed) == 1 and int(alloc.ref.min()) == 0


def test_free_of_nothing_and_of_dump_entries_changes_nothing():
    alloc = PageAllocator(4)
    alloc.alloc(1)
    alloc.free(torch.zeros(0, dtype=torch.long))
    alloc.free(torch.full((3,), alloc.dump_page))
    assert int(alloc.num_free) == 3 and int(alloc.over_freed) == 0
    alloc.check_integrity(_held(alloc))


def test_a_free_raises_the_floor_by_the_pages_it_surely_returns():
    alloc = PageAllocator(8)
    pages = alloc.alloc(5)
    assert alloc.free_floor == 3
    alloc.free(pages[:2], returned=2)
    assert alloc.free_floor == 5 == int(alloc.num_free)


def test_a_queued_count_raises_the_floor_less_what_was_lowered_since():
    """The count is the free pages when queued (on CPU at once, on CUDA behind the queued work); an
    allocation launched after it lowers the floor and is subtracted from it; a free after it is not
    in it (the bound stays below the device's count)."""
    alloc = PageAllocator(16)
    pages = alloc.alloc(6)
    alloc.free(pages)  # 16 free, the floor still at 10
    alloc.queue_refresh()
    more = alloc.alloc_where(torch.ones(4, dtype=torch.bool))  # lowered by 4 after the count
    assert alloc.free_floor == 6
    alloc.free(more)  # not in the count, not raising the floor
    assert alloc.can_allocate(12) and alloc.free_floor == 16 - 4  # no sync was needed for 12
    assert alloc.checks_synced == 0
    assert alloc.can_allocate(14) and alloc.checks_synced == 1  # above the floor: an exact count
    alloc.queue_refresh()
    alloc.take_queued()
    assert alloc.free_floor == 16 == int(alloc.num_free)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("afqs"), st.integers(0, 6)), max_size=40))
def test_the_floor_never_exceeds_the_free_pages(ops):
    """Any interleaving of allocations, frees (with the pages they surely return), queued counts and
    exact counts keeps ``free_floor`` a lower bound of the free pages."""
    alloc = PageAllocator(24)
    held = []
    for op, n in ops:
        if op == "a" and alloc.can_allocate(n):
            held.append(alloc.alloc_where(torch.ones(n, dtype=torch.bool)))
        elif op == "f" and held:
            pages = held.pop(n % len(held))
            alloc.free(pages, returned=int(pages.numel()) if n % 2 else 0)
        elif op == "q":
            alloc.queue_refresh()
        elif op == "s":
            alloc.take_queued()
        assert alloc.free_floor <= int(alloc.num_free)
