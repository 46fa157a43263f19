"""The decode benchmarks' workload on CPU: FP8 pages for the FP8 rows of ``benchmarks.kernel_decode``
(the kernels themselves are timed on a GPU; their FP8 path is checked by ``test_triton_decode``)."""

import torch

from benchmarks import decode_workload as dw
from benchmarks import kernel_decode


def _pool():
    gen = torch.Generator().manual_seed(0)
    return dw.FoldedPool(dw.global_lengths(2, 3, 600, 0.75, gen), gen, device="cpu")


def test_fp8_pages_hold_the_pools_values_in_half_the_bytes():
    pool = _pool()
    got = dw.fp8_pages(pool)
    k, v = got["pages"]
    assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == pool.k_pages.shape
    assert torch.equal(k.float(), pool.k_pages.to(torch.float8_e4m3fn).float())
    assert got["kv_bytes_per_layer"] == pool.kv_bytes_per_layer / 2
    assert got["k_scale"].item() == got["v_scale"].item() == 1.0


def test_triton_fn_reads_the_pages_and_scales_it_is_given(monkeypatch):
    """Every layer's call gets the FP8 pages and their scales in place of the pool's bf16 pages."""
    from sglang_wgkv.attention import triton_decode

    calls = []
    monkeypatch.setattr(triton_decode, "folded_decode", lambda *a, **kw: calls.append((a, kw)))
    pool = _pool()
    paged = dw.fp8_pages(pool)
    paged.pop("kv_bytes_per_layer")
    q = torch.zeros(2, dw.HQ, dw.D, dtype=dw.DT)
    dw.triton_fn(pool, q, torch.empty_like(q), 2, None, **paged)()
    assert [a[7] for a, _ in calls] == [0, 1, 2]  # one call a layer
    for a, kw in calls:
        assert a[1] is paged["pages"][0] and a[2] is paged["pages"][1]
        assert kw["k_scale"] is paged["k_scale"] and kw["v_scale"] is paged["v_scale"]
    calls.clear()
    dw.triton_fn(pool, q, torch.empty_like(q), 2, None)()
    assert calls[0][0][1] is pool.k_pages and "k_scale" not in calls[0][1]


def test_kernel_decode_takes_the_fp8_options():
    args = kernel_decode.parse_args(["--kv-dtypes", "bf16", "fp8_e4m3", "--sweep-kv-dtype", "fp8_e4m3"])
    assert args.kv_dtypes == ["bf16", "fp8_e4m3"] and args.sweep_kv_dtype == "fp8_e4m3"
    assert kernel_decode.parse_args([]).kv_dtypes == ["bf16"]
