"""A prefill whose requests all keep every token (``custom_params.wgkv = {"admission": false}``, W0's
protocol) runs no write gate: the backend admits every row at once, and the outputs and the pool end
as when the gate runs under ``tau = -inf``; a batch with one request admitting runs the gate."""

from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.gate import GateConfig, WriteGates
from sglang_wgkv.integration.requests.control import RequestAdmission
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.testing.backend_harness import bare_backend, extend_batch, layer_of

pytestmark = pytest.mark.core

L, H, HQ, D, W = 2, 2, 4, 16, 16
SLOTS, LENS = [1, 2], [40, 25]


class CountingGates(WriteGates):
    calls = 0

    def forward(self, *args):
        CountingGates.calls += 1
        return super().forward(*args)


def _run(admission_off: list[bool], with_admissions: bool):
    pool = DualCachePool(L, H, D, 200, 4, 128, WGKVConfig(local_window=W, tau=0.5))
    gates = CountingGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=2 * D)).eval()
    gates.requires_grad_(False)
    tau = torch.full((4,), 0.5)
    admissions = [RequestAdmission()] * 4
    for slot, off in zip(SLOTS, admission_off):
        if off:
            tau[slot] = float("-inf")
            admissions[slot] = RequestAdmission(admission=False)
    backend = bare_backend(pool, gates, use_kernels=False, slot_tau=tau, num_q_heads=HQ)
    if with_admissions:
        backend.req_pool = SimpleNamespace(slot_tau=tau, slot_admission=admissions)
    for r in SLOTS:
        pool.alloc_request(r)
    gen = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in LENS])
    fb = extend_batch("extend", SLOTS, [0, 0], LENS, positions)
    backend.batch_slots = list(SLOTS)
    backend.init_forward_metadata(fb)
    outs = []
    for i in range(L):
        q, k, v = (torch.randn(sum(LENS), c * D, generator=gen) for c in (HQ, H, H))
        outs.append(backend.forward_extend(q, k, v, layer_of(i, HQ, H, D), fb))
    state = [pool.gather_context(layer, r, n) for layer in range(L) for r, n in zip(SLOTS, LENS)]
    return outs, state, pool


def test_all_kept_runs_no_gate_and_equals_the_gated_run():
    CountingGates.calls = 0
    skipped = _run([True, True], with_admissions=True)
    assert CountingGates.calls == 0
    gated = _run([True, True], with_admissions=False)  # no host admissions: the gate runs at tau -inf
    assert CountingGates.calls == L
    for a, b in zip(skipped[0], gated[0]):
        assert torch.equal(a, b)
    for a, b in zip(skipped[1], gated[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    pool = skipped[2]  # every token kept: each stream's global entries are all the tokens past the ring
    for r, n in zip(SLOTS, LENS):
        assert (pool.global_len[r] == n - W).all() and bool(pool.ring_flag[r].all())


def test_one_admitting_request_runs_the_gate():
    CountingGates.calls = 0
    _run([True, False], with_admissions=True)
    assert CountingGates.calls == L
