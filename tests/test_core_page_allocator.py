"""The page allocator's free: references dropped per entry, each page back on the free stack once,
a drop below zero counted (never a page on the stack twice) and reported by the integrity check."""

import pytest
import torch

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
