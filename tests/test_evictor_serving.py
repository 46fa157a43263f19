"""Prompt-end scoring in the served engine (bounded mode: ``--kv-budget`` + chunked prefill): a prompt
prefilled in several chunks is not evicted from until its end, then compressed to the budget once;
a prompt that admits more than the capacity plan's ``prompt_cap`` is compressed early and the log
says so; the pool stays intact."""

import pytest

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.testing.server_pool import shared_server
from sglang_wgkv.testing.serving import flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.evictor

W_LOCAL = 16
KV_BUDGET = 16
CHUNK = 64
STREAMS = SHORT_LAYERS * 3  # the servers' model: the embedded one's first layers, 3 KV heads
# What a stream is cut to when the evictor looks: the budget less its lead (memory/evictor.py).
KEEP = KV_BUDGET - WGKVConfig(kv_budget=KV_BUDGET).evictor_lead


# fresh gates admit every token; --max-total-tokens 2048 (BASE_ARGS): prompt_cap 16 + 512. The radix
# cache is on (the last test needs it); the others flush it, so their prompts run from the first token.
server = shared_server(
    "--model-path",
    ShortModel(),
    "--wgkv-gates",
    "fresh",
    "--wgkv-local-window",
    str(W_LOCAL),
    "--kv-budget",
    str(KV_BUDGET),
    "--chunked-prefill-size",
    str(CHUNK),
)


def _usage(out):
    return [u for u in out["meta_info"]["wgkv"] if u][-1]


def test_chunked_prompt_is_compressed_once_at_its_end(server):
    prompt = long_prompt(24)
    # one output token comes from the prefill: no eviction inside the prompt (per-chunk scoring cut
    # it at each of the 4 boundaries between its chunks); the overlap scheduler may run the next
    # step boundary, the prompt-end compression, before it frees the request
    flush_cache(server)
    one = server.generate(prompt, max_new_tokens=1)
    n = one["meta_info"]["prompt_tokens"]
    assert n > 4 * CHUNK
    u = _usage(one)
    assert u["eviction_triggers"] <= 1 and u["early_prompt_compressions"] == 0
    assert u["evicted_tokens"] == u["eviction_triggers"] * STREAMS * (n - W_LOCAL - KEEP)
    flush_cache(server)  # the same prompt again, not restored from the first one's snapshots
    out = server.generate(prompt, max_new_tokens=4, sampling_params={"ignore_eos": True})
    u = _usage(out)
    assert u["early_prompt_compressions"] == 0 and u["max_global_tokens_per_head"] <= KV_BUDGET + 1
    # the prompt's end cut every stream to budget - lead at once: at least n - W - that per stream
    assert u["evicted_tokens"] >= STREAMS * (n - W_LOCAL - KEEP)
    assert out["output_ids"][0] == one["output_ids"][0]
    server.wait_idle_checked()


def test_prompt_past_the_cap_is_compressed_early_and_logged(server):
    flush_cache(server)
    out = server.generate(long_prompt(60, seed=3), max_new_tokens=3, sampling_params={"ignore_eos": True})
    assert out["meta_info"]["prompt_tokens"] - W_LOCAL > 16 + 512 + CHUNK
    u = _usage(out)
    assert u["early_prompt_compressions"] >= 1 and u["max_global_tokens_per_head"] <= KV_BUDGET + 1
    assert "compressed early to the budget" in server.log_path.read_text(errors="replace")
    server.wait_idle_checked()
    assert server.alive()


def test_a_prefix_restored_from_the_radix_cache_is_compressed_once_by_its_prompt_end(server):
    """Radix cache on: a second prompt sharing a long prefix with the first starts from that prefix's
    snapshot, whose global cache is past the budget before its first forward. It waits for its own
    prompt's end like any prompt (one trigger), instead of being cut by the decode rule at the step
    boundary ahead of its extend, scored by no query of its own, and then again at its end (two
    triggers, which lose the needles of long passkey prompts)."""
    shared = long_prompt(24)
    params = {"ignore_eos": True}
    flush_cache(server)  # the first prompt's prefix is computed, not restored from earlier tests
    server.generate(shared + " And which one mentions a tree?", max_new_tokens=2, sampling_params=params)
    out = server.generate(
        shared + " Now tell me which item is the green book.", max_new_tokens=2, sampling_params=params
    )
    n, cached = out["meta_info"]["prompt_tokens"], out["meta_info"]["cached_tokens"]
    assert cached - W_LOCAL > KV_BUDGET  # a restored prefix past the budget
    u = _usage(out)
    assert u["eviction_triggers"] == 1 and u["early_prompt_compressions"] == 0
    # one cut, to budget - lead, of the whole prompt's global part (plus at most the decode step's token)
    assert STREAMS * (n - W_LOCAL - KEEP) <= u["evicted_tokens"] <= STREAMS * (n + 1 - W_LOCAL - KEEP)
    server.wait_idle_checked()
