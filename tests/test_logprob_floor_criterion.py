"""The GPU serving test's logprob criterion (tests/test_gpu_serving.py), on synthetic runs: the
kernels path passes when it lies as close to float32 as the bf16 reference does and fails when it
carries an error of its own. (The float32 logprobs themselves: tests/test_served_matches_offline.py.)"""

import random

import pytest

from sglang_wgkv.testing.gpu_serving_cases import FLOOR_FACTOR, FLOOR_SLACK, path_errors, within_floor

pytestmark = pytest.mark.serving


def _run(ids, lps):
    return (list(ids), list(lps), [[lp, lp - 1.0] for lp in lps])


def _noisy(true_lps, sigma, rng, extra=0.0):
    return _run(range(len(true_lps)), [lp + rng.gauss(0.0, sigma) + extra for lp in true_lps])


@pytest.mark.parametrize("seed", range(5))
def test_equal_bf16_noise_passes_and_an_error_of_its_own_fails(seed):
    rng = random.Random(seed)
    true_lps = [-rng.uniform(0.0, 3.0) for _ in range(48)]
    ref, kernels = _noisy(true_lps, 0.04, rng), _noisy(true_lps, 0.04, rng)
    e_k, e_r = path_errors(kernels, true_lps), path_errors(ref, true_lps)
    assert within_floor(e_k, e_r)
    # the two bf16 paths may lie farther apart than either lies from float32
    assert max(abs(a - b) for a, b in zip(kernels[1], ref[1])) > 0.5 * max(e_r)
    # a shift of 0.3 on every token (e.g. a wrong key in the cache) is not bf16 noise
    broken = _noisy(true_lps, 0.04, rng, extra=0.3)
    assert not within_floor(path_errors(broken, true_lps), e_r)


def test_one_token_far_off_fails():
    true_lps = [-1.0] * 8
    ref = _run(range(8), [-1.0 + 0.05] * 8)
    kernels = _run(range(8), [-1.0] * 7 + [-1.0 + FLOOR_FACTOR * 0.05 + FLOOR_SLACK + 0.01])
    assert not within_floor(path_errors(kernels, true_lps), path_errors(ref, true_lps))


def test_each_path_is_measured_along_its_own_tokens():
    # the kernels path split from the reference at token 2 (a near-tie): float32 was teacher-forced
    # along each path's own tokens, so both are judged over all four, each against its own truth
    kernels, kernels_truth = _run([1, 2, 3, 4], [-1.0] * 4), [-1.0, -1.0, -1.02, -0.98]
    ref, ref_truth = _run([1, 2, 9, 9], [-1.0, -1.0, -5.0, -5.0]), [-1.03, -1.0, -5.04, -5.0]
    e_k, e_r = path_errors(kernels, kernels_truth), path_errors(ref, ref_truth)
    assert len(e_k) == len(e_r) == 4 and within_floor(e_k, e_r)
    with pytest.raises(AssertionError):
        path_errors(kernels, kernels_truth[:3])  # a truth for other tokens
