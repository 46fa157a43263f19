"""The shared-server pool's bookkeeping (sglang_wgkv/testing/server_pool.py) with stand-in servers:
planned prefetch, stop after the last planned lease, no restart of a server that died (a new start
after a lease that kills its server)."""

import json
from pathlib import Path

import pytest

from sglang_wgkv.gate.checkpoint import CONFIG_FILE
from sglang_wgkv.testing.server_pool import HeadGates, ServerPool, server_key, sharing_groups

pytestmark = pytest.mark.core


class FakeServer:
    def __init__(self, args, log_path, events):
        self.args, self.log_path, self.events = args, log_path, events
        self.running, self.healthy = True, False
        events.append(("start", args[0]))

    def wait_healthy(self):
        self.healthy = True
        return self

    def alive(self):
        return self.running

    def log_tail(self):
        return "log tail"

    def stop(self):
        if self.running:
            self.running = False
            self.events.append(("stop", self.args[0]))


def _pool(tmp_path, plan, events):
    return ServerPool(tmp_path, plan=plan, launch=lambda args, log: FakeServer(args, log, events))


def test_plan_prefetches_the_next_server_and_stops_each_after_its_last_lease(tmp_path):
    a, b, c = ("a",), ("b",), ("c",)
    events = []
    pool = _pool(tmp_path, [a, b, b, c], events)
    with pool.lease(a, "m1") as server:  # b and c start while m1 runs
        assert server.healthy and events == [("start", "a"), ("start", "b"), ("start", "c")]
    assert events[-1] == ("stop", "a")
    with pool.lease(b, "m2"):
        assert events[-1] == ("stop", "a")
    assert events[-1] == ("stop", "a")  # b is planned again: kept
    with pool.lease(b, "m3") as server:
        assert server.running
    assert events[-1] == ("stop", "b")
    with pool.lease(c, "m4"):
        pass
    assert events.count(("start", "b")) == 1 and events[-1] == ("stop", "c")
    pool.close()


def test_two_servers_wait_ahead_at_most(tmp_path):
    events = []
    pool = _pool(tmp_path, [("a",), ("a",), ("b",), ("c",), ("d",)], events)
    with pool.lease(("a",), "m1"):
        assert events == [("start", "a"), ("start", "b"), ("start", "c")]
    with pool.lease(("a",), "m2"):
        assert ("start", "d") not in events  # b and c, started for later modules, still wait
    with pool.lease(("b",), "m3"):
        assert events[-1] == ("start", "d")
    pool.close()


def test_two_leased_servers_prefetch_a_third_three_none(tmp_path):
    events = []
    pool = _pool(tmp_path, [("a",), ("b",), ("c",), ("d",), ("e",)], events)
    with pool.lease(("a",), "m"), pool.lease(("b",), "m"):
        assert ("start", "d") in events  # c and d wait ahead of the pair
        with pool.lease(("c",), "m"):
            assert ("start", "e") not in events
    pool.close()
    assert all(("stop", name) in events for name in "abc")


def test_an_unplanned_lease_stops_at_its_end_and_a_dead_server_is_not_restarted(tmp_path):
    events = []
    pool = _pool(tmp_path, [("a",), ("a",)], events)
    with pool.lease(("x",), "m"):
        pass
    assert events == [("start", "x"), ("start", "a"), ("stop", "x")]
    with pool.lease(("a",), "m1") as server:
        server.running = False  # killed by a leak the idle check found
    with pytest.raises(RuntimeError, match=r"died after use by \['m1'\]"):
        with pool.lease(("a",), "m2"):
            pass
    pool.close()


def test_a_killing_lease_drops_its_server_and_a_later_lease_starts_another(tmp_path):
    events = []
    pool = _pool(tmp_path, [("a",), ("a",), ("a",)], events)
    with pool.lease(("a",), "m1"):
        pass
    with pool.lease(("a",), "m2", kills=True) as server:
        server.running = False  # a fault test kills it
    with pool.lease(("a",), "m3") as server:
        assert server.running
    assert events == [("start", "a"), ("start", "a"), ("stop", "a")]
    pool.close()


class NeverHealthy(FakeServer):
    def wait_healthy(self):
        raise RuntimeError("server exited with 3: address already in use")


def test_a_server_that_never_gets_healthy_raises_its_own_error_and_is_stopped(tmp_path):
    events = []
    pool = ServerPool(tmp_path, plan=[("a",)], launch=lambda args, log: NeverHealthy(args, log, events))
    with pytest.raises(RuntimeError, match="address already in use"):
        with pool.lease(("a",), "m"):
            pass
    assert events == [("start", "a"), ("stop", "a")]
    pool.close()


def test_free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice():
    from sglang_wgkv.server_process import _ephemeral_range, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not any(port in _ephemeral_range() for port in ports)


def test_gate_specs_are_part_of_the_key_and_saved_per_server(tmp_path):
    assert server_key(["--wgkv-gates", HeadGates((30.0, -30.0), 16)]) != server_key(
        ["--wgkv-gates", HeadGates((30.0, -30.0), 32)]
    )
    events = []
    pool = _pool(tmp_path, [], events)
    with pool.lease(("--wgkv-gates", HeadGates((30.0, -30.0, -30.0), 16)), "m") as server:
        config = json.loads((Path(server.args[1]) / CONFIG_FILE).read_text())
        assert config["local_window"] == 16 and config["num_kv_heads"] == 3
    pool.close()


def test_modules_sharing_a_server_through_others_form_one_group():
    keys = {"a": ["k1"], "plain": [], "b": ["k2"], "c": ["k3", "k2"], "d": ["k1", "k3"], "e": ["k4"]}
    # a-d share k1, c-d k3, b-c k2: one group, named by its first module; e alone; plain in none
    assert sharing_groups(keys) == {"a": "a", "b": "a", "c": "a", "d": "a", "e": "e"}
    assert sharing_groups({"x": ["k"], "y": ["k"]}) == {"x": "x", "y": "x"}


def test_server_env_goes_to_the_launch_not_the_command_and_keys_the_server(tmp_path):
    from sglang_wgkv.testing.server_pool import ServerEnv

    launches = []
    pool = ServerPool(
        tmp_path, launch=lambda args, log, **kw: launches.append((args, kw)) or FakeServer(args, log, [])
    )
    env = ServerEnv.of(B="2", A="1")
    with pool.lease(("a", env), "m"):
        assert launches == [(["a"], {"env": {"A": "1", "B": "2"}})]
    with pool.lease(("a",), "m"):
        assert launches[-1] == (["a"], {})
    assert server_key(("a", env)) != server_key(("a",)) == server_key(("a",))
    assert server_key(("a", env)) == server_key(("a", ServerEnv.of(A="1", B="2")))
    pool.close()
