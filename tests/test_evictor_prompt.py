"""Prompt-end scoring: a prompt declared with ``mark_extend`` keeps its admitted part through chunked
prefill, is compressed to exactly the budget by its own last queries once it ends (the lowest-scored
entries leave, order kept), is compressed early past ``prompt_cap``, and decodes under the usual
bottom-10% rule afterwards. A needle that only the prompt's end attends to survives this way and is
lost when each chunk is scored by its own queries (the behaviour before prompt-end scoring)."""

import logging

import pytest
import torch
from test_evictor_run import G, H, L, Run

from sglang_wgkv.config import DEFAULT_PROMPT_KERNEL
from sglang_wgkv.memory import SnapKVEvictor

pytestmark = pytest.mark.evictor


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _globals(run, slot):
    return [[run.pool_global(slot, layer, h) for h in range(H)] for layer in range(L)]


def _chunked_prompt(run, slot, chunks):
    """Prefill ``chunks`` tokens by chunk, declaring each; maybe_evict at every step boundary.
    Returns the number of streams evicted from at each boundary."""
    evicted = []
    for i, n in enumerate(chunks):
        run.extend({slot: n})
        run.ev.mark_extend([slot], [i == len(chunks) - 1])
        if i < len(chunks) - 1:
            evicted.append(run.ev.maybe_evict())
    return evicted


@pytest.mark.parametrize("prompt_window", [None, 4])
def test_prompt_is_kept_while_prefilled_then_compressed_to_budget_by_its_end(prompt_window):
    """By default the prompt window is the whole (16-query) decode window here; with 4, only the
    prompt's last 4 queries score it (the decode window stays 16)."""
    budget = 24
    run = Run(
        W=16, window=16, budget=budget, pages=600, slots=2, maxlen=300, seed=21, prompt_window=prompt_window
    )
    assert run.ev.prompt_window == (prompt_window or 16) and run.ev.prompt_kernel == DEFAULT_PROMPT_KERNEL
    run.new(1, 1.0)
    # the last chunk is shorter than the window: the window spans two chunks
    assert _chunked_prompt(run, 1, [60, 80, 10]) == [0, 0]  # nothing evicted inside the prompt
    req = run.reqs[1]
    assert int(run.pool.global_len[1].min()) == 150 - 16  # the whole prompt's global part
    expected = {
        (layer, h): run.naive_stream_scores(req, layer, h, prompt=True)
        for layer in range(L)
        for h in range(H)
    }
    before = _globals(run, 1)
    assert run.ev.maybe_evict() == L * H  # the prompt's end: every stream
    after = _globals(run, 1)
    for layer in range(L):
        for h in range(H):
            kept = set(after[layer][h])
            assert len(kept) == budget  # exactly the budget, not 10% steps
            assert after[layer][h] == [p for p in before[layer][h] if p in kept]
            scores = expected[layer, h]
            gone = [sc for p, sc in zip(before[layer][h], scores) if p not in kept]
            stay = [sc for p, sc in zip(before[layer][h], scores) if p in kept]
            assert max(gone) <= min(stay) + 1e-6
            req.glob[layer][h] = after[layer][h]
    assert run.ev.triggers[1] == 1 and run.ev.early_compressions[1] == 0
    for _ in range(30):  # decode: the bottom-10% rule as before
        run.decode([1])
        run.check_matches_model()
        run.evict_and_check()
    assert run.ev.triggers[1] > 1
    run.new(0, 1.0)  # 25 global entries: the bottom-10% rule would keep 23
    _chunked_prompt(run, 0, [41])
    run.ev.maybe_evict()
    assert (run.pool.global_len[0] == budget).all()
    run.pool.check_integrity()


def test_prompt_cap_compresses_early_and_logs_once(caplog):
    run = Run(W=16, window=16, budget=24, pages=600, slots=2, maxlen=300, seed=23)
    run.ev = SnapKVEvictor(run.pool, budget=24, num_q_heads=H * G, window=16, prompt_cap=48)
    run.new(0, 1.0)
    with caplog.at_level(logging.WARNING, logger="sglang_wgkv.memory.evictor"):
        evicted = _chunked_prompt(run, 0, [40, 40, 20, 60, 30])
    # global lengths at the boundaries: 24, 64 -> cut to 24, 44, 104 -> cut to 24
    assert evicted == [0, L * H, 0, L * H]
    assert run.ev.early_compressions[0] == 2
    assert int(run.pool.global_len[0].max()) == 24 + 30
    assert run.ev.maybe_evict() == L * H and int(run.pool.global_len[0].max()) == 24
    assert run.ev.early_compressions[0] == 2 and run.ev.request_stats(0)["early_prompt_compressions"] == 2
    assert len([r for r in caplog.records if "compressed early" in r.getMessage()]) == 1
    run.pool.check_integrity()
    with pytest.raises(ValueError, match="prompt_cap"):
        SnapKVEvictor(run.pool, budget=24, num_q_heads=H * G, window=16, prompt_cap=16)


def test_undeclared_requests_and_new_owners_evict_at_every_boundary():
    run = Run(W=16, window=16, budget=24, pages=600, slots=2, maxlen=300, seed=25)
    run.new(1, 1.0)
    run.extend({1: 60})
    run.ev.mark_extend([1], [False])
    assert run.ev.maybe_evict() == 0
    run.finish(1)  # aborted mid-prompt: the slot's next
    run.new(1, 1.0)  # owner starts undeclared
    run.extend({1: 60})
    run.evict_and_check()  # evicted right away, as before
    assert run.ev.triggers[1] == 1


def _needle_run(declare: bool) -> bool:
    """A 3-chunk prompt whose global keys are orthogonal to channel 0 except a needle's: the middle
    queries point away from it, the prompt's last 16 queries at it. Returns whether it survives."""
    W, budget, needle = 16, 8, 10
    run = Run(W=W, window=16, budget=budget, pages=600, slots=2, maxlen=200, seed=27)
    run.ev = SnapKVEvictor(run.pool, budget=budget, num_q_heads=H * G, window=16, kernel_size=1)
    run.new(1, 1.0)
    req = run.reqs[1]
    req.k[..., 0] = 0.0
    req.k[:, needle, :, 0] = 4.0
    req.q.zero_()
    req.q[:, :, :, 0] = -4.0
    req.q[:, 120 - 16 : 120, :, 0] = 4.0
    for i, n in enumerate([40, 40, 40]):
        run.extend({1: n})
        if declare:
            run.ev.mark_extend([1], [i == 2])
        run.ev.maybe_evict()
    g = _globals(run, 1)
    assert all(len(x) == budget for row in g for x in row)
    present = [needle in x for row in g for x in row]
    assert all(present) or not any(present)
    return present[0]


def test_needle_read_only_by_the_question_survives_prompt_end_scoring():
    assert _needle_run(declare=True)
    assert not _needle_run(declare=False)


def _question_run(prompt_window: int) -> tuple[bool, bool]:
    """A prompt whose last 4 queries (the question) read a needle while the 12 queries before them
    read a distractor: budget 1, kernel 1. Returns (needle kept, distractor kept) in every stream."""
    needle, distractor, n = 10, 30, 120
    run = Run(W=16, window=16, budget=1, pages=600, slots=2, maxlen=200, seed=29)
    run.ev = SnapKVEvictor(
        run.pool, budget=1, num_q_heads=H * G, window=16, prompt_window=prompt_window, prompt_kernel=1
    )
    run.new(1, 1.0)
    req = run.reqs[1]
    req.k[..., :2] = 0.0
    req.k[:, needle, :, 0] = 4.0
    req.k[:, distractor, :, 1] = 4.0
    req.q.zero_()
    req.q[:, n - 16 : n - 4, :, 1] = 4.0
    req.q[:, n - 4 : n, :, 0] = 4.0
    run.extend({1: n})
    run.ev.mark_extend([1], [True])
    run.ev.maybe_evict()
    g = [x for row in _globals(run, 1) for x in row]
    return all(x == [needle] for x in g), all(x == [distractor] for x in g)


def test_the_prompt_window_is_the_question_not_the_decode_window():
    """Scored by the last 16 queries, the haystack's 12 outvote the question's 4; by the prompt window
    of 4, the question decides (SnapKV's short observation window; 32 in serving against 256)."""
    assert _question_run(prompt_window=4) == (True, False)
    assert _question_run(prompt_window=16) == (False, True)
    with pytest.raises(ValueError, match="prompt_window"):
        SnapKVEvictor(
            Run(W=16, window=16, budget=1, pages=60, slots=1, maxlen=20, seed=1).pool,
            budget=1,
            num_q_heads=H * G,
            window=16,
            prompt_window=17,
        )


@pytest.mark.parametrize("declared_open", [True, False])
def test_a_new_owner_with_a_cache_before_its_first_extend_waits_for_its_prompt_end(declared_open):
    """A slot's new owner that holds a global cache before its first forward (a prefix restored from
    the radix cache; here the previous forward's undeclared extend stands for it): declared with
    ``open_prompts`` at the boundary ahead of its extend, it is kept there and compressed once, by its
    prompt's end; undeclared, that boundary cuts it as a decoding request first (two triggers)."""
    budget = 24
    run = Run(W=16, window=16, budget=budget, pages=600, slots=2, maxlen=300, seed=29)
    run.new(1, 1.0)
    run.extend({1: 60})  # the restored prefix: 44 global
    if declared_open:
        run.ev.open_prompts([1])
    assert run.ev.maybe_evict() == (0 if declared_open else L * H)
    run.extend({1: 30})  # the rest of its prompt
    run.ev.mark_extend([1], [True])
    assert run.ev.maybe_evict() == L * H
    assert (run.pool.global_len[1] == budget).all()
    assert run.ev.triggers[1] == (1 if declared_open else 2)
    run.pool.check_integrity()
