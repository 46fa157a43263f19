"""Two WG-KV servers behind SGLang's router (``sglang-router``, cache-aware policy), started through
``python -m sglang_wgkv.launch_router``: requests, prefix caching across workers, a worker killed
under load and restarted. One module-scoped cluster: the router over ``test_radix_overlap``'s two
shared servers, the radix tests' server (overlap scheduler on) and the same with
``--disable-overlap-schedule`` (equal greedy outputs, which that module checks). The fault test runs
last, kills the second one (the pool drops it after this module) and restarts it as a server of its own.

What the router itself does to requests (``docs/scale-out.md``) is pinned here too, so that the
document stays true when the router changes: its typed ``/generate`` body adds ``model`` and drops
unknown fields, and it refuses a batched ``text``.
"""

import json
import os
import signal
import threading
import time

import pytest
import requests

from sglang_wgkv import launch_router
from sglang_wgkv.server_process import ServerProcess, free_port
from sglang_wgkv.testing.server_pool import ShippedGates, command_args, shared_server
from sglang_wgkv.testing.serving import Server, flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = [pytest.mark.serving, pytest.mark.scale]

LOCAL_WINDOW = 32
WORKER_ARGS = [
    "--model-path",
    ShortModel(),
    "--wgkv-local-window",
    str(LOCAL_WINDOW),
    "--chunked-prefill-size",
    "64",
    "--wgkv-gates",
    ShippedGates(LOCAL_WINDOW, SHORT_LAYERS),
]
survivor = shared_server(*WORKER_ARGS)
VICTIM_ARGS = [*WORKER_ARGS, "--disable-overlap-schedule"]
victim = shared_server(*VICTIM_ARGS, kills=True)  # by the fault test
# Health checks every second, one failure marks a worker down, one success brings it back.
ROUTER_ARGS = [
    "--policy",
    "cache_aware",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    "--worker-startup-timeout-secs",
    "300",
    "--log-level",
    "warn",
]
GREEDY = {"temperature": 0}


class Cluster:
    """The router over ``survivor`` and ``victim`` (both shared), the one the fault test kills and
    restarts."""

    def __init__(self, tmp, survivor: Server, victim: Server):
        self.tmp = tmp
        self.victim_args = command_args(VICTIM_ARGS, tmp)  # its restart's
        self.workers = [survivor, victim]
        self.restarted = None
        port = free_port()
        urls = [w.url for w in self.workers]
        self.router = ServerProcess(
            launch_router.command(port, urls, *ROUTER_ARGS),
            tmp / "router.log",
            port=port,
            env=dict(os.environ),
            cwd=tmp,
        )
        self.router.wait_healthy(120, path="/health", poll_s=0.25)
        self.wait_workers(healthy=set(urls))

    @property
    def url(self) -> str:
        return self.router.url

    def worker_health(self) -> dict[str, bool]:
        r = requests.get(self.url + "/workers", timeout=30)
        r.raise_for_status()
        return {w["url"]: w["is_healthy"] for w in r.json()["workers"]}

    def wait_workers(self, healthy: set[str], timeout: float = 60) -> dict[str, bool]:
        """Poll the router's worker list until exactly ``healthy`` are healthy in it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.worker_health()
            if {u for u, ok in seen.items() if ok} == healthy:
                return seen
            time.sleep(0.5)
        raise TimeoutError(f"router's workers {seen}, wanted healthy {healthy}\n{self.router.log_tail()}")

    def stop(self):
        self.router.stop()
        if self.restarted is not None:  # the pool stops the shared ones
            self.restarted.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, survivor, victim):
    c = Cluster(tmp_path_factory.mktemp("router"), survivor, victim)
    try:
        yield c
    finally:
        c.stop()


def generate(url: str, body: dict, timeout: float = 300) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=timeout)


def test_generate_and_openai_routes_through_the_router(cluster):
    worker = cluster.workers[0]
    body = {"text": long_prompt(4), "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    routed = generate(cluster.url, body)
    assert routed.status_code == 200, routed.text  # the router's "model": null was a 400 before
    assert routed.json()["output_ids"] == generate(worker.url, body).json()["output_ids"]
    assert generate(worker.url, {**body, "model": "any"}).status_code == 200

    chat = requests.post(
        cluster.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **GREEDY},
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] > 0
    completion = requests.post(
        cluster.url + "/v1/completions",
        json={"model": "m", "prompt": "Once upon a time", "max_tokens": 4, **GREEDY},
        timeout=300,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 4


def test_what_the_router_asks_of_workers(cluster):
    for _ in range(60):  # a worker refuses a flush until its scheduler saw its last batch end
        flushed = requests.post(cluster.url + "/flush_cache", timeout=60)
        if flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2:
            break
        time.sleep(0.5)
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text
    loads = requests.get(cluster.url + "/get_loads", timeout=60)  # each worker's /get_load
    assert loads.status_code == 200
    assert sorted(w["worker"] for w in loads.json()["workers"]) == sorted(w.url for w in cluster.workers)
    models = requests.get(cluster.url + "/v1/models", timeout=60)
    assert models.status_code == 200 and models.json()["data"], models.text


def test_misspelled_field_and_the_routers_own_body_rules(cluster):
    worker = cluster.workers[0]
    typo = {"text": "Hi", "sampling_param": {"max_new_tokens": 2}}
    direct = generate(worker.url, typo)
    assert direct.status_code == 400
    assert "unknown field(s) ['sampling_param']" in direct.json()["error"]["message"]
    # The router parses /generate into its own typed request, which drops unknown fields before any
    # worker sees them (the same with upstream workers): the typo runs with defaults.
    assert generate(cluster.url, typo).status_code == 200
    # It refuses a batched text itself (its type for text is one string); a worker takes it.
    batch = {"text": ["Hi", "Hello"], "sampling_params": {"max_new_tokens": 2}}
    assert generate(cluster.url, batch).status_code == 422
    assert len(generate(worker.url, batch).json()) == 2


# The frontend runs select in a worker thread, which re-raises the router's refusal there.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_per_request_settings_pass_the_router_on_completions_only(cluster):
    off = {"custom_params": {"wgkv": {"admission": False}}}
    completion = requests.post(
        cluster.url + "/v1/completions",
        json={"model": "m", "prompt": "Once upon a time", "max_tokens": 2, **GREEDY, **off},
        timeout=300,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["wgkv"]["admission"] is False
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 2, **GREEDY, **off}}
    assert generate(cluster.workers[0].url, body).json()["meta_info"]["wgkv"][-1]["admission"] is False
    # The router's typed sampling parameters have no custom_params: dropped, the server's settings apply.
    assert generate(cluster.url, body).json()["meta_info"]["wgkv"][-1]["admission"] is True


def test_frontend_program_through_the_router(cluster):
    from evals.frontend_programs import run_program

    ok = run_program(cluster.url, "test_few_shot_qa", {}, max_new_tokens=8)
    assert ok["outcome"] in ("ok", "answer") and not ok["failures"], ok
    # select scores its choices in one batched /generate, which the router refuses (422).
    select = run_program(cluster.url, "test_select", {"check_answer": False}, max_new_tokens=8)
    assert select["outcome"] == "error" and select["server_healthy_after"], select
    assert "text: invalid type: sequence" in " ".join(select["failures"]), select


def conversation_trace(turns: int = 4) -> list[str]:
    """Three conversations (two share a system prompt), interleaved turn by turn; each turn's prompt
    extends the previous one by a fixed exchange of about 70 tokens."""
    systems = [long_prompt(14, seed=0), long_prompt(14, seed=0), long_prompt(14, seed=2)]
    prompts = []
    history = list(systems)
    for turn in range(turns):
        for c in range(len(history)):
            history[c] += f" User {c} turn {turn}: {long_prompt(5, seed=10 * c + turn)}"
            prompts.append(history[c])
            history[c] += f" Assistant: answer {c}.{turn}."
    return prompts


def run_trace(url: str, prompts: list[str]) -> tuple[int, int]:
    """Sequential greedy requests; (cached prompt tokens, prompt tokens) summed."""
    cached = total = 0
    for p in prompts:
        r = generate(url, {"text": p, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        cached, total = cached + meta["cached_tokens"], total + meta["prompt_tokens"]
    return cached, total


def radix_hit_tokens(server) -> int:
    return server.wgkv_stats()["radix"]["prefix_hit_tokens"]


def test_prefix_hits_through_the_router_match_one_server(cluster):
    prompts = conversation_trace()
    one = cluster.workers[0]
    flush_cache(one)
    single_cached, total = run_trace(one.url, prompts)
    for w in cluster.workers:
        flush_cache(w)
    before = sum(radix_hit_tokens(w) for w in cluster.workers)
    routed_cached, routed_total = run_trace(cluster.url, prompts)
    served_hits = sum(radix_hit_tokens(w) for w in cluster.workers) - before
    print(
        f"\nprefix-hit tokens: one server {single_cached}/{total}, "
        f"router over two {routed_cached}/{routed_total} (radix stats {served_hits})"
    )
    assert routed_total == total and single_cached > 0.4 * total
    assert routed_cached >= 0.8 * single_cached
    assert served_hits == routed_cached  # the hits are radix_ext's snapshot restores
    for w in cluster.workers:
        w.wait_idle_checked()


def _send(url: str, prompt: str, results: list, i: int) -> None:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, **GREEDY}}
    try:
        r = generate(url, body, timeout=240)
        results[i] = (r.status_code, r.text[:300])
    except requests.RequestException as e:
        results[i] = ("client", repr(e)[:300])


def _stream(url: str, prompt: str, results: list, i: int) -> None:
    """A streamed request: ("stream", completion tokens of its last event, whether [DONE] came, the
    client's error)."""
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, **GREEDY},
    }
    last, done, error = None, False, None
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=240) as r:
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data:"):
                    last = line
    except requests.RequestException as e:
        error = repr(e)[:200]
    tokens = json.loads(last[len(b"data:") :])["meta_info"]["completion_tokens"] if last else None
    results[i] = ("stream", tokens, done, error)


def test_worker_killed_under_load_then_restarted(cluster):
    survivor, victim = cluster.workers
    for w in cluster.workers:
        flush_cache(w)
    n = 8  # the last two streamed
    results: list = [None] * n
    threads = [
        threading.Thread(
            target=_send if i < n - 2 else _stream,
            args=(cluster.url, f"Story {i}. {long_prompt(3, seed=i)}", results, i),
        )
        for i in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while victim.wgkv_stats()["active_requests"] == 0:
        assert time.monotonic() < deadline, "the router sent no request to the second worker"
        time.sleep(0.2)
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), f"requests hung: {results}"
    print(f"\nin flight when a worker was killed: {results}")
    for status, text in results[: n - 2]:  # answered, or a 5xx with a message: never an empty success
        assert status == 200 or (isinstance(status, int) and status >= 500 and text), (status, text)
    assert any(status == 200 for status, _ in results[: n - 2])
    for _, tokens, done, error in results[n - 2 :]:  # complete, or visibly not: no [DONE] after a cut
        assert (tokens == 48) == done or (error and not done), results[n - 2 :]

    cluster.wait_workers(healthy={survivor.url}, timeout=30)
    after = [
        generate(cluster.url, {"text": f"After {i}.", "sampling_params": {"max_new_tokens": 4}})
        for i in range(4)
    ]
    assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
    survivor.wait_idle_checked()

    victim.stop()
    restarted = Server(cluster.victim_args, cluster.tmp / "worker1-restarted.log", port=victim.port)
    cluster.workers[1] = cluster.restarted = restarted
    restarted.wait_healthy()
    cluster.wait_workers(healthy={survivor.url, restarted.url}, timeout=60)
    # cache_aware sends a prompt that matches no worker's prefixes to the worker with the smallest
    # prefix tree: distinct prompts grow the survivor's until the restarted worker's is smaller.
    # "started" counts a request once its slot is allocated (released may lag the response).
    served_before = restarted.wgkv_stats()["requests_started"]
    served = 0
    for i in range(24):
        r = generate(
            cluster.url,
            {"text": f"{i} Rejoin: {long_prompt(4, seed=30 + i)}", "sampling_params": {"max_new_tokens": 2}},
        )
        assert r.status_code == 200, r.text
        served = restarted.wgkv_stats()["requests_started"] - served_before
        if served:
            break
    assert served, "the restarted worker got no request"
    for w in cluster.workers:
        w.wait_idle_checked()
