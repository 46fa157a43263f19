"""integration/scheduling/running_knee.py: the periods it times, TPOT and ``a`` from them, when it
holds new requests, and that a burst under it settles at the model's knee."""

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.integration.plugin.settings import DEFAULT_GPU_RUNNING_KNEE, ServingSettings
from sglang_wgkv.integration.scheduling import running_knee as rk
from sglang_wgkv.integration.scheduling.mixed_batches import schedule_prefill
from sglang_wgkv.testing.knee_burst import Burst, run_burst

pytestmark = pytest.mark.serving

DECODE = rk.Launch(decode_rows=8, prefill=False, decoding=True)
MIXED = rk.Launch(decode_rows=8, prefill=True, decoding=True)
PREFILL_BESIDE = rk.Launch(
    decode_rows=0, prefill=True, decoding=True
)  # a prefill-only forward, requests decoding
FIRST_PREFILL = rk.Launch(decode_rows=0, prefill=True, decoding=False)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run(knee, clock, launches_and_periods, pipelined=True):
    """Launch each ``(launch, period)``: the period is the time until the next launch."""
    for launch, period in launches_and_periods:
        knee.observe(launch, pipelined)
        clock.t += period


def test_fixed_step_is_the_lowest_median_of_consecutive_decode_periods():
    clock = Clock()
    knee = rk.RunningKnee(8, clock)
    run(knee, clock, [(MIXED, 0.25), (DECODE, 0.012), (DECODE, 0.011), (DECODE, 0.009), (DECODE, 0.010)])
    knee.observe(DECODE, True)
    assert knee.fixed_step_s is None  # three decode periods after decodes: the first followed a mixed one
    clock.t += 0.010
    knee.observe(DECODE, True)
    assert knee.fixed_step_s == pytest.approx(0.010)  # 0.011, 0.009, 0.010, 0.010: the middle two
    # a late launch (a long period), then one that waits for nothing (a short one), then the forward
    # it queued behind: no window of four has its middle below the step by more than the short one's share
    for period in (0.011, 0.002, 0.009, 0.010, 0.010):
        clock.t += period
        knee.observe(DECODE, True)
    assert knee.fixed_step_s == pytest.approx(0.0095)  # 0.002, 0.009, 0.010, 0.011 (a mean: 0.008)
    # a host slower than the GPU: long and short alternate, and their mean is the pace
    for period in (0.018, 0.002, 0.018, 0.002, 0.018, 0.002):
        clock.t += period
        knee.observe(DECODE, True)
    assert knee.fixed_step_s == pytest.approx(0.0095)
    # after an idle pass (nothing in flight) the time since the last launch is no forward's
    for period, pipelined in ((0.001, False), (0.001, True), (0.008, True), (0.008, True), (0.008, True)):
        clock.t += period
        knee.observe(DECODE, pipelined)
    assert knee.fixed_step_s == pytest.approx(0.0095)  # the run restarted: 0.001 and three 0.008 in it
    clock.t += 0.008
    knee.observe(DECODE, True)
    assert knee.fixed_step_s == pytest.approx(0.008)


def test_tpot_counts_waits_without_tokens_and_forgets_the_window():
    clock = Clock()
    knee = rk.RunningKnee(8, clock)
    assert knee.tpot_s() is None and not knee.holds(10**6, 1)  # nothing timed: never holds
    run(knee, clock, [(FIRST_PREFILL, 0.2)] * 3)  # nobody decoding: not a token's wait
    run(knee, clock, [(DECODE, 0.01)] * 4 + [(MIXED, 0.25), (PREFILL_BESIDE, 0.2), (DECODE, 0.01)])
    knee.observe(DECODE, True)
    assert knee.tpot_s() == pytest.approx((5 * 0.01 + 0.25 + 0.2) / 6)
    clock.t += rk.WINDOW_S + 1  # an idle gap longer than the window: no period, and the window empties
    knee.observe(DECODE, True)
    assert knee.tpot_s() is None
    # a burst of prefill-only forwards beside running requests: no token, the whole wait counts
    run(knee, clock, [(PREFILL_BESIDE, 0.25)] * 4)
    knee.observe(DECODE, True)
    assert knee.tpot_s() == pytest.approx(1.0)


def test_holds_only_past_the_dense_count_and_above_the_target():
    clock = Clock()
    knee = rk.RunningKnee(4, clock)
    run(knee, clock, [(DECODE, 0.01)] * 5)
    knee.observe(DECODE, True)
    assert knee.target_s() == pytest.approx(0.05)
    assert not knee.holds(running=100, dense_running=50)  # TPOT 10 ms: under the target
    run(knee, clock, [(MIXED, 0.3)] * 5)
    knee.observe(DECODE, True)
    assert knee.tpot_s() > knee.target_s()
    assert knee.holds(running=100, dense_running=50)
    assert not knee.holds(running=49, dense_running=50)  # never below what a dense pool runs
    with pytest.raises(ValueError, match="> 0"):
        rk.RunningKnee(0)


def test_running_requests_tpot_since_first_seen():
    """The running requests' own TPOT since the knee first saw them: a request that waited through
    prefill passes without a token keeps the knee over the target after the window has forgotten them;
    one just seen is not counted yet; one that left is forgotten."""
    clock = Clock()
    knee = rk.RunningKnee(4, clock)
    run(knee, clock, [(DECODE, 0.01)] * 6)
    target = knee.target_s()
    reqs = [SimpleNamespace(rid=f"r{i}", output_ids=[0]) for i in range(3)]
    knee.see_running(reqs)
    assert knee.running_tpot_s is None  # seen just now
    clock.t += 2.5  # longer than the window: one token each
    for req in reqs:
        req.output_ids.append(0)
    run(knee, clock, [(DECODE, 0.01)] * 4)  # the window sees only fast decode steps
    assert knee.tpot_s() < target
    knee.see_running(reqs)
    assert knee.running_tpot_s == pytest.approx(2.54) and knee.over_target()
    assert knee.state()["running_tpot_ms"] == pytest.approx(2540)
    for req in reqs[:2]:  # two of them decode 299 more tokens in the next 2 s: 15 ms a token since seen
        req.output_ids += [0] * 299
    clock.t += 2.0
    fresh = SimpleNamespace(rid="new", output_ids=[0])
    knee.see_running([*reqs, fresh])
    assert knee.running_tpot_s == pytest.approx(4.54 / 300)  # the median of three; "new" not counted
    assert not knee.over_target()
    knee.see_running([fresh])
    assert set(knee._seen) == {"new"}


def test_dense_running_uses_the_mean_lifetime_footprint():
    reqs = [
        SimpleNamespace(origin_input_ids=[0] * p, sampling_params=SimpleNamespace(max_new_tokens=o))
        for p, o in ((3000, 400), (1000, 200))
    ]
    assert rk.dense_running(410_000, reqs) == pytest.approx(410_000 / ((3200 + 1100) / 2))
    assert rk.dense_running(410_000, []) == math.inf


def test_a_burst_settles_at_the_knee():
    """A toy scheduler under the model of the module docstring: 600 requests at once, a pass admits one
    prompt (a mixed forward: its prefill beside every decode row) unless the knee holds. The running
    count settles near ``B* = K a / (b + P g / O)`` and TPOT near ``(1 + K) a``."""
    a, b, prompt, out, k, dense = 0.005, 0.00006, 0.095, 384, 8, 50
    clock = Clock()
    knee = rk.RunningKnee(k, clock)
    for _ in range(8):  # SGLang's warm-up request: a few decode steps of one row
        knee.observe(rk.Launch(decode_rows=1, prefill=False, decoding=True), pipelined=True)
        clock.t += a + b
    clock.t += 5.0  # idle until the burst
    waiting, running, seen = 600, [], []
    first = True
    while waiting or running:
        admit = waiting and not knee.holds(len(running), dense)
        launch = rk.Launch(decode_rows=len(running), prefill=bool(admit), decoding=bool(running))
        if not running and not admit:
            break
        knee.observe(launch, pipelined=not first)
        first = False
        clock.t += a + b * len(running) + (prompt if admit else 0.0)
        running = [left - 1 for left in running if left > 1]
        if admit:
            waiting -= 1
            running.append(out)
        if 200 < 600 - waiting < 450:  # steady: the first wave is past, the queue not yet empty
            seen.append(len(running))
    knee_b = k * a / (b + prompt / out)
    assert knee_b * 0.85 < sum(seen) / len(seen) < knee_b * 1.15, (knee_b, sum(seen) / len(seen))
    assert knee.fixed_step_s == pytest.approx(a + b, rel=0.01)  # the drain's last decode: one row


class _Scheduler:
    def __init__(self, runtime, running_reqs, chunked_req=None, last_batch="prev"):
        self.token_to_kv_pool_allocator = SimpleNamespace(
            get_kvcache=lambda: SimpleNamespace(runtime=runtime)
        )
        self.chunked_prefill_size, self.max_prefill_tokens, self.is_mixed_chunk = 8192, 16384, True
        self.chunked_req = chunked_req
        self.running_batch = SimpleNamespace(reqs=running_reqs, is_empty=lambda: not running_reqs)
        self.last_batch = last_batch
        self.waiting_queue = [SimpleNamespace(seqlen=90, name="w1"), SimpleNamespace(seqlen=90, name="w2")]
        self.passes = 0
        self.seen_waiting = []

    def raw(self, prefill_delayer_single_pass=None, running_batch=None):
        self.passes += 1
        self.seen_waiting.append(list(self.waiting_queue))
        self.waiting_queue = self.waiting_queue[1:] + [
            SimpleNamespace(seqlen=7, name="queued during the pass")
        ]
        # SGLang's stats count the pending tokens of the queue the pass saw
        return SimpleNamespace(prefill_stats=SimpleNamespace(num_pending_tokens=100)), running_batch


def test_hooks_time_launches_and_hold_the_pass():
    clock = Clock()
    knee = rk.RunningKnee(1, clock)
    plan = SimpleNamespace(mode="dense", physical_tokens=900, fixed_tokens=100)
    runtime = SimpleNamespace(plan=plan, settings=ServingSettings(), running_knee=knee)
    reqs = [
        SimpleNamespace(
            rid=f"r{i}",
            origin_input_ids=[0] * 90,
            sampling_params=SimpleNamespace(max_new_tokens=20),
            output_ids=[0],
        )
        for i in range(10)
    ]
    scheduler = _Scheduler(runtime, reqs)  # a dense pool of 1,000 tokens runs 10 of them

    class Mode:
        def __init__(self, name):
            self.name = name

        def is_decode(self):
            return self.name == "decode"

        def is_mixed(self):
            return self.name == "mixed"

        def is_extend(self):
            return self.name in ("mixed", "extend")

    decode = SimpleNamespace(forward_mode=Mode("decode"), batch_size=lambda: 10, is_empty=lambda: False)
    extend = SimpleNamespace(forward_mode=Mode("extend"), is_empty=lambda: False)
    assert rk.launch_of(scheduler, decode) == rk.Launch(10, prefill=False, decoding=True)
    assert rk.launch_of(scheduler, extend) == rk.Launch(0, prefill=True, decoding=True)
    for batch, period in [(decode, 0.01)] * 6 + [(extend, 0.5)] * 3:
        rk.observe_launch(scheduler, batch)
        clock.t += period
    rk.observe_launch(scheduler, decode)
    assert knee.fixed_step_s == pytest.approx(0.01) and knee.tpot_s() > knee.target_s()

    def call(s):
        return schedule_prefill(
            type(s).raw, s, prefill_delayer_single_pass=None, running_batch=s.running_batch
        )

    assert call(scheduler) == (None, scheduler.running_batch) and scheduler.passes == 0
    assert knee.held_passes == 1 and knee.state()["held_passes"] == 1
    scheduler.chunked_req = object()  # a chunked prompt's next chunk runs, and only it
    waiting = scheduler.waiting_queue
    batch, running = call(scheduler)
    assert running is scheduler.running_batch and scheduler.passes == 1
    assert scheduler.seen_waiting == [[]] and knee.held_passes == 2 and knee.held_chunk_passes == 1
    names = [r.name for r in scheduler.waiting_queue]
    assert names == ["w1", "w2", "queued during the pass"]  # the hidden queue back, in front
    assert batch.prefill_stats.num_pending_tokens == 100 + 2 * 90  # the hidden requests' tokens counted
    scheduler.waiting_queue = waiting
    clock.t += rk.WINDOW_S + 1  # the window forgets the prefills and the running requests decoded fast:
    for req in reqs:  # under the target, the pass admits
        req.output_ids += [0] * 1000
    rk.observe_launch(scheduler, decode)
    batch, _ = call(scheduler)
    assert [r.name for r in scheduler.seen_waiting[-1]] == ["w1", "w2"]
    assert batch.prefill_stats.num_pending_tokens == 100  # a pass that saw the queue: SGLang's count
    scheduler.chunked_req = None
    runtime.running_knee = None  # off: SGLang's pass
    assert call(scheduler)[1] is scheduler.running_batch and scheduler.passes == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["in_order", "overlap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_only", "mixed"])
def test_a_burst_of_chunked_prompts_settles_at_the_knee(mixed, overlap):
    """M1D's burst as served (``testing/knee_burst.py``): every pass fills its 8K tokens and ends in a
    chunked prompt; a pass is a prefill-only forward (the running requests wait through it) or, with
    SGLang's mixed chunks (the CUDA default, ``--wgkv-forward-tokens 8192``), a mixed one that also
    decodes every running request. The knee still holds once past the dense count (a held pass runs
    only the chunked prompt's next chunk), the running count settles near ``B* = K a / (b + P g / O)``,
    not at the whole burst, and the median request's TPOT stays at the target. ``overlap``: SGLang's
    overlap scheduler launches a forward once the one before the last has finished, so the knee sees
    each period one forward late."""
    burst = Burst(mixed=mixed, overlap=overlap)  # a dense pool of the same memory runs 50
    got = run_burst(burst)
    assert got.held_passes > 0
    # each request's TPOT at the target: a pass is counted before it runs, and the running requests'
    # own TPOT since they started holds the burst where the window's lags a forward behind
    assert got.median_tpot_s < 1.05 * got.target_s, (got.median_tpot_s, got.target_s)
    knee_b = burst.knee_running
    assert got.max_running < 1.4 * knee_b, (knee_b, got.max_running)  # the whole burst would run 450 and more
    mean = sum(got.running_mid) / len(got.running_mid)
    assert knee_b * 0.8 < mean < knee_b * 1.2, (knee_b, mean)


def test_launcher_option(monkeypatch):
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    settings, _, env = resolve(["--model-path", "/m"])
    assert settings.running_knee == DEFAULT_GPU_RUNNING_KNEE and ServingSettings.from_env(env) == settings
    settings, _, env = resolve(["--model-path", "/m", "--wgkv-running-knee", "2.5"])
    assert settings.running_knee == 2.5 and ServingSettings.from_env(env) == settings
    assert resolve(["--model-path", "/m", "--wgkv-running-knee", "0"])[0].running_knee is None
    spellings = (
        ["--tp-size", "2"],
        ["--dp", "2"],
        ["--tensor-parallel-size=2"],
        ["--pipeline-parallel-size", "2"],
    )
    for split in spellings:  # the default stays off where schedulers would split, however SGLang names them
        assert resolve(["--model-path", "/m", *split])[0].running_knee is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(["--model-path", "/m"])[0].running_knee is None
    assert resolve(["--model-path", "/m", "--wgkv-running-knee", "8"])[0].running_knee == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="running_knee must be > 0"):
        resolve(["--model-path", "/m", "--wgkv-running-knee", "-1"])
    with pytest.raises(ValueError, match="one scheduler, got TP 2"):
        resolve(["--model-path", "/m", "--wgkv-running-knee", "8", "--tp-size", "2"])


def test_scheduler_split_names_the_ranks():
    """The runtime turns the knee off where ranks would split it, however the launch named them."""
    assert rk.scheduler_split(1, 1, None) == ""
    assert rk.scheduler_split(2, 1, 2) == "TP 2, DP 2"
