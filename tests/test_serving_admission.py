"""Admission actually happening inside the server: 75% random rejection (the paper's profiling
protocol), per-head decisions of a gate checkpoint, and ``--kv-budget`` eviction on top, seen
through the ``wgkv`` server stats."""

import json
import threading

import pytest
import requests
import torch

from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.serving

W_LOCAL = 16
LAYERS, HEADS = SHORT_LAYERS, 3  # the servers' model: the embedded one's first layers
KV_BUDGET = 48


def _stats_mid_generation(server, prompt, at_tokens=10, max_new_tokens=40):
    """Server stats and the request's meta_info when it has streamed ``at_tokens`` tokens."""
    seen = {}

    def stream():
        body = {
            "text": prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    meta = json.loads(line[len(b"data:") :])["meta_info"]
                    if meta["completion_tokens"] == at_tokens:
                        seen["stats"], seen["meta"] = server.wgkv_stats(), meta

    t = threading.Thread(target=stream)
    t.start()
    t.join(timeout=900)
    return seen["stats"], seen["meta"]


# KV head 0 never admits, heads 1-2 always: test_scale_serving's server (its metrics flags beside), whose
# admission counters are read as differences around the request
gated_server = shared_server(
    "--model-path",
    ShortModel(),
    "--wgkv-local-window",
    str(W_LOCAL),
    "--wgkv-gates",
    HeadGates((-30.0, 30.0, 30.0), W_LOCAL, SHORT_LAYERS),
    "--kv-budget",
    str(KV_BUDGET),
    "--enable-metrics",
    "--decode-log-interval",
    "1",
)


def _admission_counts(server) -> torch.Tensor:
    stats = server.wgkv_stats()
    return torch.tensor([stats["tokens_left_ring_per_layer_head"], stats["tokens_promoted_per_layer_head"]])


def test_gate_checkpoint_decides_per_head(gated_server):
    before = _admission_counts(gated_server)
    out = gated_server.generate(long_prompt(20), max_new_tokens=16)
    assert out["text"]
    gated_server.wait_idle_checked()
    left, promoted = _admission_counts(gated_server) - before
    assert left.shape == (LAYERS, HEADS) and left.min() > 0
    per_head = promoted.double() / left
    assert torch.equal(per_head, torch.tensor([[0.0, 1.0, 1.0]] * LAYERS, dtype=per_head.dtype))


def test_kv_budget_bounds_each_admitting_head(gated_server):
    """Heads 1-2 admit everything, so only the evictor keeps them near the budget: it trims a
    stream to the budget after the prefill, then by 10% whenever a decode step passes it."""
    stats, meta = _stats_mid_generation(gated_server, long_prompt(40))
    assert meta["prompt_tokens"] - W_LOCAL > 5 * KV_BUDGET
    glob = torch.tensor(stats["global_tokens_per_layer_head"])
    assert glob[:, 0].eq(0).all()
    admitting = glob[:, 1:]
    assert admitting.max() <= KV_BUDGET + 1 and admitting.min() >= 0.8 * KV_BUDGET
    out = gated_server.generate(long_prompt(30, seed=2), max_new_tokens=16)
    assert out["text"]


def test_kv_budget_holds_for_concurrent_requests(gated_server):
    """Four requests batched together: each one's admitting heads end within the budget (one forward
    may add one promoted token past it), each was evicted, and the pool is intact afterwards."""
    prompts = [long_prompt(n, seed=s) for n, s in ((24, 3), (32, 4), (40, 5), (28, 6))]
    outs = gated_server.generate(prompts, max_new_tokens=12)
    assert len(outs) == 4
    for out in outs:
        usage = [u for u in out["meta_info"]["wgkv"] if u][-1]
        assert out["meta_info"]["prompt_tokens"] - W_LOCAL > KV_BUDGET
        assert 0 < usage["max_global_tokens_per_head"] <= KV_BUDGET + 1
        assert usage["eviction_triggers"] > 0
    gated_server.wait_idle_checked()


# no prefix cache: the page counts below are of the running request alone (snapshots of earlier
# prompts sharing its prefix would be restored and counted too)
random_server = shared_server(
    "--model-path",
    ShortModel(),
    "--wgkv-local-window",
    str(W_LOCAL),
    "--wgkv-random-admission",
    "0.25",
    "--disable-radix-cache",
    "--wgkv-gates",
    "fresh",
)


def test_random_rejection_keeps_serving(random_server):
    prompts = [long_prompt(20, seed=i) for i in range(6)]
    outs = random_server.generate(prompts, max_new_tokens=32, sampling_params={"ignore_eos": True})
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [32] * 6
    assert all(o["text"] for o in outs)  # detokenized (the short model may answer in whitespace)
    stats = random_server.wait_idle_checked()
    assert stats["tokens_left_ring"] > 6 * LAYERS * HEADS * 200
    assert 0.23 < stats["admitted_fraction"] < 0.27
    per_head = torch.tensor(stats["admitted_fraction_per_layer_head"])
    assert per_head.shape == (LAYERS, HEADS) and per_head.min() > 0.1 and per_head.max() < 0.4


def test_cache_sizes_reflect_rejection(random_server):
    """Mid-generation, each (layer, head) holds W_local ring tokens plus ~25% of the older ones."""
    stats, meta = _stats_mid_generation(random_server, long_prompt(40))
    assert stats["active_requests"] == 1
    # cached tokens lie between prompt + 9 and prompt + 11 (the scheduler runs slightly ahead)
    older = meta["prompt_tokens"] + 9 - W_LOCAL
    glob = torch.tensor(stats["global_tokens_per_layer_head"], dtype=torch.float64)
    assert glob.shape == (LAYERS, HEADS)
    assert 0.18 < glob.mean().item() / older < 0.32
    assert glob.max().item() < 0.5 * older
    dense_pages = LAYERS * HEADS * -(-(older + W_LOCAL) // 16)
    assert stats["used_pages"] < 0.5 * dense_pages
