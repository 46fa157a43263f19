"""The vertical-slash prefill with FA3 running its local window, on CPU under the Triton interpreter (in
a subprocess: ``TRITON_INTERPRET=1`` must be set before Triton is imported), the torch statement of
the FA3 call in FA3's place: output against the torch reference attention on batches in the pool's
layout, with and without cached prefixes. On a Hopper host the real FA3 call is tested by
tests/test_gpu_attention.py."""

import os

import pytest

from sglang_wgkv.testing.interp import InterpCheck, assert_seed_ok, cpu_only

CPU_ONLY = cpu_only()
pytestmark = [pytest.mark.core, CPU_ONLY]

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_fa3_band_interp_check.py")
SEEDS = range(12)  # 0-3: the prefix-free PREFILL_CASES; 4-11: drawn batches (odd: after cached prefixes)
RUN = InterpCheck(CHECK, (*map(str, SEEDS), "choice", "unsafe"))


@pytest.fixture(scope="module")
def run(interp_runner):
    return interp_runner.result(RUN)


@pytest.mark.parametrize("seed", SEEDS)
def test_fa3_band_prefill_matches_reference_under_interpreter(run, seed):
    assert_seed_ok(run, seed)


def test_startup_choice_under_interpreter(run):
    """``--wgkv-prefill-band``'s start-up choice: ``triton`` takes no call; ``fa3`` takes a correct FA3
    (the torch statement) and refuses to start with one whose outputs are 10% off."""
    assert_seed_ok(run, "choice")


def test_window_call_refused_where_its_index_window_is_not_the_position_window(run):
    """Global entries before a short ring: ``window_safe`` refuses the layout, and the window call on it
    would differ from the reference (so the check is the condition, not a formality)."""
    assert_seed_ok(run, "unsafe")
