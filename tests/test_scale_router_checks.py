"""``python -m sglang_wgkv.launch_router``'s start-up refusals, without a model server: a worker URL
that is not an SGLang server, one that never answers, workers that disagree, a routing mode WG-KV
workers cannot serve. (Served with real workers: tests/test_scale_router.py.)"""

import http.server
import json
import threading
from types import SimpleNamespace

import pytest

from sglang_wgkv import launch_router
from sglang_wgkv.launch_router import (
    SERVED_POLICIES,
    RouterSetupError,
    WorkerInfo,
    check_routing,
    check_workers,
)
from sglang_wgkv.server_process import free_port

pytestmark = [pytest.mark.scale]


def server_info(attention_backend="wgkv", model_path="/models/m", tau=0.1, **wgkv):
    stats = {"tau": tau, "local_window": 256, "random_admission": None, "kv_budget": None, **wgkv}
    return {
        "version": "0.5.17",
        "model_path": model_path,
        "attention_backend": attention_backend,
        "internal_states": [{"wgkv": stats} if attention_backend == "wgkv" else {}],
    }


def worker(url="http://w0", **kwargs) -> WorkerInfo:
    return WorkerInfo.from_server_info(url, server_info(**kwargs))


def test_server_info_tells_wgkv_dense_and_others_apart():
    assert worker().admission == (
        ("tau", 0.1),
        ("local_window", 256),
        ("random_admission", None),
        ("kv_budget", None),
    )
    assert worker(attention_backend="fa3").admission is None
    for not_sglang in ({}, {"model_path": "m"}, [1], {"version": 1, "model_path": "m"}):
        with pytest.raises(RouterSetupError, match="not an SGLang server"):
            WorkerInfo.from_server_info("http://x", not_sglang)
    broken = server_info()
    broken["internal_states"] = [{}]
    with pytest.raises(RouterSetupError, match="reports no WG-KV stats"):
        WorkerInfo.from_server_info("http://x", broken)


@pytest.mark.parametrize(
    "other, message",
    [
        ({"model_path": "/models/other"}, "different models"),
        ({"attention_backend": "fa3"}, "answer one request differently"),
        ({"tau": 0.3}, "answer one request differently"),
        ({"kv_budget": 4096}, "answer one request differently"),
        ({"local_window": 128}, "answer one request differently"),
    ],
)
def test_workers_that_disagree_are_refused(other, message):
    check_workers([worker(), worker("http://w1")])
    with pytest.raises(RouterSetupError, match=message):
        check_workers([worker(), worker("http://w1", **other)])


def router_args(policy="cache_aware", pd=False):
    return SimpleNamespace(policy=policy, pd_disaggregation=pd)


def test_routing_modes_wgkv_workers_cannot_serve_are_refused():
    for policy in SERVED_POLICIES:
        check_routing(router_args(policy), [worker()])
    with pytest.raises(RouterSetupError, match="--pd-disaggregation with WG-KV workers"):
        check_routing(router_args(pd=True), [worker()])
    with pytest.raises(RouterSetupError, match="--policy bucket is not served"):
        check_routing(router_args("bucket"), [worker()])
    check_routing(router_args(pd=True), [worker(attention_backend="fa3")])  # upstream: its own business


class _Answer(http.server.BaseHTTPRequestHandler):
    """A web server that is no SGLang server: every GET is a 404, or ``body`` with 200."""

    body = None

    def do_GET(self):
        payload = json.dumps(self.body).encode() if self.body is not None else b"not found"
        self.send_response(404 if self.body is None else 200)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def web_server():
    servers = []

    def start(body):
        handler = type("Handler", (_Answer,), {"body": body})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


def launch(capsys, *args) -> str:
    """``python -m sglang_wgkv.launch_router args``, in this process: its refusal message (a
    refusal exits with status 2 before the router would start)."""
    with pytest.raises(SystemExit) as exit_:
        launch_router.main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_launcher_refuses_urls_that_are_no_sglang_server(web_server, capsys):
    url = web_server(None)
    err = launch(capsys, "--worker-urls", url, "--worker-startup-timeout-secs", "30")
    assert f"refused: {url} is not an SGLang server: /server_info answered 404" in err

    url = web_server({"name": "some other JSON service"})
    err = launch(capsys, "--worker-urls", url, "--worker-startup-timeout-secs", "30")
    assert "has no 'version' and 'model_path'" in err

    err = launch(capsys, "--worker-urls", "127.0.0.1:30001", "--worker-startup-timeout-secs", "30")
    assert "refused: 127.0.0.1:30001 is not an http:// or https:// URL" in err

    silent = f"http://127.0.0.1:{free_port()}"
    err = launch(capsys, "--worker-urls", silent, "--worker-startup-timeout-secs", "2")
    assert f"refused: {silent} did not answer as a healthy SGLang server in time (ConnectionError)" in err


def test_launcher_refuses_pd_disaggregation_in_front_of_wgkv(web_server, capsys):
    url = web_server(server_info())  # answers /health with 200 too
    err = launch(
        capsys,
        "--pd-disaggregation",
        "--prefill",
        url,
        "--decode",
        url,
        "--worker-startup-timeout-secs",
        "30",
    )
    assert "--pd-disaggregation with WG-KV workers" in err
