"""A burst of prompts through the scheduler's prefill pass and the running knee, on a simulated clock:
the knee's own code (``mixed_batches.schedule_prefill``, ``running_knee``) decides each pass, a cost
model times it.

=====================  ===========================================================================
what                   as modelled
=====================  ===========================================================================
a prefill pass         SGLang's: ``chunked_prefill_size`` tokens from the chunked prompt, then the
                       waiting queue in order, the prompt that does not fit chunked
a forward's GPU time   ``a + b * decode rows + g * prompt tokens`` (the served model's terms,
                       ``benchmarks/served_model.py``); a pass decodes every running request when
                       ``mixed`` (SGLang's mixed chunks), none otherwise
the launch clock       ``overlap``: a forward is launched once the one before the last has finished
                       (SGLang's overlap scheduler), else once the last has
a request's TPOT       (last token - first token) / output tokens, as ``bench_serving`` counts it
upstream               ``knee_k=None`` and ``cap``: a pool that runs at most ``cap`` requests, a held
                       pass running only the chunked prompt's next chunk
=====================  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from sglang_wgkv.integration.plugin.settings import ServingSettings
from sglang_wgkv.integration.scheduling import running_knee as rk
from sglang_wgkv.integration.scheduling.mixed_batches import schedule_prefill


@dataclass(frozen=True)
class Burst:
    """``prompts`` requests of ``prompt`` tokens and ``out`` outputs sent at once; costs in seconds."""

    a: float = 0.005
    b: float = 0.00006
    g: float = 0.00003
    prompt: int = 3000
    out: int = 300
    prompts: int = 600
    dense: int = 50  # requests a dense pool of the same memory runs
    knee_k: float | None = 8.0
    mixed: bool = False
    overlap: bool = False
    cap: int | None = None
    chunk: int = 8192

    @property
    def knee_running(self) -> float:
        """The model's knee ``B* = K a / (b + P g / O)`` (inf without a knee)."""
        if self.knee_k is None:
            return float("inf")
        return self.knee_k * self.a / (self.b + self.prompt * self.g / self.out)


@dataclass(frozen=True)
class BurstResult:
    seconds: float
    output_tok_s: float
    median_tpot_s: float
    median_ttft_s: float
    max_running: int
    running_mid: list  # running counts once a third of the prompts was in, until three quarters were
    held_passes: int
    target_s: float | None


class BurstScheduler:
    """SGLang's scheduler as far as the prefill pass and the knee see it."""

    def __init__(self, runtime, burst: Burst):
        self.token_to_kv_pool_allocator = SimpleNamespace(
            get_kvcache=lambda: SimpleNamespace(runtime=runtime)
        )
        self.chunked_prefill_size, self.max_prefill_tokens = burst.chunk, burst.chunk
        self.is_mixed_chunk = burst.mixed
        self.cap = burst.cap
        self.waiting_queue = [
            SimpleNamespace(
                rid=f"r{i}",
                origin_input_ids=range(burst.prompt),
                sampling_params=SimpleNamespace(max_new_tokens=burst.out),
                output_ids=[],
                left=burst.prompt,
            )
            for i in range(burst.prompts)
        ]
        self.chunked_req = None
        self.running_batch = SimpleNamespace(reqs=[])

    def raw(self, prefill_delayer_single_pass=None, running_batch=None):
        """``_get_new_batch_prefill_raw``: ``((tokens, prompts finished), running)`` or ``(None, running)``."""
        full = self.cap is not None and len(self.running_batch.reqs) >= self.cap
        if full and self.chunked_req is None:
            return None, running_batch
        budget, done = self.chunked_prefill_size, []
        queue = [] if full else list(self.waiting_queue)
        parts = ([self.chunked_req] if self.chunked_req is not None else []) + queue
        self.chunked_req, tokens = None, 0
        for req in parts:
            if budget == 0:
                break
            take = min(req.left, budget)
            req.left -= take
            budget -= take
            tokens += take
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
            if req.left:
                self.chunked_req = req
            else:
                done.append(req)
        return ((tokens, done) if tokens else None), running_batch


def run_burst(burst: Burst) -> BurstResult:
    """The burst to its end: every prompt prefilled, every output decoded."""
    clock = SimpleNamespace(t=100.0)
    knee = rk.RunningKnee(burst.knee_k, lambda: clock.t) if burst.knee_k is not None else None
    plan = SimpleNamespace(
        mode="dense", physical_tokens=burst.dense * (burst.prompt + burst.out // 2), fixed_tokens=0
    )
    settings = ServingSettings(forward_tokens=burst.chunk if burst.mixed else None)
    runtime = SimpleNamespace(plan=plan, settings=settings, running_knee=knee)
    sched = BurstScheduler(runtime, burst)
    if knee is not None:
        for _ in range(8):  # SGLang's warm-up request decodes one row
            knee.observe(rk.Launch(decode_rows=1, prefill=False, decoding=True), pipelined=True)
            clock.t += burst.a + burst.b
    start = clock.t
    tpot, ttft, mid, ends, running_max = [], [], [], [], 0

    def decode(reqs, t):
        for req in list(reqs):
            req.output_ids.append(0)
            if len(req.output_ids) == burst.out:
                sched.running_batch.reqs.remove(req)
                tpot.append((t - req.first) / burst.out)

    while sched.waiting_queue or sched.chunked_req is not None or sched.running_batch.reqs:
        running = sched.running_batch.reqs
        batch, _ = schedule_prefill(
            BurstScheduler.raw, sched, prefill_delayer_single_pass=None, running_batch=sched.running_batch
        )
        rows = len(running) if batch is None or burst.mixed else 0
        if knee is not None:
            knee.observe(rk.Launch(rows, prefill=batch is not None, decoding=bool(running)), pipelined=True)
        cost = burst.a + burst.b * rows + (burst.g * batch[0] if batch else 0.0)
        ends.append(max(clock.t, ends[-1] if ends else 0.0) + cost)
        decode(running if rows else [], ends[-1])
        for req in batch[1] if batch else ():
            req.first = ends[-1]
            ttft.append(ends[-1] - start)
            req.output_ids.append(0)  # the prompt's first token
            running.append(req)
        clock.t = ends[-2] if burst.overlap and len(ends) > 1 else ends[-1]
        running_max = max(running_max, len(running))
        if burst.prompts / 3 < burst.prompts - len(sched.waiting_queue) < 0.75 * burst.prompts:
            mid.append(len(running))
    seconds = ends[-1] - start
    return BurstResult(
        seconds=seconds,
        output_tok_s=burst.prompts * burst.out / seconds,
        median_tpot_s=sorted(tpot)[len(tpot) // 2],
        median_ttft_s=sorted(ttft)[len(ttft) // 2],
        max_running=running_max,
        running_mid=mid,
        held_passes=knee.held_passes if knee is not None else 0,
        target_s=knee.target_s() if knee is not None else None,
    )
