"""FP8 pages on the compiled kernels (H200): the split-KV decode at long context against the reference,
under CUDA-graph capture and replay (scales read from device memory), and the decode step's pool
launches (ring write quantizing, promotion moving bytes) bit for bit against the torch ops. The
interpreter's FP8 cases also run compiled in tests/test_triton_decode.py (gpu marker)."""

import pytest
import torch
from interp_decode_check import PoolCase, close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)"),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _launch(case, q, layer, **kwargs):
    from sglang_wgkv.attention.triton_decode import folded_decode

    p = case.pool
    return folded_decode(
        q,
        p.k_pages,
        p.v_pages,
        p.page_table,
        p.global_len,
        case.plan.req,
        case.plan.ring_tokens,
        layer,
        k_scale=p.k_scale[layer],
        v_scale=p.v_scale[layer],
        **kwargs,
    )


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launch"])
def test_gpu_fp8_decode_matches_reference(kv_dtype, fused):
    from sglang_wgkv.attention.decode_config import DecodeConfig

    case = PoolCase(
        128, 32, 8, torch.bfloat16, 256, [6000, 300, 2500, 40], 1, 0.5, "cuda", seed=7, kv_dtype=kv_dtype
    )
    for _ in range(2):
        for layer in case.step():
            q = case.query()
            ref = case.reference(q, layer)
            for splits in (None, 1, 16, 64):
                out = _launch(case, q, layer, num_splits=splits, config=DecodeConfig(fused_merge=fused))
                ok, rel, mx = close(out, ref, torch.bfloat16)
                assert ok, f"layer {layer} splits {splits}: rel {rel:.2e} max {mx:.2e}"


def test_gpu_fp8_decode_under_cuda_graph_follows_scales():
    """A captured FP8 decode replays correctly, and after the scales change in place (the tensors
    the kernel reads), the replay uses the new ones: no scale was baked into the graph."""
    from sglang_wgkv.attention.decode_config import FoldedDecodeWorkspace, choose_num_splits

    case = PoolCase(
        128, 32, 8, torch.bfloat16, 256, [3000, 700], 0, 0.5, "cuda", num_layers=1, seed=3,
        kv_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    next(case.step())
    q = case.query()
    B = q.shape[0]
    splits = choose_num_splits(B, 8, 4096, q.device)
    ws = FoldedDecodeWorkspace(B, 32, 128, splits, q.device, num_kv_heads=8)
    out = torch.empty_like(q)
    _launch(case, q, 0, num_splits=splits, workspace=ws, out=out)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(case, q, 0, num_splits=splits, workspace=ws, out=out)
    for k_mul, v_mul in ((1.0, 1.0), (0.5, 3.0)):
        case.pool.k_scale.mul_(k_mul)
        case.pool.v_scale.mul_(v_mul)
        graph.replay()
        ok, rel, mx = close(out, case.reference(q, 0), torch.bfloat16)
        assert ok, f"scales x({k_mul}, {v_mul}): rel {rel:.2e} max {mx:.2e}"


@pytest.mark.parametrize("seed,kv_dtype", [(0, "e4m3"), (1, "e5m2")])
def test_gpu_fp8_pool_decode_launches_bit_exact(seed, kv_dtype):
    from triton_fp8_pool_interp_check import DTYPES, main

    main(seed, DTYPES[kv_dtype], "cuda")
