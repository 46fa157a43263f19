"""``--kv-cache-dtype fp8_e4m3`` served through WG-KV on CPU (float32 model, reference attention).

Two servers of the short model (its shipped gates) at W_local = 32 (prompts leave the ring, are promoted, and
chunked prefill reads the cached context back from the pool), one storing FP8 pages, one float32.
FP8 rounds every cached K/V once (relative error up to 1/16), so greedy outputs may part after a
while; generating past end-of-sequence, they must agree on a leading stretch of every prompt and on
most tokens overall. The FP8
server's ``/server_info`` and ``/metrics`` report one byte per K/V element.
"""

import math
import time

import pytest
import requests

from sglang_wgkv.testing.server_pool import ShippedGates, shared_server
from sglang_wgkv.testing.serving import long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.serving

PROMPTS = [
    "The capital of France is",
    long_prompt(18),  # ~230 tokens: four chunks
    long_prompt(45, seed=3),  # ~560 tokens: nine chunks
]
NEW_TOKENS = 24
LEADING_AGREEMENT = 6  # tokens every prompt's FP8 output must share with the float32 one
OVERALL_AGREEMENT = 0.6  # fraction of all tokens in the common greedy prefixes
HEAD_DIM = 64  # the embedded model's


# the radix tests' server (shared): W_local 32, 64-token chunks, the shipped gates; the FP8 one differs
# only in its KV dtype (and exports metrics)
COMMON = (
    "--model-path", ShortModel(), "--wgkv-local-window", "32", "--chunked-prefill-size", "64",
    "--wgkv-gates", ShippedGates(32, SHORT_LAYERS),
)  # fmt: skip
full_server = shared_server(*COMMON)
# --decode-log-interval 1: SGLang's stats (which carry our series) then publish as soon as the server
# is idle (a running-requests gauge above 0 is stale then) instead of after its 30-s idle interval
fp8_server = shared_server(
    *COMMON, "--kv-cache-dtype", "fp8_e4m3", "--enable-metrics", "--decode-log-interval", "1"
)


@pytest.fixture(scope="module")
def servers(full_server, fp8_server):
    return fp8_server, full_server


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_fp8_greedy_agrees_with_float32_kv(servers):
    fp8, full = servers
    greedy = dict(max_new_tokens=NEW_TOKENS, sampling_params={"ignore_eos": True})
    got = [o["output_ids"] for o in fp8.generate(PROMPTS, **greedy)]
    want = [o["output_ids"] for o in full.generate(PROMPTS, **greedy)]
    assert all(len(ids) == NEW_TOKENS for ids in got + want)
    common = [_common_prefix(a, b) for a, b in zip(got, want)]
    print("FP8 vs float32 KV, common greedy prefix per prompt:", common)
    assert min(common) >= LEADING_AGREEMENT, common
    assert sum(common) >= OVERALL_AGREEMENT * NEW_TOKENS * len(PROMPTS), common
    stats, ref = fp8.wait_idle_checked(), full.wait_idle_checked()
    assert stats["tokens_left_ring"] > 0 and stats["tokens_promoted"] > 0
    assert stats["kv_dtype"] == "float8_e4m3fn" and ref["kv_dtype"] == "float32"
    assert stats["page_bytes"] == 2 * 16 * HEAD_DIM and ref["page_bytes"] == 4 * stats["page_bytes"]
    assert stats["used_bytes"] == stats["used_pages"] * stats["page_bytes"]


def test_fp8_metrics_report_fp8_bytes(servers):
    fp8, _ = servers
    fp8.generate(long_prompt(20, seed=5), max_new_tokens=4)
    stats = fp8.wait_idle_checked()
    deadline, m = time.monotonic() + 90, {}
    while time.monotonic() < deadline:  # published with SGLang's own stats (the idle one included)
        m = _metrics(fp8)
        if m.get("sglang:wgkv_active_requests") == 0 and "sglang:wgkv_kv_bytes_used" in m:
            break
        time.sleep(2)
    assert m["sglang:wgkv_kv_bytes_used"] == m["sglang:wgkv_pages_used"] * stats["page_bytes"]
    assert m["sglang:wgkv_pages_used"] == stats["used_pages"] and not math.isnan(
        m["sglang:wgkv_kv_bytes_used"]
    )


def _metrics(server) -> dict[str, float]:
    values = {}
    for line in requests.get(server.url + "/metrics", timeout=60).text.splitlines():
        if line.startswith("sglang:wgkv_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_launcher_serves_fp8_where_a_path_reads_it(monkeypatch):
    """FP8 is served on CPU and CUDA, on both attention paths and with the Triton extend launches;
    refused (exit 2 through the parser) for block-scaled formats."""
    import torch

    from sglang_wgkv.launch_server import cpu_default_kv_tokens, resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        assert resolve(["--model-path", "/m", "--kv-cache-dtype", dtype])[0] is not None
    with pytest.raises(ValueError, match="mxfp8"):
        resolve(["--model-path", "/m", "--kv-cache-dtype", "mxfp8"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for attention in ("auto", "kernels", "reference"):
        for dtype in ("fp8_e4m3", "fp8_e5m2"):
            args = ["--model-path", "/m", "--kv-cache-dtype", dtype, "--wgkv-attention", attention]
            assert resolve(args)[0].attention == attention
    settings = resolve(["--model-path", "/m", "--kv-cache-dtype", "fp8_e4m3", "--wgkv-extend-kernels"])[0]
    assert settings.extend_kernels
    assert resolve(["--model-path", "/m", "--kv-cache-dtype", "fp8_e4m3", "--disable-wgkv"])[0] is None
    # the CPU default budget at equal memory: FP8 holds twice bf16's tokens
    from sglang_wgkv.embedded_model import ensure_embedded_model

    model = str(ensure_embedded_model())
    bf16 = cpu_default_kv_tokens(model, [], ram_bytes=24 << 30)
    assert cpu_default_kv_tokens(model, ["--kv-cache-dtype", "fp8_e4m3"], ram_bytes=24 << 30) == 2 * bf16


def test_runtime_and_graphs_follow_the_fp8_choice():
    """The kernels path serves an FP8 pool, with or without the Triton extend launches (they read and
    write FP8 too), decode CUDA graphs on; float32 and CPU keep the reference attention."""
    import torch

    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime
    from sglang_wgkv.integration.plugin.settings import ServingSettings

    cuda = torch.device("cuda")
    for settings in (ServingSettings(), ServingSettings(extend_kernels=True)):
        assert WGKVRuntime.choose_kernels(settings, cuda, torch.bfloat16)
        assert not WGKVRuntime.choose_kernels(settings, cuda, torch.float32)
        assert settings.decode_graph_blocker("cuda", "bfloat16") is None
        assert settings.decode_graph_blocker("cuda", "float32") is not None


def test_layer_scales_follow_sglang():
    """The per-layer scales as SGLang leaves them on a ``RadixAttention``: processed checkpoint scales
    (``k_scale_float``), a float from ``--quantization-param-path``, an unset -1.0 parameter, none."""
    from types import SimpleNamespace

    import torch

    from sglang_wgkv.integration.pools.kv_dtype import layer_scale

    assert layer_scale(SimpleNamespace(k_scale=torch.tensor(0.5), k_scale_float=0.5), "k") == 0.5
    assert layer_scale(SimpleNamespace(k_scale=0.25, k_scale_float=None), "k") == 0.25
    assert layer_scale(SimpleNamespace(v_scale=torch.tensor(-1.0), v_scale_float=None), "v") == 1.0
    assert layer_scale(SimpleNamespace(k_scale=None, k_scale_float=None), "k") == 1.0


def test_capacity_counts_fp8_bytes():
    """A token of FP8 K/V costs half a bf16 one, so per-slot state (bytes) costs twice the tokens; the
    evictor's query window stays in the model's dtype."""
    from sglang_wgkv.integration.pools.slot_costs import ModelShape, fixed_costs

    shape = dict(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, context_len=8192)
    bf16 = ModelShape(**shape, dtype_bytes=2)
    fp8 = ModelShape(**shape, dtype_bytes=1, query_bytes=2)
    assert fp8.token_bytes * 2 == bf16.token_bytes
    cost_bf16, cost_fp8 = fixed_costs(bf16, 256, 32), fixed_costs(fp8, 256, 32)
    assert cost_fp8.window_tokens == 2 * cost_bf16.window_tokens
    assert abs(cost_fp8.slot_tokens - 2 * cost_bf16.slot_tokens) <= 1
    assert fixed_costs(ModelShape(**shape, dtype_bytes=1), 256, 32).window_tokens == cost_bf16.window_tokens
