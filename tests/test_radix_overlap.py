"""The radix cache under SGLang's overlap scheduler (its default, which WG-KV keeps):
``sglang_wgkv/integration/plugin/overlap.py``.

Under overlap a request's first decode forward is launched before its prefill's results are processed,
so the cache call at the prompt's end finds the slot one token past the radix path; the prompt-end
snapshot is taken ahead of that launch. The units drive ``SnapshotRadixCache`` through that order on a
small pool; the servers (the short model on CPU, the same but for ``--disable-overlap-schedule``) must
give equal greedy outputs with prefix hits, snapshots taken ahead on the overlap server only, none
missed, and clean idle checks. A CPU server runs one stream: it reproduces the host order of the
overlap loop, not the stream order (the fence), which a GPU run checks (``tests/test_gpu_serving.py``).
"""

import threading
from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.plugin.forward_fence import ForwardFence
from sglang_wgkv.integration.plugin.overlap import fence_forward
from sglang_wgkv.integration.requests.control import usage_of
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.pool_driver import run_decode, run_extend
from sglang_wgkv.testing.server_pool import ShippedGates, shared_server
from sglang_wgkv.testing.serving import flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel
from sglang_wgkv.testing.snapshot_cache import snapshot_cache

pytestmark = [pytest.mark.serving, pytest.mark.radix]

W, P = 16, 40  # the prompt leaves the ring


class CountingFence(ForwardFence):
    def __init__(self):
        super().__init__()
        self.waits = 0

    def wait(self):
        self.waits += 1


def _cache():
    dual = DualCachePool(1, 1, 8, 64, 2, 128, WGKVConfig(local_window=W), dtype=torch.float32)
    fence = CountingFence()
    return snapshot_cache(dual, fence), dual, fence


def _prefill_then_decode(cache, dual, ahead: bool):
    """Slot 0 prefills P tokens, SGLang inserts them; its decode forward is launched (moving the slot
    to P + 1) before the prompt's cache call."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    torch.manual_seed(0)
    tokens = list(range(100, 100 + P))
    k, v, q = torch.randn(1, P + 1, 1, 8), torch.randn(1, P + 1, 1, 8), torch.randn(1, P + 1, 1, 8)
    admit = torch.ones(1, P + 1, 1, dtype=torch.bool)
    dual.alloc_request(0)
    if ahead:
        cache.before_forward([0], [(0, P)])  # the prefill's launch
    run_extend(dual, [0], [0], [P], q[:, :P], k[:, :P], v[:, :P], admit[:, :P], W)
    cache.insert(InsertParams(key=RadixKey(tokens), value=torch.arange(P)))
    if ahead:
        cache.before_forward([0], [])  # the decode's launch
    run_decode(dual, [0], [P], q[:, P:], k[:, P:], v[:, P:], admit[:, P:])
    return SimpleNamespace(req_pool_idx=0, origin_input_ids=tokens, output_ids=[7], extra_key=None)


def test_prompt_end_snapshot_taken_ahead_of_the_decode_launch():
    cache, dual, fence = _cache()
    req = _prefill_then_decode(cache, dual, ahead=True)
    assert cache.snapshots_ahead == 1 and dual.cached_len[0] == P + 1 and fence.waits == 1
    cache._snapshot_request(req, path_len=P, priority=0)  # cache_unfinished_req at the prompt's end
    assert cache.snapshots_taken == 1 and cache.snapshots_missed == 0
    (node,) = cache._snap_nodes
    assert node.snapshot.length == P
    assert fence.waits == 1  # the one taken (and fenced) ahead
    cache.check_integrity()
    dual.free_request(0)
    cache.reset()
    assert len(cache.store) == 0 and dual.num_free_pages() == 64


def test_slot_past_the_path_is_not_snapshotted():
    cache, dual, _ = _cache()
    req = _prefill_then_decode(cache, dual, ahead=False)
    cache._snapshot_request(req, path_len=P, priority=0)
    assert cache.snapshots_taken == 0 and cache.snapshots_missed == 1 and not cache._snap_nodes
    assert cache.total_size() == P  # nothing inserted past SGLang's path
    cache.check_integrity()


def test_freed_slot_releases_what_it_took_ahead():
    cache, dual, _ = _cache()
    _prefill_then_decode(cache, dual, ahead=True)
    assert len(cache.store) == 1
    cache.slot_freed(0)
    dual.free_request(0)
    assert len(cache.store) == 0 and not cache._owed
    cache.check_integrity()
    assert dual.num_free_pages() == 64


def test_fence_records_only_under_overlap():
    events = []

    class Event:
        def record(self, stream):
            events.append(("record", stream))

        def wait(self):
            events.append(("wait", None))

    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    runtime = SimpleNamespace(forward_fence=ForwardFence())
    pool = WGKVReqToTokenPool.__new__(WGKVReqToTokenPool)
    pool.runtime = runtime

    class Stream:
        def wait_stream(self, other):
            events.append(("wait_stream", other))

    scheduler = SimpleNamespace(
        req_to_token_pool=pool,
        enable_overlap=False,
        device_module=SimpleNamespace(Event=Event),
        device="cuda",
        forward_stream="fwd",
        schedule_stream=Stream(),
        _war_barrier_enabled=True,
    )
    fence_forward(None, scheduler)
    runtime.forward_fence.wait()
    assert events == []
    scheduler.enable_overlap = True
    fence_forward(None, scheduler)
    runtime.forward_fence.wait()
    assert events == [("record", "fwd"), ("wait", None)]
    scheduler._war_barrier_enabled = False  # no SGLang barrier: the scheduler's stream waits it all
    fence_forward(None, scheduler)
    assert events[2:] == [("record", "fwd"), ("wait_stream", "fwd")]


# -- servers -----------------------------------------------------------------------------------------
# test_radix_serving's server (the overlap scheduler on), and the same without it (test_scale_router's
# two workers after this module)
ARGS = (
    "--model-path", ShortModel(), "--wgkv-local-window", "32", "--chunked-prefill-size", "64",
    "--wgkv-gates", ShippedGates(32, SHORT_LAYERS),
)  # fmt: skip
overlap_server = shared_server(*ARGS)
serial_server = shared_server(*ARGS, "--disable-overlap-schedule")

SYSTEM = long_prompt(16)  # ~200 tokens shared: three 64-token chunk boundaries inside
SEQUENTIAL = [f"{SYSTEM} Question {i}: which item has number {i}?" for i in range(3)]
CONCURRENT = [f"{SYSTEM} Question {i}: which item comes after {i}?" for i in range(4)]


def _traffic(server) -> dict:
    flush_cache(server)
    before = server.wait_idle_checked()["radix"]
    out = {}
    for i, prompt in enumerate(SEQUENTIAL):
        o = server.generate(prompt, max_new_tokens=8, sampling_params={"ignore_eos": True})
        out[("seq", i)] = (o["output_ids"], o["meta_info"]["cached_tokens"])
        meta = o["meta_info"]
        out[("usage", i)] = (None, (usage_of(meta), meta["prompt_tokens"] + meta["completion_tokens"] - 1))
    one = server.generate(SEQUENTIAL[0] + " Again.", max_new_tokens=1)  # finishes at its prefill
    out["one"] = (one["output_ids"], one["meta_info"]["cached_tokens"])

    def run(i, prompt):
        o = server.generate(prompt, max_new_tokens=8, sampling_params={"ignore_eos": True})
        out[("conc", i)] = (o["output_ids"], o["meta_info"]["cached_tokens"])

    threads = [threading.Thread(target=run, args=item) for item in enumerate(CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    stats = server.wait_idle_checked()  # strict idle check: a leak kills the scheduler
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]
    after = stats["radix"]
    return {
        "out": out,
        **{key: after[key] - before[key] for key in ("prefix_hits", "snapshots_ahead", "snapshots_missed")},
        "restore_slots": after["restore_slots"],
    }


def _output_ids(run: dict) -> dict:
    return {key: ids for key, (ids, _) in run["out"].items() if key[0] != "usage"}


def test_overlap_scheduler_matches_serial_with_prefix_hits(overlap_server, serial_server):
    overlap, serial = _traffic(overlap_server), _traffic(serial_server)
    assert _output_ids(overlap) == _output_ids(serial)
    # one request at a time: the same snapshots on both servers, so the same hits
    sequential = [k for k in overlap["out"] if k[0] == "seq" or k == "one"]
    assert [overlap["out"][k][1] for k in sequential] == [serial["out"][k][1] for k in sequential]
    assert all(overlap["out"][k][1] > 0 for k in sequential[1:])
    # usage as of the last token given (the overlap step of the forward in flight is not in it)
    usages = [k for k in overlap["out"] if k[0] == "usage"]
    assert [overlap["out"][k][1] for k in usages] == [serial["out"][k][1] for k in usages]
    assert all(usage["cached_tokens"] == fed for usage, fed in (overlap["out"][k][1] for k in usages))
    # the repeated prompt resumes from its prompt-end snapshot (taken ahead under overlap), past the
    # chunk boundaries the others resume from
    assert overlap["out"]["one"][1] > overlap["out"][("seq", 1)][1]
    # the concurrent ones all hit unless they were matched in one pass beyond the restore slots
    for run in (overlap, serial):
        assert run["prefix_hits"] >= len(sequential) - 1 + min(len(CONCURRENT), run["restore_slots"])
    assert overlap["snapshots_ahead"] >= len(SEQUENTIAL) and serial["snapshots_ahead"] == 0
    assert overlap["snapshots_missed"] == serial["snapshots_missed"] == 0
