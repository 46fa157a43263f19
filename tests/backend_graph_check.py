"""The ``wgkv`` backend's CUDA-graph decode bookkeeping against its eager reference decode, on CPU.

Run as a script under the Triton interpreter (``TRITON_INTERPRET=1`` must precede the kernel
imports), by :mod:`tests.test_backend_graph_cpu`::

    TRITON_INTERPRET=1 python tests/backend_graph_check.py

Two identical pools hold three prefilled requests (one past W_local, so with global pages; slot 0 is
SGLang's padding row). Backend A decodes them eagerly on the reference path; backend B runs what a
decode CUDA graph runs: capture preparation (every row padding) plus two warm-up forwards, then the
replay preparation for a batch of 3 padded to 5 and the per-layer kernels path (``folded_decode``
with the ring write fused, the gate + admission in one launch - DecodeGate's, then in a second run
the prefill gate's tensor-core launch and a non-default split-kernel launch shape - and the flags'
write; the reference path runs the torch gate). Checks: capture and warm-up leave every live request's pool
state untouched; the replay gives A's attention outputs and pool state (per-request tau included);
the evictor's window records the same queries. Prints ``OK`` or raises.
"""

import copy
from types import SimpleNamespace

import torch
from interp_decode_check import pages_match
from interp_gate_check import make_gates

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import paged_decode_attention
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.backend.decode_layer import SCRATCH_SLOT, DecodeRows
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.evictor import SnapKVEvictor
from sglang_wgkv.testing.backend_harness import Mode, bare_backend, decode_batch
from sglang_wgkv.testing.backend_harness import layer_of as harness_layer

L, H, HQ, D, W = 2, 2, 4, 64, 32
DT = torch.bfloat16
SLOTS, PLENS = [3, 1, 2], [45, 20, 33]  # batch order != slot order
TAU = {1: float("-inf"), 2: 0.5, 3: 0.3}  # per-request thresholds (slot 1: admission off)


GATES = make_gates(D, H, 2 * D, seed=5, device="cpu")  # real write gates with varied decisions


def make_backend(
    pool: DualCachePool,
    use_kernels: bool,
    tensor_core_gate: bool = False,
    decode_launch: str = "",
    evictor_rows: int | None = None,
):
    """``tensor_core_gate``: the decode gate of every batch is the prefill gate's launch
    (:meth:`PrefillGate.admit`; served from ``DECODE_MIN_ROWS`` (row, head) pairs a step);
    ``decode_launch``: the split kernel's launch shape (``--wgkv-decode-launch``); ``evictor_rows``:
    an evictor without a server budget whose window has that many rows (the first slots are bound),
    which the split kernel writes through the evictor's slot-to-row map."""
    slot_tau = torch.full((pool.max_requests,), pool.config.tau)
    for r, t in TAU.items():
        slot_tau[r] = t
    evictor = SnapKVEvictor(
        pool=pool,
        budget=10_000 if evictor_rows is None else None,
        num_q_heads=HQ,
        window=16,
        rows=evictor_rows,
    )
    b = bare_backend(
        pool,
        GATES,
        use_kernels=use_kernels,
        slot_tau=slot_tau,
        num_q_heads=HQ,
        evictor=evictor,
        tensor_core_gate=tensor_core_gate,
        decode_launch=decode_launch,
    )
    for slot in SLOTS[: evictor_rows or 0]:
        b.evictor.bound_request(slot, 10_000)
    return b


def build_pool(kv_dtype=None) -> DualCachePool:
    """``kv_dtype``: FP8 pages (per-layer scales) read by the model's DT, else DT pages."""
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=200,
        max_requests=5,
        max_context_len=96,
        config=WGKVConfig(local_window=W, tau=0.1),
        dtype=kv_dtype or DT,
        compute_dtype=DT,
    )
    if pool.quantized:
        pool.set_kv_scales([0.7, 1.9][:L] + [1.0] * (L - 2), [1.4, 0.6][:L] + [1.0] * (L - 2))
    gen = torch.Generator().manual_seed(0)
    for r in SLOTS:
        pool.alloc_request(r)
    pool.begin_extend(SLOTS, [0, 0, 0], PLENS)
    n = sum(PLENS)
    for layer in range(L):
        k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
        pool.write_extend(layer, k, v, torch.rand(n, H, generator=gen) < 0.5)
    return pool


def layer_of(i):
    return harness_layer(i, HQ, H, D)


def run_layers(backend, fb, q, k, v):
    return [backend.forward_decode(q[i], k[i], v[i], layer_of(i), fb) for i in range(L)]


def live_state(pool):
    """Pool state of the live request slots and the allocator (the dump page excluded)."""
    live = torch.tensor(SLOTS)
    return {
        "page_table": pool.page_table[live].clone(),
        "global_len": pool.global_len[live].clone(),
        "ring_flag": pool.ring_flag[live].clone(),
        "k": pool.k_pages[:-1].clone(),
        "v": pool.v_pages[:-1].clone(),
        "ref": pool.allocator.ref.clone(),
        "num_free": pool.allocator.num_free.clone(),
        "cached_len": pool.cached_len.copy(),
    }


def assert_same(a, b, what):
    for key in a:
        if key in ("k", "v"):  # FP8 pages: within the interpreter's FP8 rounding (pages_match)
            assert pages_match(b[key], a[key], exact=False), f"{what}: {key} differs"
            continue
        same = (a[key] == b[key]).all() if isinstance(a[key], torch.Tensor) else (a[key] == b[key]).all()
        assert bool(same), f"{what}: {key} differs"


def main(tensor_core_gate: bool, decode_launch: str = "", evictor_rows: int | None = None, kv_dtype=None):
    pool_a = build_pool(kv_dtype)
    pool_b = copy.deepcopy(pool_a)
    pool_b.triton_decode = True  # the kernels path's pool: Triton promotion and ring write (interpreted)
    a, b = (
        make_backend(pool_a, use_kernels=False, evictor_rows=evictor_rows),
        make_backend(pool_b, True, tensor_core_gate, decode_launch, evictor_rows=evictor_rows),
    )
    gen = torch.Generator().manual_seed(1)
    B, BS = len(SLOTS), 5

    # -- capture: every row padding; the forwards of warm-up and capture must not touch live state
    b.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    before = live_state(pool_b)
    cap = SimpleNamespace(
        forward_mode=Mode("decode"),
        batch_size=BS,
        num_padding=0,
        req_pool_indices=torch.zeros(BS, dtype=torch.int64),
        seq_lens=torch.ones(BS, dtype=torch.int64),
        seq_lens_cpu=torch.ones(BS, dtype=torch.int64),
    )
    b.init_forward_metadata_out_graph(cap, in_capture=True)
    assert (b._rows.req == SCRATCH_SLOT).all() and (b._rows.ring == 1).all()
    for _ in range(2):
        out = run_layers(b, cap, *(torch.randn(L, BS, n * D, generator=gen).to(DT) for n in (HQ, H, H)))
        assert all(torch.isfinite(o.float()).all() for o in out)
    assert_same(before, live_state(pool_b), "capture/warm-up")
    assert not pool_b.active[SCRATCH_SLOT] and bool(
        (pool_b.page_table[SCRATCH_SLOT] == pool_b.dump_page).all()
    )

    # -- one step: A eager reference, B replay preparation of 3 rows padded to 5 + kernels path
    seq = torch.tensor(PLENS) + 1
    q, k, v = (torch.randn(L, B, n * D, generator=gen).to(DT) for n in (HQ, H, H))
    fb_a = decode_batch(SLOTS, seq)
    a.init_forward_metadata(fb_a)
    out_a = run_layers(a, fb_a, q, k, v)

    pad = lambda t, fill: torch.cat([t, torch.full((BS - B,), fill, dtype=t.dtype)])  # noqa: E731
    view = SimpleNamespace(
        forward_mode=Mode("decode"),
        batch_size=BS,
        num_padding=BS - B,
        req_pool_indices=pad(torch.tensor(SLOTS), 0),
        seq_lens=pad(seq, 1),
        seq_lens_cpu=pad(seq, 1),
    )
    b.batch_slots = list(SLOTS)
    b.init_forward_metadata_out_graph(view)
    rows: DecodeRows = b._rows
    assert rows.req.tolist() == SLOTS + [SCRATCH_SLOT] * 2
    assert torch.equal(rows.tau[:B, 0], torch.tensor([TAU[r] for r in SLOTS]))
    junk = lambda t, n: torch.cat([t, torch.randn(L, BS - B, n * D, generator=gen).to(DT)], 1)  # noqa: E731
    out_b = run_layers(b, view, junk(q, HQ), junk(k, H), junk(v, H))
    assert_same(live_state(pool_a), live_state(pool_b), "replay vs eager")
    for i in range(L):
        want = out_a[i]
        if kv_dtype is not None:  # over B's own pages: the interpreter may round a new token otherwise
            rows, num_pages, last, _ = pool_b.decode_page_rows(i)
            want = paged_decode_attention(
                q[i].view(B, HQ, D), pool_b.k_pages, pool_b.v_pages, *build_folded_indices(rows, num_pages, last),
                sm_scale=D**-0.5, k_scale=pool_b.k_scale[i], v_scale=pool_b.v_scale[i],
            ).view(B, HQ * D)  # fmt: skip
        err = (out_b[i][:B].float() - want.float()).abs().max().item()
        assert err < 5e-2, f"layer {i}: graph-path output differs from the reference by {err}"
    ev_a, ev_b = a.evictor, b.evictor
    live = torch.tensor(SLOTS[: evictor_rows or len(SLOTS)])
    rows = ev_a.row[live]  # the rows the slots' queries went to (the slots themselves without rows)
    assert torch.equal(rows, ev_b.row[live]) and torch.equal(ev_a.q_pos[rows], ev_b.q_pos[rows])
    assert torch.equal(ev_a.q_buf[rows], ev_b.q_buf[rows]) and bool((ev_b.q_pos[rows] >= 0).any())
    pool_b.check_integrity()
    pages = f" ({str(kv_dtype).removeprefix('torch.')} pages)" if kv_dtype else ""
    rows_note = "" if evictor_rows is None else f", evictor window rows {evictor_rows}"
    print(f"decode gate: {'PrefillGate.admit' if tensor_core_gate else 'DecodeGate'}{pages} OK{rows_note}")


if __name__ == "__main__":
    main(False)
    main(True, decode_launch="block_n=16,num_stages=1,programs_per_sm=2")  # a served non-default shape
    main(False, evictor_rows=2)  # no server budget: windows for bound requests only
    main(False, kv_dtype=torch.float8_e4m3fn)
