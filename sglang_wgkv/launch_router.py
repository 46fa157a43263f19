"""Start SGLang's router in front of WG-KV servers once its workers are checked:
``python -m sglang_wgkv.launch_router [sglang_router.launch_router arguments]``.

The arguments are the router's own (``--worker-urls``, ``--policy``, ...); they are parsed by the
router's parser, checked here, then this process becomes ``python -m sglang_router.launch_router``
with the same arguments. Each refusal is a message on stderr and exit status 2, before the router
starts:

==============================  =========================================================================
check                           refused when
==============================  =========================================================================
each worker URL                 not http(s); no answer within ``--worker-startup-timeout-secs``;
                                ``/server_info`` answered, but not with an SGLang server's JSON
                                (``version`` and ``model_path``); ``/health`` not 200 by the deadline
the workers agree               different ``model_path``; WG-KV servers mixed with dense ones; WG-KV
                                servers with different admission settings (τ, W_local, random
                                admission, ``--kv-budget``): one request's answer would depend on the
                                worker the router picks
the routing mode                ``--pd-disaggregation`` with WG-KV workers (the dual pool's pages are
                                not what SGLang's KV transfer engines send); a policy outside
                                :data:`SERVED_POLICIES`
==============================  =========================================================================

With ``--service-discovery`` the workers are not known at start-up, and workers added later through
the router's own API are not seen here: neither is checked.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

# Policies that send a whole request to one worker and ask it only what upstream SGLang answers
# (power_of_two reads /get_load); each served by WG-KV servers as by upstream ones.
SERVED_POLICIES = frozenset({"cache_aware", "round_robin", "random", "power_of_two", "manual"})
# The WG-KV settings that change a request's answer; workers behind one router must agree on them.
ADMISSION_SETTINGS = ("tau", "local_window", "random_admission", "kv_budget")
PROBE_TIMEOUT_S = 10.0
RETRY_INTERVAL_S = 1.0


class RouterSetupError(ValueError):
    """A worker or a router setting that the router must not be started with; the message says why."""


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What ``/server_info`` says about one worker: ``admission`` is None for a dense SGLang server,
    else its WG-KV settings (:data:`ADMISSION_SETTINGS`)."""

    url: str
    version: str
    model_path: str
    admission: tuple[tuple[str, object], ...] | None

    @classmethod
    def from_server_info(cls, url: str, info) -> WorkerInfo:
        if not isinstance(info, dict) or not isinstance(info.get("version"), str) or "model_path" not in info:
            raise RouterSetupError(
                f"{url} is not an SGLang server: its /server_info has no 'version' and 'model_path'"
            )
        admission = None
        if info.get("attention_backend") == "wgkv":
            states = info.get("internal_states") or [{}]
            stats = states[0].get("wgkv") if isinstance(states[0], dict) else None
            if not isinstance(stats, dict):
                raise RouterSetupError(f"{url} runs the wgkv attention backend but reports no WG-KV stats")
            admission = tuple((name, stats.get(name)) for name in ADMISSION_SETTINGS)
        return cls(url=url, version=info["version"], model_path=str(info["model_path"]), admission=admission)

    def describe(self) -> str:
        kind = "dense SGLang" if self.admission is None else f"WG-KV {dict(self.admission)}"
        return f"{self.url}: {kind}, model {self.model_path}, SGLang {self.version}"


def probe_worker(url: str, deadline: float) -> WorkerInfo:
    """Poll ``url`` until it answers ``/server_info`` and ``/health`` (a worker may still be starting);
    RouterSetupError at once when it answers as something else than an SGLang server, or at
    ``deadline`` (``time.monotonic()``) when it has not answered."""
    import requests

    if not url.startswith(("http://", "https://")):
        raise RouterSetupError(f"{url} is not an http:// or https:// URL")
    last = "no answer"
    info = None
    while True:
        try:
            if info is None:
                r = requests.get(url + "/server_info", timeout=PROBE_TIMEOUT_S)
                if r.status_code == 503:
                    last = "/server_info answered 503 (starting)"
                elif r.status_code != 200:
                    raise RouterSetupError(
                        f"{url} is not an SGLang server: /server_info answered {r.status_code}"
                    )
                else:
                    try:
                        body = r.json()
                    except ValueError:
                        raise RouterSetupError(
                            f"{url} is not an SGLang server: /server_info is not JSON"
                        ) from None
                    info = WorkerInfo.from_server_info(url, body)
            if info is not None:
                r = requests.get(url + "/health", timeout=PROBE_TIMEOUT_S)
                if r.status_code == 200:
                    return info
                last = f"/health answered {r.status_code}"
        except requests.RequestException as e:
            last = f"{type(e).__name__}"
        if time.monotonic() >= deadline:
            raise RouterSetupError(f"{url} did not answer as a healthy SGLang server in time ({last})")
        time.sleep(RETRY_INTERVAL_S)


def check_workers(workers: list[WorkerInfo]) -> None:
    """RouterSetupError unless every worker serves the same model with the same admission settings."""
    first = workers[0]
    for other in workers[1:]:
        if other.model_path != first.model_path:
            raise RouterSetupError(
                f"the workers serve different models:\n  {first.describe()}\n  {other.describe()}\n"
                "start one router per model"
            )
        if other.admission != first.admission:
            raise RouterSetupError(
                "the workers would answer one request differently (a request's answer must not depend "
                f"on the worker the router picks):\n  {first.describe()}\n  {other.describe()}"
            )


def check_routing(router_args, workers: list[WorkerInfo]) -> None:
    """RouterSetupError for a routing mode or policy that WG-KV workers cannot serve."""
    wgkv = [w.url for w in workers if w.admission is not None]
    if not wgkv:
        return
    if router_args.pd_disaggregation:
        raise RouterSetupError(
            f"--pd-disaggregation with WG-KV workers ({', '.join(wgkv)}): prefill/decode disaggregation "
            "moves KV pages with SGLang's transfer engines, which do not know WG-KV's dual pool; "
            f"run regular routing (--worker-urls, --policy one of {sorted(SERVED_POLICIES)})"
        )
    if router_args.policy not in SERVED_POLICIES:
        raise RouterSetupError(
            f"--policy {router_args.policy} is not served by WG-KV workers; "
            f"use one of {sorted(SERVED_POLICIES)}"
        )


def worker_urls(router_args) -> list[str]:
    """Every worker URL the router is given (regular and PD mode), without a trailing slash."""
    urls = list(router_args.worker_urls)
    urls += [url for url, *_ in router_args.prefill_urls] + list(router_args.decode_urls)
    return [u.rstrip("/") for u in urls]


def command(port: int, worker_urls: list[str], *router_args: str) -> list[str]:
    """This launcher on ``127.0.0.1:port`` in front of ``worker_urls``, with the router's own arguments."""
    return [
        sys.executable,
        "-m",
        "sglang_wgkv.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        *router_args,
    ]


def check_setup(argv: list[str]) -> list[WorkerInfo]:
    """Parse ``argv`` with the router's own parser and run every check; the workers checked."""
    from sglang_router.launch_router import parse_router_args

    router_args = parse_router_args(argv)
    urls = worker_urls(router_args)
    if router_args.service_discovery or not urls:
        return []
    deadline = time.monotonic() + router_args.worker_startup_timeout_secs
    workers = [probe_worker(url, deadline) for url in urls]
    check_workers(workers)
    check_routing(router_args, workers)
    return workers


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        workers = check_setup(argv)
    except RouterSetupError as e:
        print(f"sglang_wgkv.launch_router: refused: {e}", file=sys.stderr)
        sys.exit(2)
    for w in workers:
        print(f"sglang_wgkv.launch_router: worker {w.describe()}", file=sys.stderr)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "sglang_router.launch_router", *argv])


if __name__ == "__main__":
    main()
