"""Host syncs of the prefix cache's page reclaim, counted on CPU: a pool that prompt snapshots keep
full (prompts that share nothing, as M1D's), a stream of admissions checked as the scheduler does
(``allocator.fits(need)`` with the cache as the reclaimer), three ways: the reclaim as it was (an
exact count after every dropped snapshot), the reclaim as it is (one exact count once the drops are
expected to cover), and that with a free count queued and the headroom kept after each launch
(``overlap.refresh_free_pages``, its headroom from a forward-token budget of one round's prompts).
A sync under a forward in flight stops the host from running ahead of the GPU, so syncs per
admission are the number that matters; they do not depend on the device.

    python -m benchmarks.reclaim_syncs --out benchmarks/results/serving/reclaim_syncs_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import shlex
import sys

import torch

from benchmarks.common import write_json
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.plugin.overlap import admission_headroom
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.pool_driver import run_extend
from sglang_wgkv.testing.snapshot_cache import snapshot_cache, snapshot_prompt

L, H, D, W = 2, 2, 8, 16
PROMPT, RUNNING, ADMIT_P = 120, 12, 0.25  # each prompt leaves the ring; a quarter of it admitted
VARIANTS = ("reclaim_as_was", "reclaim", "reclaim_and_headroom")


def reclaim_as_was(cache, worst_case: int) -> None:
    """The reclaim before: an exact count (a host sync) before every drop."""
    allocator = cache.dual.allocator
    for _, drop in cache._victims():
        if allocator.can_allocate(worst_case):
            return
        drop()


def run(variant: str, rounds: int, per_round: int, pages: int, seed: int = 0) -> dict:
    slots = RUNNING + per_round
    dual = DualCachePool(L, H, D, pages, slots, 4 * PROMPT, WGKVConfig(local_window=W), dtype=torch.float32)
    cache = snapshot_cache(dual)
    dual.allocator.reclaimer = (
        (lambda need: reclaim_as_was(cache, need)) if variant == "reclaim_as_was" else cache.reclaim
    )
    syncs, exact = [0], dual.allocator.sync_free

    def counted():
        syncs[0] += 1
        return exact()

    dual.allocator.sync_free = counted
    gen = torch.Generator().manual_seed(seed)
    running, free_slots = collections.deque(), list(range(slots))
    headroom = admission_headroom(dual, per_round * PROMPT)  # a forward-token budget of one round
    admitted = refused = 0
    step = L * H * slots
    need = dual.extend_bound(0, PROMPT)
    for rnd in range(rounds):
        batch, reserved = [], 0
        for _ in range(per_round):  # the scheduling round: each admission checked as add_one_req does
            if not free_slots or not dual.allocator.fits(reserved + need + step):
                refused += 1
                break
            batch.append(free_slots.pop())
            reserved += need
        for i, r in enumerate(batch):  # the round's forward
            dual.alloc_request(r)
            k, v, q = (torch.randn(L, PROMPT, H, D, generator=gen) for _ in range(3))
            admit = torch.rand(L, PROMPT, H, generator=gen) < ADMIT_P
            run_extend(dual, [r], [0], [PROMPT], q, k, v, admit, W)
        if variant == "reclaim_and_headroom":  # after its launch
            dual.allocator.queue_refresh()
            cache.keep_headroom(headroom)
        for i, r in enumerate(batch):  # its results: each prompt's end snapshotted
            snapshot_prompt(cache, r, [(rnd * per_round + i) * 1000 + t for t in range(PROMPT)])  # unshared
            running.append(r)
            admitted += 1
        while len(running) > RUNNING:  # the oldest finish
            r = running.popleft()
            dual.free_request(r)
            free_slots.append(r)
    return {
        "variant": variant,
        "admissions": admitted,
        "refused": refused,
        "host_syncs": syncs[0],
        "syncs_per_admission": syncs[0] / max(admitted, 1),
        "snapshots_taken": cache.snapshots_taken,
        "snapshots_dropped": cache.snapshots_dropped,
        "snapshots_left": len(cache._snap_nodes),
        "headroom_pages": headroom if variant == "reclaim_and_headroom" else None,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--pages", type=int, default=1200)
    a = ap.parse_args(argv)
    rows = [run(v, a.rounds, a.per_round, a.pages) for v in VARIANTS]
    for row in rows:
        print(row)
    if a.out:
        shape = {"layers": L, "kv_heads": H, "local_window": W, "prompt": PROMPT, "running": RUNNING}
        shape |= {
            "admitted_fraction": ADMIT_P,
            "pages": a.pages,
            "rounds": a.rounds,
            "per_round": a.per_round,
        }
        command = shlex.join(
            ["python", "-m", "benchmarks.reclaim_syncs", *(sys.argv[1:] if argv is None else argv)]
        )
        write_json(a.out, {"command": command, "shape": shape, "rows": rows}, "reclaim_syncs")


if __name__ == "__main__":
    main()
