"""Triton split-KV decode over the dual-cache pool (:mod:`sglang_wgkv.attention.triton_decode`)
against the reference paged decode: on the CPU through Triton's interpreter (core), on CUDA at
larger sizes and under CUDA-graph capture/replay (gpu)."""

import json
import os

import pytest
import torch
from interp_decode_check import CASES, PoolCase, close

from sglang_wgkv.testing.interp import InterpCheck

HERE = os.path.dirname(os.path.abspath(__file__))
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)")
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter is the CPU CI stand-in; on a GPU host the compiled kernels are tested (gpu marker), and Triton 3.6's interpreter fails there under the device's NumPy (only 0-dimensional arrays can be converted to Python scalars)",
)


# -- CPU: Triton interpreter (one process for all cases: TRITON_INTERPRET=1 must precede the import) -
DECODE_RUN = InterpCheck(os.path.join(HERE, "interp_decode_check.py"), tuple(sorted(CASES)), timeout=900)


@pytest.fixture(scope="module")
def interpreted_rows(interp_runner):
    """Every case's rows (one JSON line per comparison) from one interpreter process."""
    proc = interp_runner.result(DECODE_RUN)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, rows


@pytest.mark.core
@CPU_ONLY
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_decode_matches_reference(interpreted_rows, name):
    proc, all_rows = interpreted_rows
    rows = [r for r in all_rows if r["case"] == name]
    c = CASES[name]
    assert len(rows) == c["steps"] * 2 * len(c["launches"]) * 2 * 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    # a non-zero exit without a failed comparison anywhere: the process crashed
    assert proc.returncode == 0 or any(not r["ok"] for r in all_rows), proc.stderr[-3000:]
    # Both merges ran, with and without the fused ring write; every batch had an empty stream, and
    # some stream used fewer splits than launched.
    assert {(r["fused"], r["write_new"]) for r in rows} == {
        (a, b) for a in (True, False) for b in (True, False)
    }
    assert all(r["empty_streams"] == c["Hkv"] for r in rows) and any(r["partial_streams"] for r in rows)
    # The comparisons covered ring-only and ring + global streams, and a 1-token stream when asked.
    lens = [n for r in rows for per_req in r["kv_len"] for n in per_req]
    assert max(lens) > c["W"] and min(lens) < c["W"]
    if c["late"]:
        assert min(lens) == 1


@pytest.mark.core
def test_choose_num_splits_and_validation():
    from sglang_wgkv.attention.decode_config import MAX_SPLIT_COUNT, FoldedDecodeWorkspace, choose_num_splits
    from sglang_wgkv.attention.triton_decode import folded_decode

    # Batch 1 x 8 heads at long context: several programs per SM; large batches: few splits.
    assert choose_num_splits(1, 8, 131072) >= 32
    assert choose_num_splits(64, 8, 131072) <= 2
    assert choose_num_splits(1, 8, 100) == 1
    assert 1 <= choose_num_splits(1, 1, 10**7) <= MAX_SPLIT_COUNT
    ws = FoldedDecodeWorkspace(2, 8, 64, 4, "cpu", num_kv_heads=2)
    assert ws.part_out.shape == (2, 8, 4, 64) and ws.part_lse.shape == (2, 8, 4)
    assert ws.splits_done.shape == (2, 2) and ws.splits_done.dtype == torch.int32 and not ws.splits_done.any()
    assert FoldedDecodeWorkspace(2, 8, 64, 4, "cpu").splits_done.shape == (2, 8)  # fits any grouping
    with pytest.raises(ValueError, match="num_kv_heads"):
        FoldedDecodeWorkspace(2, 8, 64, 4, "cpu", num_kv_heads=3)
    case = PoolCase(64, 8, 2, torch.float16, 32, [40, 5], 0, 0.5, "cpu", num_layers=1)
    next(case.step())
    p = case.pool
    args = (
        case.query(),
        p.k_pages,
        p.v_pages,
        p.page_table,
        p.global_len,
        case.plan.req,
        case.plan.ring_tokens,
        0,
    )
    with pytest.raises(ValueError, match="workspace"):
        folded_decode(*args, num_splits=5, workspace=ws)
    with pytest.raises(ValueError, match="workspace"):  # the case has 2 KV heads
        folded_decode(
            *args, num_splits=4, workspace=FoldedDecodeWorkspace(2, 8, 64, 4, "cpu", num_kv_heads=1)
        )
    with pytest.raises(ValueError, match="layer"):
        folded_decode(*args[:-1], 1)
    with pytest.raises(ValueError, match="dtype"):
        folded_decode(args[0].bfloat16(), *args[1:])
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="CUDA"):
            folded_decode(*args)


# -- CUDA ------------------------------------------------------------------------------------
GPU_CASES = [
    # D, Hq, Hkv, dtype, W, prefill lengths, late joiners, admit prob
    (128, 32, 8, torch.bfloat16, 256, [6000, 300, 2500, 40], 1, 0.5),
    (64, 9, 3, torch.float16, 64, [3000, 10, 900], 1, 0.9),
    (128, 8, 8, torch.float16, 128, [1500, 129], 0, 0.25),  # group 1
    (64, 16, 8, torch.bfloat16, 64, [2000, 700], 0, 0.5),  # group 2
    (128, 32, 4, torch.bfloat16, 256, [4000, 17], 1, 0.1),  # group 8
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launch"])
@pytest.mark.parametrize("case_args", GPU_CASES, ids=lambda c: f"d{c[0]}_hq{c[1]}_hkv{c[2]}_{str(c[3])[6:]}")
def test_gpu_decode_matches_reference(case_args, fused):
    from sglang_wgkv.attention.decode_config import DecodeConfig
    from sglang_wgkv.attention.triton_decode import folded_decode

    D, Hq, Hkv, dtype, W, plens, late, p = case_args
    case = PoolCase(D, Hq, Hkv, dtype, W, plens, late, p, "cuda", num_layers=2, seed=D + Hq)
    launches = [
        (None, DecodeConfig(fused_merge=fused)),
        (1, DecodeConfig(fused_merge=fused)),
        (7, DecodeConfig(32, 4, 2, fused)),
        (64, DecodeConfig(64, 8, 3, fused)),
        (128, DecodeConfig(16, 4, 2, fused)),
        (16, DecodeConfig(128, 8, 2, fused)),
    ]
    for _ in range(3):
        for layer in case.step():
            q = case.query()
            ref = case.reference(q, layer)
            for splits, cfg in launches:
                out = folded_decode(
                    q,
                    case.pool.k_pages,
                    case.pool.v_pages,
                    case.pool.page_table,
                    case.pool.global_len,
                    case.plan.req,
                    case.plan.ring_tokens,
                    layer,
                    num_splits=splits,
                    config=cfg,
                )
                ok, rel, mx = close(out, ref, dtype)
                assert ok, f"layer {layer} splits {splits} {cfg}: rel {rel:.2e} max {mx:.2e}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_interpreter_cases_compiled(name):
    """The interpreter cases on the compiled kernels: both merges, an empty stream, every launch run
    twice on one shared workspace."""
    from interp_decode_check import run_case

    assert run_case(name, "cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launch"])
def test_gpu_decode_batch16_long_streams(fused):
    from sglang_wgkv.attention.decode_config import DecodeConfig, choose_num_splits
    from sglang_wgkv.attention.triton_decode import folded_decode

    plens = [8000, 1, 4000, 600, 12000, 33, 256, 257, 3000, 7000, 100, 2048, 5000, 64, 9000, 1500]
    case = PoolCase(128, 32, 8, torch.bfloat16, 256, plens, 0, 0.6, "cuda", num_layers=1, seed=16)
    for layer in case.step():
        q = case.query()
        ref = case.reference(q, layer)
        for splits in (choose_num_splits(16, 8, 12288), 1, 3, 32, 128):
            out = folded_decode(
                q,
                case.pool.k_pages,
                case.pool.v_pages,
                case.pool.page_table,
                case.pool.global_len,
                case.plan.req,
                case.plan.ring_tokens,
                layer,
                num_splits=splits,
                config=DecodeConfig(fused_merge=fused),
            )
            ok, rel, mx = close(out, ref, torch.bfloat16)
            assert ok, f"splits {splits}: rel {rel:.2e} max {mx:.2e}"


@pytest.mark.gpu
@requires_cuda
def test_gpu_fused_merge_back_to_back_launches():
    """Many fused launches on one workspace with no host sync between them, the query alternating
    between two, so the partials change every launch: each output equals the first of its query bit for
    bit (every launch's counters start at zero, the last split of a stream reads only this launch's
    partials), and matches the reference."""
    from sglang_wgkv.attention.decode_config import FoldedDecodeWorkspace
    from sglang_wgkv.attention.triton_decode import folded_decode

    case = PoolCase(
        128, 32, 8, torch.bfloat16, 256, [6000, 3000, 800, 40], 1, 0.6, "cuda", num_layers=1, seed=11
    )
    p, B = case.pool, len(case.slots)
    ws = FoldedDecodeWorkspace(B, 32, 128, 128, "cuda", num_kv_heads=8)
    for layer in case.step():
        qs = [case.query(), case.query()]
        for splits in (128, 37, 5):
            outs = torch.full((40, B, 32, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
            for i in range(len(outs)):
                folded_decode(
                    qs[i % 2],
                    p.k_pages,
                    p.v_pages,
                    p.page_table,
                    p.global_len,
                    case.plan.req,
                    case.plan.ring_tokens,
                    layer,
                    num_splits=splits,
                    workspace=ws,
                    out=outs[i],
                )
            for j, q in enumerate(qs):
                ok, rel, mx = close(outs[j], case.reference(q, layer), torch.bfloat16)
                assert ok, f"splits {splits} query {j}: rel {rel:.2e} max {mx:.2e}"
                assert all(torch.equal(o, outs[j]) for o in outs[j::2]), f"splits {splits}: a launch differs"
    assert not ws.splits_done.any()


@pytest.mark.gpu
@requires_cuda
def test_gpu_pdl_launch_reads_what_the_kernel_before_wrote():
    """``DecodeConfig(pdl=True)`` (programmatic dependent launch): the split kernel may start while the
    kernel before it - here the copy that writes its query - drains; it must read that kernel's output.
    Forty launches, each right after a copy of a different query into one buffer, in eager launches and
    in one CUDA graph: every output equals the launch without PDL bit for bit."""
    from sglang_wgkv.attention.decode_config import DecodeConfig, FoldedDecodeWorkspace
    from sglang_wgkv.attention.triton_decode import folded_decode

    case = PoolCase(
        128, 32, 8, torch.bfloat16, 256, [6000, 3000, 800, 40], 1, 0.6, "cuda", num_layers=1, seed=13
    )
    p, B = case.pool, len(case.slots)
    ws = FoldedDecodeWorkspace(B, 32, 128, 64, "cuda", num_kv_heads=8)
    pdl = DecodeConfig(pdl=True)
    for layer in case.step():
        qs = [case.query() for _ in range(4)]
        want = [
            folded_decode(
                q,
                p.k_pages,
                p.v_pages,
                p.page_table,
                p.global_len,
                case.plan.req,
                case.plan.ring_tokens,
                layer,
                num_splits=64,
                workspace=ws,
            )
            for q in qs
        ]
        q_buf = torch.empty_like(qs[0])
        outs = torch.full((40, B, 32, 128), float("nan"), device="cuda", dtype=torch.bfloat16)

        def run():
            for i in range(len(outs)):
                q_buf.copy_(qs[i % 4])
                folded_decode(
                    q_buf,
                    p.k_pages,
                    p.v_pages,
                    p.page_table,
                    p.global_len,
                    case.plan.req,
                    case.plan.ring_tokens,
                    layer,
                    num_splits=64,
                    workspace=ws,
                    out=outs[i],
                    config=pdl,
                )

        run()
        assert all(torch.equal(o, want[i % 4]) for i, o in enumerate(outs)), (
            "eager: a PDL launch read a stale query"
        )
        outs.fill_(float("nan"))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        outs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, want[i % 4]) for i, o in enumerate(outs)), (
            "graph: a PDL launch read a stale query"
        )
    assert not ws.splits_done.any()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_cuda_graph_replay_after_pool_changes(dtype, fused):
    """Capture one decode (all layers) with static buffers, decode more steps (more global tokens,
    new pages, a ring page crossing), replay, compare each layer with the reference; a second replay
    repeats the first bit for bit (the fused merge's counters start from zero on every replay)."""
    from sglang_wgkv.attention.decode_config import DecodeConfig, FoldedDecodeWorkspace, choose_num_splits
    from sglang_wgkv.attention.triton_decode import folded_decode

    D, Hq, Hkv, L = 128, 32, 8, 2
    case = PoolCase(
        D, Hq, Hkv, dtype, 64, [3000, 700, 20], 1, 0.8, "cuda", num_layers=L, max_context=3200, seed=7
    )
    p, B = case.pool, len(case.slots)
    splits = choose_num_splits(B, Hkv, p.max_context_len, "cuda")
    ws = FoldedDecodeWorkspace(B, Hq, D, splits, "cuda", num_kv_heads=Hkv)
    cfg = DecodeConfig(fused_merge=fused)
    q = torch.zeros(L, B, Hq, D, device="cuda", dtype=dtype)
    req = torch.zeros(B, dtype=torch.int64, device="cuda")
    ring = torch.zeros(B, dtype=torch.int64, device="cuda")
    out = torch.zeros(L, B, Hq, D, device="cuda", dtype=dtype)

    def decode_all_layers():
        for layer in range(L):
            folded_decode(
                q[layer],
                p.k_pages,
                p.v_pages,
                p.page_table,
                p.global_len,
                req,
                ring,
                layer,
                num_splits=splits,
                workspace=ws,
                out=out[layer],
                config=cfg,
            )

    for _ in case.step():
        pass
    req.copy_(case.plan.req)
    ring.copy_(case.plan.ring_tokens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_all_layers()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_all_layers()
    glen_before = p.global_len.sum().item()
    for step in range(40):
        for _ in case.step():
            pass
        if step % 13 == 12:
            req.copy_(case.plan.req)
            ring.copy_(case.plan.ring_tokens)
            q.copy_(torch.randn_like(q))
            graph.replay()
            for layer in range(L):
                ok, rel, mx = close(out[layer], case.reference(q[layer], layer), dtype)
                assert ok, f"step {step} layer {layer}: rel {rel:.2e} max {mx:.2e}"
            first = out.clone()
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, first), f"step {step}: a second replay differs"
    assert p.global_len.sum().item() > glen_before
