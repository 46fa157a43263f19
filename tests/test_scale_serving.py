"""Per-request admission control, per-request usage and the Prometheus series, on one real server.

Gates: KV head 0 never admits (g ~ 0), heads 1-2 always (g ~ 1), so with the server's tau = 0.1
a request admits 2/3 of the tokens leaving its window, one with ``tau: 0`` or ``admission: false``
all of them; ``--kv-budget`` makes the evictor fire on the admitting heads.
"""

import math
import time

import pytest
import requests

from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.serving import long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.scale

W_LOCAL = 16
KV_BUDGET = 48


def test_request_admission_parse():
    from sglang_wgkv.integration.requests.control import ADMISSION_OFF_TAU, RequestAdmission

    assert RequestAdmission.parse(None).effective_tau(0.1) == 0.1
    assert RequestAdmission.parse({"tau": 0.3}).effective_tau(0.1) == 0.3
    assert RequestAdmission.parse({"tau": 0}).effective_tau(0.1) == 0.0
    assert RequestAdmission.parse({"admission": False}).effective_tau(0.1) == ADMISSION_OFF_TAU
    keys = {
        RequestAdmission.parse(raw).cache_key()
        for raw in (None, {"tau": 0.3}, {"tau": 0.0}, {"admission": False})
    }
    assert len(keys) == 4 and RequestAdmission.parse({}).cache_key() == ""
    for bad, msg in (
        ({"tau": 1.5}, "in \\[0, 1\\]"),
        ({"tau": True}, "in \\[0, 1\\]"),
        ({"tau": "0.3"}, "in \\[0, 1\\]"),
        ({"tua": 0.3}, "unknown field"),
        ({"admission": 0}, "true or false"),
        ([0.3], "an object"),
        ({"tau": 0.3, "admission": False}, "no effect"),
    ):
        with pytest.raises(ValueError, match=msg):
            RequestAdmission.parse(bad)


# --decode-log-interval 1: SGLang's stats (which carry our series) then publish as soon as the server
# is idle (a running-requests gauge above 0 is stale then) instead of after its 30-s idle interval
server = shared_server(
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


def _usage(out: dict) -> dict:
    values = out["meta_info"]["wgkv"]
    assert len(values) == out["meta_info"]["completion_tokens"]
    assert all(v is None for v in values[:-1])
    return values[-1]


def test_per_request_tau_in_one_batch(server):
    """Three requests of one /generate call run in the same batches with three thresholds."""
    prompt = long_prompt(20)
    params = [
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
        for extra in (
            {},
            {"custom_params": {"wgkv": {"tau": 0.0}}},
            {"custom_params": {"wgkv": {"admission": False}}},
        )
    ]
    r = requests.post(
        server.url + "/generate", json={"text": [prompt] * 3, "sampling_params": params}, timeout=900
    )
    r.raise_for_status()
    default, tau0, off = (_usage(o) for o in r.json())
    assert default["tau"] == pytest.approx(0.1) and tau0["tau"] == 0.0 and off["tau"] is None
    assert default["admission"] and tau0["admission"] and not off["admission"]
    assert default["admitted_fraction"] == pytest.approx(2 / 3, abs=1e-6)
    assert tau0["admitted_fraction"] == pytest.approx(1.0) and off["admitted_fraction"] == pytest.approx(1.0)
    # every request holds W_local ring tokens plus at most the budget per admitting stream
    for u in (default, tau0, off):
        assert u["cached_tokens"] > W_LOCAL + 4 * KV_BUDGET
        assert u["eviction_triggers"] >= 1 and u["evicted_tokens"] > 0
        assert u["max_global_tokens_per_head"] <= KV_BUDGET + 1
    # head 0 holds nothing globally in the default request, so its mean is 2/3 of the others'
    assert default["mean_global_tokens_per_head"] < 0.75 * tau0["mean_global_tokens_per_head"]
    assert default["mean_kv_tokens_per_head"] == pytest.approx(
        default["mean_global_tokens_per_head"] + W_LOCAL
    )
    server.wait_idle_checked()


@pytest.mark.parametrize("bad", [{"tau": 2}, {"tua": 0.1}, {"admission": "off"}])
def test_invalid_request_params_are_400(server, bad):
    r = requests.post(
        server.url + "/generate",
        timeout=120,
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"wgkv": bad}}},
    )
    assert r.status_code == 400 and "custom_params.wgkv" in r.text
    r = requests.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "custom_params": {"wgkv": bad},
        },
    )
    assert r.status_code == 400 and "custom_params.wgkv" in r.text


def test_openai_usage_reports_wgkv(server):
    msg = [{"role": "user", "content": long_prompt(12)}]
    body = {"model": "default", "messages": msg, "max_tokens": 6, "temperature": 0}
    dflt = requests.post(server.url + "/v1/chat/completions", json=body, timeout=900).json()["usage"]
    # same prompt: with prefix caching on, the default request's prefix must not be reused here
    off = requests.post(
        server.url + "/v1/chat/completions",
        timeout=900,
        json={**body, "custom_params": {"wgkv": {"admission": False}}},
    ).json()["usage"]
    assert dflt["completion_tokens"] >= 1
    assert dflt["wgkv"]["admitted_fraction"] == pytest.approx(2 / 3, abs=1e-6)
    assert off["wgkv"]["admitted_fraction"] == pytest.approx(1.0) and not off["wgkv"]["admission"]
    assert off["wgkv"]["mean_kv_tokens_per_head"] > dflt["wgkv"]["mean_kv_tokens_per_head"]
    assert dflt["wgkv"]["eviction_triggers"] >= 1
    comp = requests.post(
        server.url + "/v1/completions",
        timeout=900,
        json={"model": "default", "prompt": long_prompt(12), "max_tokens": 4, "temperature": 0, "n": 1},
    ).json()
    assert comp["usage"]["wgkv"]["mean_kv_tokens_per_head"] > W_LOCAL
    server.wait_idle_checked()


def _metrics(server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=60).text
    values = {}
    for line in text.splitlines():
        if line.startswith("sglang:wgkv_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_prometheus_series(server):
    server.generate(long_prompt(20, seed=3), max_new_tokens=8)
    stats = server.wait_idle_checked()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # published with SGLang's own stats (the idle one included)
        m = _metrics(server)
        if (
            m.get("sglang:wgkv_eviction_triggers_total", 0) >= stats["eviction_triggers_total"]
            and m.get("sglang:wgkv_active_requests") == 0
        ):
            break
        time.sleep(2)
    assert m["sglang:wgkv_eviction_triggers_total"] == stats["eviction_triggers_total"] >= 1
    assert m["sglang:wgkv_evicted_tokens_total"] == stats["evicted_tokens_total"] > 0
    # idle: only prefix-cache snapshots hold pages
    assert m["sglang:wgkv_pages_used"] == stats["used_pages"]
    assert m["sglang:wgkv_pages_used"] + m["sglang:wgkv_pages_free"] == stats["total_pages"]
    assert m["sglang:wgkv_ring_tokens"] == 0 and m["sglang:wgkv_global_tokens"] == 0
    assert not math.isnan(m["sglang:wgkv_admitted_fraction"])
    assert 0.6 < m["sglang:wgkv_admitted_fraction"] <= 1.0
