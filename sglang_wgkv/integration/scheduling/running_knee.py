"""The running batch at its knee (``--wgkv-running-knee K``): once as many requests run as a dense pool
of the same memory would hold, a new request is admitted only while the running requests' recent TPOT,
with one more prefill pass like the last one counted in, and their own TPOT since they started running
both stay under ``(1 + K)`` times a decode step's fixed cost.

Why. With ``B`` requests running, a request's output costs its prompt ``P g`` and ``O`` decode steps
shared by ``B``: TPOT is ``a + B (b + P g / O)`` (``a`` the step's fixed cost, the weights' read; ``b``
its cost per running request) while the output rate saturates at ``O / (P g + O b)``. TPOT reaches
``(1 + K) a`` where the rate is ``K / (K + 1)`` of that limit, so past that point a request admitted buys
little throughput and costs every running request TPOT in proportion. On prompt-heavy traffic the knee
comes well before the pool is full (``running_at_knee`` in ``benchmarks/results/serving/M1D_model.json``);
on decode-heavy traffic TPOT stays near ``a + b B`` and the rule never binds. Below the dense pool's count it never holds, so the running batch is never
smaller than upstream's.

======================  =======================================================================
quantity                measured as (host clock, at each forward's launch)
======================  =======================================================================
a forward's period      from its launch to the next one, when a forward was in flight before it
                        (under SGLang's overlap scheduler the launch waits for the forward before
                        it: the period is one forward's time, host work included)
``a``                   the lowest median of :data:`STEP_SAMPLES` consecutive periods of decode
                        forwards that followed decode forwards, the mean of the middle two (a
                        launch after a late one waits for nothing: one long period, then one short
                        one, neither a forward's; a host slower than the GPU alternates them, and
                        their mean is its pace); SGLang's warm-up request decodes one row at
                        start-up, a server started with ``--skip-server-warmup`` learns it from its
                        first such run
TPOT                    over the last :data:`WINDOW_S`: the periods of the forwards launched while
                        requests decoded, divided by the forwards that gave them a token (decode
                        and mixed ones; a prefill-only forward makes them wait: a window of such
                        forwards alone counts as one token's wait)
a pass's cost           the period of the last forward that prefilled while requests decoded (a
                        pass admitted now makes them wait about as long: counting it before the
                        pass, not after, keeps a burst of 8K-token passes from overshooting TPOT)
the running requests'   the median, over those running for at least one target TPOT, of each one's
own TPOT                time per output token since the knee first saw it running (walked each pass
                        while requests wait). Under SGLang's overlap scheduler a launch waits for
                        the forward before the last, so the window sees each period a forward late
                        and a burst of passes overshoots it; the requests' own TPOT carries that
                        debt until decode steps have paid it back, as a client measures it
                        (``tests/test_running_knee.py``, the ``overlap`` bursts: 1.22x the target on
                        the window alone)
dense running count     SGLang's KV budget (dense tokens) / the running requests' mean of prompt
                        plus half their ``max_new_tokens``
======================  =======================================================================

``K = 4`` by default on CUDA with one scheduler (``settings.DEFAULT_GPU_RUNNING_KNEE``); it holds nothing
until ``a`` has been timed.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

# TPOT is averaged over the forwards of the last this many seconds (a burst's prefill phase is tens).
WINDOW_S = 2.0
# A longer gap between launches is an idle server, not a forward.
MAX_PERIOD_S = WINDOW_S
# ``a`` is a median of this many consecutive decode periods (even: the two middle ones averaged).
STEP_SAMPLES = 4


@dataclass(frozen=True)
class Launch:
    """What the scheduler launched: its decode rows (decode and mixed forwards), whether it prefills
    (extend and mixed forwards), and whether requests were decoding at all (a prefill-only forward
    launched beside running requests makes them wait)."""

    decode_rows: int
    prefill: bool
    decoding: bool

    @property
    def gives_tokens(self) -> bool:
        return self.decode_rows > 0

    @property
    def decode_only(self) -> bool:
        return self.decode_rows > 0 and not self.prefill


class RunningKnee:
    """The admission rule of the module docstring for one scheduler; ``clock`` in seconds."""

    def __init__(self, k: float, clock=time.perf_counter):
        if not k > 0:
            raise ValueError(f"the running knee K must be > 0, got {k}")
        self.k = k
        self.clock = clock
        self.fixed_step_s: float | None = None  # ``a``
        self._last: tuple[float, Launch] | None = None  # the previous launch: time, what
        self._before_last: Launch | None = None
        self._steps: collections.deque[float] = collections.deque(maxlen=STEP_SAMPLES)  # consecutive ones
        self._window: collections.deque[tuple[float, float, Launch]] = collections.deque()  # t, period, what
        self._window_s = 0.0  # the window's periods and token-giving forwards, kept as it moves
        self._window_tokens = 0
        self.held_passes = 0  # prefill passes that kept new requests waiting
        self.held_chunk_passes = 0  # of them, those that ran a chunked prompt's next chunk
        self.pass_s = 0.0  # the last prefill forward's period beside decoding requests
        self._pass_tokens = 0  # and whether it gave them a token (a mixed one)
        self._seen: dict[str, tuple[float, int]] = {}  # running request id -> (time, outputs) first seen
        self.running_tpot_s: float | None = None  # their median TPOT since (see_running)

    def observe(self, launch: Launch, pipelined: bool) -> None:
        """A forward is launched now; ``pipelined``: a forward ran right before it (the scheduler was
        not idle), so the time since the last launch is that forward's period."""
        now = self.clock()
        previous = self._last if pipelined else None
        step = None
        if previous is not None:
            t, prev = previous
            period = now - t
            if 0 < period <= MAX_PERIOD_S:
                # under overlap the period ends when the forward before ``prev`` ends: both decode-only
                if prev.decode_only and self._before_last is not None and self._before_last.decode_only:
                    step = period
                if prev.decoding:
                    self._window.append((t, period, prev))
                    self._window_s += period
                    self._window_tokens += prev.gives_tokens
                    if prev.prefill:
                        self.pass_s, self._pass_tokens = period, int(prev.gives_tokens)
        self._time_step(step)
        self._before_last = previous[1] if previous is not None else None
        self._last = (now, launch)
        while self._window and self._window[0][0] < now - WINDOW_S:
            _, period, what = self._window.popleft()
            self._window_s -= period
            self._window_tokens -= what.gives_tokens
        if not self._window:
            self._window_s = 0.0  # no float residue carried over an idle gap

    def _time_step(self, period: float | None) -> None:
        """``period``: a decode step's, or None where this launch ended none (the run of them breaks)."""
        if period is None:
            self._steps.clear()
            return
        self._steps.append(period)
        if len(self._steps) == STEP_SAMPLES:
            mid = sorted(self._steps)[STEP_SAMPLES // 2 - 1 : STEP_SAMPLES // 2 + 1]
            step = sum(mid) / 2
            self.fixed_step_s = step if self.fixed_step_s is None else min(self.fixed_step_s, step)

    def tpot_s(self) -> float | None:
        """The running requests' time per token over the window (None: nothing in it; a window of
        waits without a token counts as one token's: the next token comes no sooner)."""
        return self._window_s / max(self._window_tokens, 1) if self._window else None

    def projected_tpot_s(self) -> float | None:
        """:meth:`tpot_s` with one more prefill pass like the last in the window (None: nothing in it)."""
        if not self._window:
            return None
        return (self._window_s + self.pass_s) / max(self._window_tokens + self._pass_tokens, 1)

    def target_s(self) -> float | None:
        return None if self.fixed_step_s is None else (1 + self.k) * self.fixed_step_s

    def state(self) -> dict:
        """For ``/server_info`` (``internal_states``): the knee's inputs in ms and its held passes."""
        ms = lambda x: None if x is None else round(1000 * x, 3)  # noqa: E731
        return {
            "k": self.k,
            "fixed_step_ms": ms(self.fixed_step_s),
            "tpot_ms": ms(self.tpot_s()),
            "running_tpot_ms": ms(self.running_tpot_s),
            "pass_ms": ms(self.pass_s),
            "target_ms": ms(self.target_s()),
            "held_passes": self.held_passes,
            "held_chunk_passes": self.held_chunk_passes,
        }

    def holds(self, running: int, dense_running: float) -> bool:
        """Whether a pass with ``running`` requests running keeps new requests waiting."""
        return self.over_target() and running >= dense_running

    def over_target(self) -> bool:
        """Whether the window's TPOT with one more pass, or the running requests' median TPOT since they
        were first seen running (:meth:`see_running`), exceeds ``(1 + K) a`` (False until ``a`` is known)."""
        target = self.target_s()
        if target is None:
            return False
        tpot = self.projected_tpot_s()
        return (tpot is not None and tpot > target) or (
            self.running_tpot_s is not None and self.running_tpot_s > target
        )

    def see_running(self, reqs) -> None:
        """The running requests (SGLang ``Req``) as a pass is scheduled: each one's time and output
        count when first seen, and :attr:`running_tpot_s`, the median of their time per token since,
        over those seen at least one target TPOT ago (a request just seen has had no time to decode)."""
        now, target = self.clock(), self.target_s()
        seen, tpots = {}, []
        for req in reqs:
            n = len(req.output_ids)
            t0, n0 = self._seen.get(req.rid) or (now, n)
            if n < n0:  # retracted and run again: its outputs start over
                t0, n0 = now, n
            seen[req.rid] = t0, n0
            if target is not None and now - t0 >= target:
                tpots.append((now - t0) / max(n - n0, 1))
        self._seen = seen
        tpots.sort()
        self.running_tpot_s = tpots[len(tpots) // 2] if tpots else None


def dense_running(dense_tokens: int, requests) -> float:
    """How many of ``requests`` (SGLang ``Req``) a dense pool of ``dense_tokens`` would run at once:
    its tokens over their mean prompt plus half their output budget (inf with none running)."""
    if not requests:
        return math.inf
    total = sum(len(r.origin_input_ids) + (r.sampling_params.max_new_tokens or 0) / 2 for r in requests)
    mean = total / len(requests)
    return dense_tokens / max(mean, 1.0)


def launch_of(scheduler, batch) -> Launch:
    """The :class:`Launch` of ``batch`` as ``Scheduler.run_batch`` receives it (a mixed batch's decode
    rows are SGLang's ``decoding_reqs``)."""
    mode = batch.forward_mode
    if mode.is_decode():
        rows = batch.batch_size()
    elif mode.is_mixed():
        rows = len(batch.decoding_reqs or ())
    else:
        rows = 0
    running = getattr(scheduler, "running_batch", None)
    decoding = rows > 0 or bool(running is not None and not running.is_empty())
    return Launch(rows, prefill=mode.is_extend(), decoding=decoding)


def scheduler_split(tp: int | None, pp: int | None, dp: int | None) -> str:
    """The TP, PP and DP sizes above one (``"TP 2, DP 2"``; empty on one scheduler): each scheduler
    would time its own forwards and admit apart from the others, so the rule runs only where empty."""
    ranks = {"TP": tp, "PP": pp, "DP": dp}
    return ", ".join(f"{name} {n}" for name, n in ranks.items() if (n or 1) > 1)


def scheduler_runtime(scheduler):
    """The WG-KV runtime behind ``scheduler``'s KV pool (None: not a WG-KV pool); the scheduling hooks'
    one way to it."""
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    return getattr(allocator.get_kvcache(), "runtime", None) if allocator is not None else None


def observe_launch(scheduler, batch, *args, **kwargs):
    """BEFORE ``Scheduler.run_batch``: the launch, for the knee's periods (``last_batch`` is None after
    an idle pass: nothing was in flight)."""
    runtime = scheduler_runtime(scheduler)
    knee = getattr(runtime, "running_knee", None)
    if knee is not None and not batch.is_empty():
        knee.observe(launch_of(scheduler, batch), pipelined=scheduler.last_batch is not None)
    return None


def holds_new_requests(runtime, scheduler, running_reqs) -> bool:
    """Whether this prefill pass keeps the waiting requests waiting (a chunked prompt's next chunk still
    runs: ``mixed_batches.schedule_prefill``)."""
    knee = getattr(runtime, "running_knee", None)
    if knee is None or runtime.plan is None or not running_reqs:
        return False
    if not (scheduler.waiting_queue or scheduler.chunked_req is not None):
        return False  # nothing to hold
    knee.see_running(running_reqs)
    if not knee.over_target():
        return False
    dense = dense_running(runtime.plan.physical_tokens + runtime.plan.fixed_tokens, running_reqs)
    held = knee.holds(len(running_reqs), dense)
    knee.held_passes += held
    return held
