"""The GPU serving test's logprob criterion (tests/test_gpu_serving.py), on synthetic runs: the
kernels path passes when it lies as close to float32 as the bf16 reference does and fails when it
carries an error of its own."""

import random

import pytest

from test_gpu_serving import FLOOR_FACTOR, FLOOR_SLACK, floor_errors, shared_prefix, within_floor


def _run(ids, lps):
    return (list(ids), list(lps), [[lp, lp - 1.0] for lp in lps])


def _noisy(truth, sigma, rng, extra=0.0):
    return _run(truth[0], [lp + rng.gauss(0.0, sigma) + extra for lp in truth[1]])


@pytest.mark.parametrize("seed", range(5))
def test_equal_bf16_noise_passes_and_an_error_of_its_own_fails(seed):
    rng = random.Random(seed)
    truth = _run(range(48), [-rng.uniform(0.0, 3.0) for _ in range(48)])
    ref, kernels = _noisy(truth, 0.04, rng), _noisy(truth, 0.04, rng)
    e_k, e_r, e_kr = floor_errors(kernels, ref, truth)
    assert within_floor(e_k, e_r)
    # the two bf16 paths may lie farther apart than either lies from float32
    assert max(e_kr) > 0.5 * max(e_r)
    # a shift of 0.3 on every token (e.g. a wrong key in the cache) is not bf16 noise
    broken = _noisy(truth, 0.04, rng, extra=0.3)
    assert not within_floor(*floor_errors(broken, ref, truth)[:2])


def test_one_token_far_off_fails():
    truth = _run(range(8), [-1.0] * 8)
    ref = _run(range(8), [-1.0 + 0.05] * 8)
    kernels = _run(range(8), [-1.0] * 7 + [-1.0 + FLOOR_FACTOR * 0.05 + FLOOR_SLACK + 0.01])
    assert not within_floor(*floor_errors(kernels, ref, truth)[:2])


def test_only_shared_tokens_count():
    truth = _run([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0])
    ref = _run([1, 2, 9, 9], [-1.0, -1.0, -5.0, -5.0])   # splits from float32 at token 2 (a near-tie there)
    kernels = _run([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0])
    assert shared_prefix(kernels, ref, truth) == 2
    e_k, e_r, _ = floor_errors(kernels, ref, truth)
    assert len(e_k) == len(e_r) == 2
