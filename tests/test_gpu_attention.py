"""GPU kernels against the torch references: Triton vertical-slash prefill, FlashInfer folded decode."""

import pytest
import torch

from sglang_wgkv.attention import reference
from sglang_wgkv.testing.prefill_cases import PREFILL_CASES, packed_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)"),
]

DEV = "cuda"
TOL = {torch.float16: (3e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative norm, max abs)


def _close(out, ref, dtype):
    assert torch.isfinite(out).all(), "non-finite output"
    rel_tol, abs_tol = TOL[dtype]
    err = out.float() - ref.float()
    rel = (err.norm() / ref.float().norm().clamp(min=1e-6)).item()
    assert rel < rel_tol and err.abs().max().item() < abs_tol, (
        f"rel {rel:.2e}, max {err.abs().max().item():.2e}"
    )


def _packed_case(*args):
    return packed_case(*args, device=DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_triton_prefill_matches_reference(dtype, D, case):
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    lens_q, lens_k, W, p, far = case
    torch.manual_seed(len(lens_q) * 1000 + D + W)
    args = _packed_case(lens_q, lens_k, 8, 2, D, p, dtype, far)
    ref = reference.vertical_slash_attention(*args, W)
    out = vertical_slash_attention(*args, W)
    _close(out, ref, dtype)


def _fa3():
    from sglang_wgkv.attention.fa3_vertical import load_fa3

    fa3 = load_fa3(DEV)
    if fa3 is None:
        pytest.skip("FA3 (sgl_kernel.flash_attn on a Hopper GPU) is not available")
    return fa3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_fa3_vertical_prefill_matches_reference(dtype, D, case):
    """FA3 on the vertical range, the band launch merging its output and log-sum-exp: the reference
    attention's values, as the one-pass kernel gives them."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    fa3 = _fa3()
    lens_q, lens_k, W, p, far = case
    torch.manual_seed(len(lens_q) * 1000 + D + W)
    args = _packed_case(lens_q, lens_k, 8, 2, D, p, dtype, far)
    _close(vertical_slash_attention(*args, W, fa3=fa3), reference.vertical_slash_attention(*args, W), dtype)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 1), (32, 8)])
def test_fa3_vertical_prefill_long_context_and_groups(Hq, Hkv):
    """A chunk after a long cached context (global entries at the far position, then the chunk),
    several sequences, GQA groups of 1, 8 and Llama-3.1-8B's 4: FA3's entries and page tables at
    sizes of many pages, against the one-pass Triton kernel and the reference."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    fa3 = _fa3()
    torch.manual_seed(Hq + Hkv)
    args = _packed_case([2048, 300, 1], [2048, 900, 5000], Hq, Hkv, 128, 0.25, torch.bfloat16, 6000)
    one_pass = vertical_slash_attention(*args, 256)
    out = vertical_slash_attention(*args, 256, fa3=fa3)
    _close(out, reference.vertical_slash_attention(*args, 256), torch.bfloat16)
    _close(out, one_pass, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lens_q,lens_k,far", [([2048, 300, 1], [2048, 900, 5000], 6000), ([700, 33], [1500, 33], 0)]
)
def test_fa3_dense_prefill_is_the_vertical_slash_attention_with_every_key_admitted(
    dtype, lens_q, lens_k, far
):
    """The dense FA3 call of a prefill whose keys are all admitted (``attention/fa3_dense.py``) against
    its torch statement, the reference vertical-slash attention and the one-pass kernel; and the
    server's start-up choice takes it on this card."""
    from sglang_wgkv.attention.fa3_dense import dense_attention, dense_reference, load_fa3_dense
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
    from sglang_wgkv.integration.backend.prefill_vertical import choose_dense

    fa3 = load_fa3_dense(DEV)
    if fa3 is None:
        pytest.skip("FA3 (sgl_kernel.flash_attn on a Hopper GPU) is not available")
    torch.manual_seed(len(lens_q) + far)
    q, k, v, adm, qo, kv, q_pos, k_pos = _packed_case(lens_q, lens_k, 32, 8, 128, 1.0, dtype, far)
    args = (qo.int(), kv.int(), max(lens_q), max(lens_k) + far, 128**-0.5)
    out = dense_attention(fa3, q, k, v, *args)
    _close(out, dense_attention(dense_reference, q, k, v, *args), dtype)
    buf = torch.full((q.shape[0] + 5, *q.shape[1:]), 7.0, dtype=dtype, device=DEV)  # a mixed forward's rows
    assert dense_attention(fa3, q, k, v, *args, out=buf[: q.shape[0]]).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[: q.shape[0]], out) and bool((buf[q.shape[0] :] == 7.0).all())
    _close(out, reference.vertical_slash_attention(q, k, v, adm, qo, kv, q_pos, k_pos, 256), dtype)
    _close(out, vertical_slash_attention(q, k, v, adm, qo, kv, q_pos, k_pos, 256), dtype)
    assert choose_dense(_fa3(), torch.device(DEV), dtype, (32, 8, 128)) is fa3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lens,prefixes,p",
    [
        ([4096, 2048], [0, 0], 0.25),
        ([1, 129, 300, 64], [0, 0, 0, 0], 0.5),
        ([257], [0], 0.0),
        ([3000], [0], 1.0),
        ([2048, 1500, 700], [6000, 0, 200], 0.25),  # chunks after cached prefixes, a prompt beside them
    ],
)
def test_fa3_band_prefill_matches_reference(dtype, lens, prefixes, p):
    """The prefill with FA3 on the local window (``attention/fa3_band.py``, keys in the pool's layout:
    global entries, the ring, the new rows) against the window's torch statement, the reference
    vertical-slash attention and the one-pass kernel; and ``--wgkv-prefill-band fa3``'s start-up choice
    takes FA3 on this card."""
    from sglang_wgkv.attention.fa3_band import fa3_band
    from sglang_wgkv.attention.fa3_dense import dense_reference, load_fa3_dense
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
    from sglang_wgkv.integration.backend.prefill_band import choose_band
    from sglang_wgkv.testing.prefill_cases import pool_layout_case

    fn = load_fa3_dense(DEV)
    if fn is None:
        pytest.skip("FA3 (sgl_kernel.flash_attn on a Hopper GPU) is not available")
    torch.manual_seed(len(lens))
    q, k, v, adm, qo, kv, q_pos, k_pos = pool_layout_case(
        lens, prefixes, 1500, 256, 32, 8, 128, p, dtype, device=DEV, index_dtype=torch.int64
    )
    cu_q, cu_k, scale = qo.int(), kv.int(), 128**-0.5
    call = (cu_q, cu_k, max(lens), int((kv[1:] - kv[:-1]).max()))
    got_o, got_lse = fa3_band(q, k, v, fn, *call, scale, 256)
    want_o, want_lse = fa3_band(q, k, v, dense_reference, *call, scale, 256)
    _close(got_o, want_o, dtype)
    assert (got_lse.float() - want_lse).abs().max().item() < 1e-2
    out = vertical_slash_attention(q, k, v, adm, qo, kv, q_pos, k_pos, 256, band=(fn, *call))
    _close(out, reference.vertical_slash_attention(q, k, v, adm, qo, kv, q_pos, k_pos, 256), dtype)
    _close(out, vertical_slash_attention(q, k, v, adm, qo, kv, q_pos, k_pos, 256), dtype)
    assert choose_band("fa3", torch.device(DEV), dtype, (32, 8, 128)) is fn


def test_fa3_entries_equal_their_torch_statement():
    from sglang_wgkv.attention.fa3_vertical import PAGE, vertical_entries, vertical_entries_torch
    from sglang_wgkv.attention.triton_prefill import build_vertical_slash_plan_triton
    from sglang_wgkv.attention.vertical_slash_plan import compacted_rows

    torch.manual_seed(5)
    _, _, _, adm, qo, kv, qp, kp = _packed_case(
        [700, 0, 129], [3000, 40, 129], 8, 2, 64, 0.3, torch.bfloat16, 50
    )
    plan = build_vertical_slash_plan_triton(adm, qo, kv, qp, kp, 64, 128)
    rows = compacted_rows(adm.shape[0], 3, PAGE)
    got = vertical_entries(plan, qp.numel(), rows, rows // PAGE)
    want = vertical_entries_torch(plan, qp.numel(), rows, rows // PAGE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for e, n in enumerate(got[1].tolist()):
        assert torch.equal(got[2][e, : -(-n // PAGE)], want[2][e, : -(-n // PAGE)]), e


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 1), (6, 2)])
def test_triton_prefill_gqa_groups(Hq, Hkv):
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    torch.manual_seed(Hq * 10 + Hkv)
    args = _packed_case([333, 70], [333, 90], Hq, Hkv, 128, 0.3, torch.bfloat16)
    _close(vertical_slash_attention(*args, 32), reference.vertical_slash_attention(*args, 32), torch.bfloat16)


def test_triton_prefill_reused_plan_and_configs_and_scale():
    from sglang_wgkv.attention.triton_prefill import PrefillConfig, compact_align, vertical_slash_attention
    from sglang_wgkv.attention.vertical_slash_plan import build_vertical_slash_plan, compact_admitted

    torch.manual_seed(7)
    q, k, v, adm, qo, kv, qp, kp = _packed_case([500, 260], [500, 300], 8, 2, 128, 0.25, torch.bfloat16)
    ref = reference.vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, 64, sm_scale=0.05)
    for cfg in (PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 128, 8, 2), PrefillConfig(64, 64, 4, 3)):
        align = compact_align(cfg)
        plan = build_vertical_slash_plan(adm, qo, kv, qp, kp, 64, cfg.block_m, align)
        comp = compact_admitted(k, v, adm, kv, align=align)
        out = vertical_slash_attention(
            q, k, v, adm, qo, kv, qp, kp, 64, 0.05, plan=plan, compacted=comp, config=cfg
        )
        _close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("p", [0.0, 0.25, 1.0])
def test_triton_compaction_equals_torch_compaction(p):
    """The compiled Triton compaction (what the served prefill runs) writes the same compacted rows as
    the torch scatter, at a size where the scan and the copy span many blocks."""
    from sglang_wgkv.attention.triton_prefill import compact_admitted_triton
    from sglang_wgkv.attention.vertical_slash_plan import compact_admitted

    torch.manual_seed(int(p * 100) + 3)
    lens = [5000, 1, 0, 3071]
    kv = torch.tensor([0] + lens).cumsum(0).to(DEV)
    Nk = sum(lens)
    k, v = (torch.randn(Nk, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    adm = torch.rand(Nk, 8, device=DEV) < p
    from sglang_wgkv.attention.vertical_slash_plan import region_starts

    ref, out = compact_admitted(k, v, adm, kv), compact_admitted_triton(k, v, adm, kv)
    for b, start in enumerate(region_starts(kv).tolist()):  # the rows a kernel reads: admitted, then zeros
        for h in range(8):
            n = int(adm[kv[b] : kv[b + 1], h].sum())
            read = slice(start, start + -(-n // 64) * 64)
            assert torch.equal(out[0][h, read], ref[0][h, read]) and torch.equal(
                out[1][h, read], ref[1][h, read]
            )


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_triton_plan_equals_torch_plan(case):
    """The one-launch Triton plan equals the torch plan (which the served prefill builds until this passes)."""
    from sglang_wgkv.attention.triton_prefill import build_vertical_slash_plan_triton
    from sglang_wgkv.attention.vertical_slash_plan import build_vertical_slash_plan

    lens_q, lens_k, W, p, far = case
    torch.manual_seed(17)
    _, _, _, adm, qo, kv, qp, kp = _packed_case(lens_q, lens_k, 8, 2, 64, p, torch.bfloat16, far)
    ref, out = (
        build(adm, qo, kv, qp, kp, W, 128)
        for build in (build_vertical_slash_plan, build_vertical_slash_plan_triton)
    )
    rows = ref.q_start < ref.q_end
    assert torch.equal(out.q_start, ref.q_start) and torch.equal(out.q_end, ref.q_end)
    assert torch.equal(out.vertical_len, ref.vertical_len)
    for name in ("kv_start", "band_start", "band_end", "compact_start"):
        assert torch.equal(getattr(out, name)[rows], getattr(ref, name)[rows]), name


def test_triton_prefill_strided_views_of_fused_qkv():
    """q/k/v as column slices of one fused projection output (what a model hands over)."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    torch.manual_seed(11)
    T, Hq, Hkv, D = 300, 8, 2, 128
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)
    adm = torch.rand(T, Hkv, device=DEV) < 0.3
    ind = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    pos = torch.arange(T, dtype=torch.int32, device=DEV)
    ref = reference.vertical_slash_attention(q, k, v, adm, ind, ind, pos, pos, 32)
    _close(vertical_slash_attention(q, k, v, adm, ind, ind, pos, pos, 32), ref, torch.bfloat16)


def _folded_pages(B, Hkv, D, dtype, lengths, num_pages=4000):
    """Random pool and ragged page lists; lengths ``[B*Hkv]`` tokens (>= 1)."""
    k_pages = torch.randn(num_pages + 1, 16, D, device=DEV).to(dtype)
    v_pages = torch.randn(num_pages + 1, 16, D, device=DEV).to(dtype)
    n = [(L + 15) // 16 for L in lengths]
    perm = torch.randperm(num_pages, device=DEV)[: sum(n)].to(torch.int32)
    indptr = torch.tensor([0] + n).cumsum(0).to(torch.int32)
    last = torch.tensor([L - (c - 1) * 16 for L, c in zip(lengths, n)], dtype=torch.int32)
    return k_pages, v_pages, indptr, perm, last


DECODE_CASES = [
    # B, Hq, Hkv, lengths per (b, h) or None for random
    (1, 32, 8, None),
    (3, 8, 2, [1, 16, 17, 300, 5000, 33]),
    (2, 4, 4, None),
    (4, 8, 1, [2000, 1, 64, 129]),
]


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_folded_decode_matches_reference(dtype, D, case):
    from sglang_wgkv.attention.flashinfer_decode import folded_paged_decode_attention

    B, Hq, Hkv, lengths = case
    torch.manual_seed(B * 7 + Hq + D)
    if lengths is None:
        lengths = torch.randint(1, 3000, (B * Hkv,)).tolist()
    kp, vp, indptr, indices, last = _folded_pages(B, Hkv, D, dtype, lengths)
    q = torch.randn(B, Hq, D, device=DEV).to(dtype)
    ref = reference.paged_decode_attention(q, kp, vp, indptr.to(DEV), indices, last.to(DEV))
    out = folded_paged_decode_attention(q, kp, vp, indptr, indices, last.to(DEV))
    _close(out, ref, dtype)


def test_folded_decode_rejects_unsupported_group():
    from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode

    with pytest.raises(ValueError, match="GQA group 16"):
        FoldedPagedDecode(16, 1, 128, 1, 16, DEV)


def test_folded_decode_plan_once_run_per_layer_and_cuda_graph():
    """One plan serves several layers (pools); a captured run replays correctly after a re-plan
    with other lengths, and after the last-page lengths are rewritten in place."""
    from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode

    torch.manual_seed(3)
    B, Hq, Hkv, D, dtype = 2, 32, 8, 128, torch.bfloat16
    S = B * Hkv
    dec = FoldedPagedDecode(Hq, Hkv, D, B, max_pages=4000, device=DEV, q_dtype=dtype)
    pools = [
        (torch.randn(4001, 16, D, device=DEV).to(dtype), torch.randn(4001, 16, D, device=DEV).to(dtype))
        for _ in range(3)
    ]
    lengths = torch.randint(1, 2000, (S,)).tolist()
    _, _, indptr, indices, last = _folded_pages(B, Hkv, D, dtype, lengths, 4000)
    dec.plan(indptr, indices, last.to(DEV))
    q = torch.randn(B, Hq, D, device=DEV).to(dtype)
    for kp, vp in pools:
        ref = reference.paged_decode_attention(q, kp, vp, indptr.to(DEV), indices, last.to(DEV))
        _close(dec.run(q, kp, vp), ref, dtype)

    kp, vp = pools[0]
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dec.run(q, kp, vp, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(q, kp, vp, out=out)
    lengths2 = torch.randint(1, 3000, (S,)).tolist()
    _, _, indptr2, indices2, last2 = _folded_pages(B, Hkv, D, dtype, lengths2, 4000)
    dec.plan(indptr2, indices2, last2.to(DEV))
    q.copy_(torch.randn_like(q))
    graph.replay()
    _close(out, reference.paged_decode_attention(q, kp, vp, indptr2.to(DEV), indices2, last2.to(DEV)), dtype)
    # Same page counts, shorter last pages: rewrite the device buffer, no new plan.
    last3 = torch.clamp(last2 - 5, min=1).to(DEV)
    dec.last_page_len.copy_(last3)
    graph.replay()
    _close(out, reference.paged_decode_attention(q, kp, vp, indptr2.to(DEV), indices2, last3), dtype)


def test_folded_decode_reads_the_dual_cache_pool():
    """Prefill + decode steps through the core pool; its folded page lists feed FlashInfer."""
    from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode
    from sglang_wgkv.attention.folded_index import build_folded_indices
    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.memory import DualCachePool

    torch.manual_seed(5)
    L, B, Hkv, G, D, W = 2, 2, 4, 4, 128, 64
    dtype = torch.bfloat16
    pool = DualCachePool(
        L,
        Hkv,
        D,
        num_pages=3000,
        max_requests=4,
        max_context_len=1200,
        config=WGKVConfig(local_window=W),
        dtype=dtype,
        device=DEV,
    )
    slots, plens = [2, 0], [700, 90]
    for r in slots:
        pool.alloc_request(r)
    pool.begin_extend(slots, [0, 0], plens)
    N = sum(plens)
    for layer in range(L):
        k = torch.randn(N, Hkv, D, device=DEV).to(dtype)
        pool.write_extend(layer, k, torch.randn_like(k), torch.rand(N, Hkv, device=DEV) < 0.3)
    dec = FoldedPagedDecode(Hkv * G, Hkv, D, B, max_pages=B * Hkv * 200, device=DEV, q_dtype=dtype)
    seq = list(plens)
    for step in range(20):
        pool.begin_decode(slots, seq)
        for layer in range(L):
            k = torch.randn(B, Hkv, D, device=DEV).to(dtype)
            pool.write_decode(layer, k, torch.randn_like(k), torch.rand(B, Hkv, device=DEV) < 0.3)
            rows, num_pages, last, _ = pool.decode_page_rows(layer)
            indptr, indices, last = build_folded_indices(rows, num_pages, last)
            q = torch.randn(B, Hkv * G, D, device=DEV).to(dtype)
            dec.plan(indptr.cpu(), indices, last)
            ref = reference.paged_decode_attention(q, pool.k_pages, pool.v_pages, indptr, indices, last)
            _close(dec.run(q, pool.k_pages, pool.v_pages), ref, dtype)
        seq = [s + 1 for s in seq]
