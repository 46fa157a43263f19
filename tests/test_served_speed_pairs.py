"""benchmarks/served_speed.py merge: a workload's runs are compared only when both ran the workload's
current server arguments and started within one lease."""

import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import served_speed as ss  # noqa: E402


def _rec(server_args: str, date: str) -> dict:
    return {"server_command": shlex.join(["python", "-m", "x", "--port", "1", *shlex.split(server_args)]),
            "date_utc": date}


def test_one_lease_same_arguments_pass():
    w = ss.WORKLOADS["W4L"]
    ss.check_comparable({"W4L": {"wgkv": _rec(w.server + " " + w.wgkv, "2026-12-03T22:31:00+00:00"),
                                 "upstream": _rec(w.server, "2026-12-03T22:46:00+00:00")}})


def test_changed_definition_is_refused():
    old = "--context-length 8192 --cuda-graph-max-bs-decode 64 --max-running-requests 64 --mem-fraction-static 0.19"
    with pytest.raises(ValueError, match="without the workload's arguments"):
        ss.check_comparable({"W4": {"wgkv": _rec(ss.WORKLOADS["W4"].server, "2026-12-03T22:31:00+00:00"),
                                    "upstream": _rec(old, "2026-12-03T22:46:00+00:00")}})


def test_two_leases_are_refused():
    w = ss.WORKLOADS["W3"]
    with pytest.raises(ValueError, match="not one lease"):
        ss.check_comparable({"W3": {"wgkv": _rec(w.server, "2026-12-02T07:00:00+00:00"),
                                    "upstream": _rec(w.server, "2026-12-02T09:00:00+00:00")}})
