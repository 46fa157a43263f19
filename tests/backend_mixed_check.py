"""The ``wgkv`` backend's mixed forward (SGLang's MIXED batch: prefill rows, then decode rows) on the
kernels path against separate extend and decode forwards on the reference path, on CPU.

Run as a script under the Triton interpreter (``TRITON_INTERPRET=1`` must precede the kernel
imports), by :mod:`tests.test_backend_graph_cpu`::

    TRITON_INTERPRET=1 python tests/backend_mixed_check.py

Two identical pools hold three decoding requests (one past W_local, so with global pages), and a new
request on slot 4 prefills 40 tokens (past W_local). Backend A (reference path) runs the prefill as an
extend forward, then the decode step as a decode forward. Backend B (kernels path: Triton
``folded_decode`` with the fused ring write, the prefill gate's launch deciding the prefill rows' and
the decode rows' flags as on a GPU, Triton promotion) runs both in one mixed
forward, as SGLang hands it: ``forward_extend`` over the packed rows, the decode rows last. Checks:
B's prefill rows and decode rows give A's outputs, the pools end in the same state, the evictor's
windows hold the same queries, and the pool counted one mixed forward. Prints ``OK`` or raises.
"""

import copy

import torch
from backend_graph_check import (
    DT,
    HQ,
    PLENS,
    SLOTS,
    D,
    H,
    L,
    assert_same,
    build_pool,
    layer_of,
    make_backend,
)

from sglang_wgkv.attention import reference
from sglang_wgkv.memory.extend_step import FAR_POSITION
from sglang_wgkv.testing.backend_harness import decode_batch, extend_batch

NEW_SLOT, PROMPT = 4, 40


def pool_state(pool, live):
    """The live slots' contents in cache order (page ids differ with the allocation order: the mixed
    forward promotes its decode rows before the prefill rows' layers allocate) and the free pages."""
    state = {
        "global_len": pool.global_len[live].clone(),
        "ring_flag": pool.ring_flag[live].clone(),
        "num_free": pool.allocator.num_free.clone(),
        "cached_len": pool.cached_len.copy(),
    }
    for r in live.tolist():
        for layer in range(pool.num_layers):
            k, v, pos, admitted = pool.gather_context(layer, r, int(pool.cached_len[r]))
            valid = (admitted | (pos != FAR_POSITION)[:, None])[..., None]  # not a global page's padding
            state[f"context {r} {layer}"] = torch.cat([(k * valid).flatten(), (v * valid).flatten()]).float()
            state[f"positions {r} {layer}"] = torch.cat([pos, admitted.flatten().long()])
    return state


def main():
    pool_a = build_pool()
    pool_b = copy.deepcopy(pool_a)
    pool_b.triton_decode = True  # the kernels path's pool: Triton promotion and ring write (interpreted)
    for pool in (pool_a, pool_b):
        pool.alloc_request(NEW_SLOT)
    a, b = (
        make_backend(pool_a, use_kernels=False),
        make_backend(pool_b, use_kernels=True, tensor_core_gate=True),
    )
    for backend in (a, b):  # both prefills on the torch reference: the decode rows are what differs
        backend._prefill = reference.vertical_slash_attention
    gen = torch.Generator().manual_seed(3)
    B = len(SLOTS)
    qe, ke, ve = (torch.randn(L, PROMPT, n * D, generator=gen).to(DT) for n in (HQ, H, H))
    qd, kd, vd = (torch.randn(L, B, n * D, generator=gen).to(DT) for n in (HQ, H, H))
    pos_e = torch.arange(PROMPT)

    # A: an extend forward, then a decode forward (reference path)
    fb = extend_batch("extend", [NEW_SLOT], [0], [PROMPT], pos_e)
    a.batch_slots = [NEW_SLOT]
    a.init_forward_metadata(fb)
    want_e = [a.forward_extend(qe[i], ke[i], ve[i], layer_of(i), fb) for i in range(L)]
    fb = decode_batch(SLOTS, [p + 1 for p in PLENS])
    a.init_forward_metadata(fb)
    want_d = [a.forward_decode(qd[i], kd[i], vd[i], layer_of(i), fb) for i in range(L)]

    # B: one mixed forward (prefill rows first, the decode rows as one-token extends at the end)
    slots = [NEW_SLOT, *SLOTS]
    fb = extend_batch("mixed", slots, [0, *PLENS], [PROMPT, 1, 1, 1], torch.cat([pos_e, torch.tensor(PLENS)]))
    b.batch_slots, b.batch_decode_rows = list(slots), B
    b.init_forward_metadata(fb)
    got = [
        b.forward_extend(
            torch.cat([qe[i], qd[i]]), torch.cat([ke[i], kd[i]]), torch.cat([ve[i], vd[i]]), layer_of(i), fb
        )
        for i in range(L)
    ]
    live = torch.tensor([*SLOTS, NEW_SLOT])
    for i in range(L):
        assert got[i].shape == (PROMPT + B, HQ * D)
        assert torch.equal(got[i][:PROMPT], want_e[i]), f"layer {i}: prefill rows differ"
        err = (got[i][PROMPT:].float() - want_d[i].float()).abs().max().item()
        assert err < 5e-2, f"layer {i}: mixed decode rows differ from the reference decode by {err}"
    assert_same(pool_state(pool_a, live), pool_state(pool_b, live), "mixed vs separate")
    ev_a, ev_b = a.evictor, b.evictor
    assert torch.equal(ev_a.q_pos[live], ev_b.q_pos[live]) and torch.equal(ev_a.q_buf[live], ev_b.q_buf[live])
    assert pool_b.mixed_forwards == 1 and pool_b.mixed_prefill_tokens_max == PROMPT
    pool_b.check_integrity()
    print("mixed forward: kernels path OK")


if __name__ == "__main__":
    main()
