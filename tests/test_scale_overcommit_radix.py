"""Overcommit with the prefix cache on (the launcher's GPU default when admission is on, forced here on
CPU with ``--wgkv-overcommit``): prefix-cache hits are restored into their slots under the scheduler's
physical-pool guard (a hit's ring copy counted), more requests run than a dense pool holds, the greedy
outputs equal the cold (cache-flushed) ones, and the idle check is clean.
"""

import pytest
import requests

from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import flush_cache
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.scale

W_LOCAL = 16
PREFIX, SUFFIX, OUT, CHUNK = 120, 24, 6, 64


server = shared_server(
    "--model-path",
    ShortModel(),
    "--max-total-tokens",
    "512",
    "--wgkv-gates",
    HeadGates((30.0, -30.0, -30.0), W_LOCAL, SHORT_LAYERS),  # 1 of 3 heads admits
    "--wgkv-local-window",
    str(W_LOCAL),
    "--wgkv-overcommit",
    "2",
    "--chunked-prefill-size",
    str(CHUNK),
)


def _generate(server, input_ids):
    r = requests.post(
        server.url + "/generate",
        timeout=900,
        json={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": OUT, "temperature": 0, "ignore_eos": True},
        },
    )
    r.raise_for_status()
    return r.json()


def test_prefix_hits_under_overcommit(server):
    import random

    rng = random.Random(4)
    shared = [rng.randrange(1000, 30000) for _ in range(PREFIX)]
    prompts = [shared + [rng.randrange(1000, 30000) for _ in range(SUFFIX)] for _ in range(4)]
    cold = []
    for p in prompts:
        flush_cache(server)
        cold.append(_generate(server, p)["output_ids"])
    flush_cache(server)
    first = _generate(server, prompts[0])  # fills the tree with the shared prefix
    warm = _generate(server, prompts[1:])  # three hits, batched
    assert first["output_ids"] == cold[0]
    assert [w["output_ids"] for w in warm] == cold[1:]
    # snapshots sit at chunk boundaries and prompt ends: at least the first one's chunk boundary inside
    # the shared prefix (a later hit may restore a deeper one its batch-mates left), never past it
    cached = [w["meta_info"]["cached_tokens"] for w in warm]
    assert all(PREFIX // CHUNK * CHUNK <= c <= PREFIX for c in cached), cached
    stats = server.wait_idle_checked()
    assert stats["active_requests"] == 0 and server.alive()
    assert stats["radix"]["prefix_hits"] >= 3 and stats["capacity_mode"] == "overcommit", stats
