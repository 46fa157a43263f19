"""UsageLedger: a freed slot's usage counts as of the launch after the forward whose results are
handled (the overlap scheduler's order), and the slot itself when no forward is in flight."""

import numpy as np
import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.requests.usage_ledger import SlotCounts, UsageLedger, read_counts
from sglang_wgkv.memory import DualCachePool

pytestmark = pytest.mark.core


class Counters:
    """The evictor's host counters (request_counters), one row per slot."""

    def __init__(self, slots):
        self.arrays = tuple(np.zeros(slots, dtype=np.int64) for _ in range(3))

    def request_counters(self):
        return self.arrays


def _pool():
    dual = DualCachePool(2, 3, 8, 64, 4, 128, WGKVConfig(local_window=16), dtype=torch.float32)
    for r in range(4):
        dual.alloc_request(r)
    return dual


def _set(dual, evictor, slot, glen, cached, counters):
    dual.global_len[slot] = torch.tensor(glen, dtype=torch.int32)
    dual.cached_len[slot] = cached
    for array, value in zip(evictor.arrays, counters):
        array[slot] = value


def test_counts_as_of_the_launch_while_a_forward_is_in_flight():
    dual, evictor, ledger = _pool(), Counters(4), UsageLedger()
    _set(dual, evictor, 1, [[5, 7, 0], [2, 1, 1]], 40, (1, 3, 0))
    before = read_counts(dual, 1, evictor)
    assert before == SlotCounts(kept=16, max_global=7, cached=40, triggers=1, evicted=3, early=0)

    ledger.record(dual, evictor, None, None)  # forward k + 1 launched while k's results wait
    _set(dual, evictor, 1, [[6, 7, 0], [2, 1, 1]], 41, (2, 4, 0))  # what forward k + 1 moves
    assert ledger.in_flight() and ledger.counts_for_free(dual, 1, evictor) == before
    ledger.processed += 1  # forward k + 1's results: nothing in flight, the slot itself
    after = ledger.counts_for_free(dual, 1, evictor)
    assert after == SlotCounts(kept=17, max_global=7, cached=41, triggers=2, evicted=4, early=0)


def test_no_forward_in_flight_reads_the_slot():
    dual, evictor, ledger = _pool(), Counters(4), UsageLedger()
    ledger.record(dual, evictor, None, None)
    ledger.processed = 1  # that launch's results processed: nothing in flight
    _set(dual, evictor, 2, [[3, 0, 0], [0, 0, 9]], 30, (0, 0, 1))
    assert ledger.counts_for_free(dual, 2, evictor) == read_counts(dual, 2, evictor)
    assert read_counts(dual, 2, None) == SlotCounts(12, 9, 30, 0, 0, 0)


def test_a_slot_owned_anew_since_the_launch_reads_itself():
    """A request given the slot after the launch (and freed before any forward ran it) is not
    reported with the counts of the slot's previous owner."""
    dual, evictor, ledger = _pool(), Counters(4), UsageLedger()
    _set(dual, evictor, 3, [[8, 8, 8], [8, 8, 8]], 90, (1, 1, 0))
    ledger.record(dual, evictor, None, None)
    dual.free_request(3)
    dual.alloc_request(3)
    for array in evictor.arrays:
        array[3] = 0
    assert ledger.in_flight()
    assert ledger.counts_for_free(dual, 3, evictor) == SlotCounts(0, 0, 0, 0, 0, 0)


def test_without_an_evictor_the_eviction_counts_are_zero():
    dual, ledger = _pool(), UsageLedger()
    dual.global_len[0] = 4
    ledger.record(dual, None, None, None)
    assert ledger.counts(0) == SlotCounts(4 * 6, 4, 0, 0, 0, 0)
