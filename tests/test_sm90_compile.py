"""Our served Triton kernels compile for the H200 (sm_90a) at their launchers' specializations and
fit its shared memory, checked on CPU (sglang_wgkv/testing/sm90_compile.py). Slow-ish: a few seconds per kernel."""

import pytest
import torch

from sglang_wgkv.testing.sm90_compile import (
    SM90_MAX_SHARED,
    compile_sm90,
    device_checks_off,
    launches,
    split_kernel_launch,
)

pytestmark = pytest.mark.core


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_decode_split_kernel_compiles_for_sm90(pdl):
    """The decode split kernel as the served step launches it (Llama-3.1-8B's GQA group of 4, bf16,
    fused merge, fused ring write, the evictor's observation window), with and without programmatic
    dependent launch: with it the PTX waits on the grid dependency (griddepcontrol.wait)."""
    from sglang_wgkv.attention.decode_config import DecodeConfig

    compiled = compile_sm90(
        *split_kernel_launch(DecodeConfig(pdl=pdl), batch=2, pos=300, splits=16, observe=True)
    )
    assert compiled.metadata.shared <= SM90_MAX_SHARED
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == pdl
    assert compiled.metadata.launch_pdl == pdl


SM90_REGISTERS_PER_SM = 65536
SM90_SHARED_PER_SM = 233472  # bytes an SM holds for its resident blocks (228 KiB)


@pytest.mark.parametrize(
    "kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=["bf16", "e4m3", "e5m2"]
)
def test_served_decode_shape_fits_the_programs_it_plans(kv_dtype):
    """The split count plans ``programs_per_sm`` programs per SM (choose_num_splits); the served shape
    for each page dtype (DecodeConfig.for_pages) must let that many be resident, by registers and by
    shared memory, without spills: otherwise the last programs of each SM run in a second wave (FP8's
    conversions took the bf16 shape to 168 registers: three of four)."""
    from benchmarks.sm90_registers import ptxas_stats
    from sglang_wgkv.attention import decode_config as dc

    cfg = dc.DecodeConfig.for_pages(kv_dtype)
    pages = None if kv_dtype == torch.bfloat16 else kv_dtype
    splits = dc.choose_num_splits(1, 8, 131072, "cpu")
    compiled = compile_sm90(*split_kernel_launch(cfg, splits=splits, kv_dtype=pages))
    stats = ptxas_stats(compiled.asm["ptx"])
    threads = 32 * cfg.num_warps
    assert stats["spill_store_bytes"] == 0, stats
    assert SM90_REGISTERS_PER_SM // (stats["registers"] * threads) >= cfg.programs_per_sm, stats
    assert SM90_SHARED_PER_SM // max(compiled.metadata.shared, 1) >= cfg.programs_per_sm


def test_decode_split_kernel_register_cap():
    """``--wgkv-decode-launch maxnreg=N`` reaches the compiled kernel: the PTX carries the cap (ptxas
    then allocates at most N registers per thread); without it, no cap."""
    from sglang_wgkv.attention.decode_config import DecodeConfig

    capped = compile_sm90(*split_kernel_launch(DecodeConfig(block_n=16, maxnreg=128)))
    assert ".maxnreg 128" in capped.asm["ptx"]
    assert ".maxnreg" not in compile_sm90(*split_kernel_launch(DecodeConfig(block_n=16))).asm["ptx"]


def _gate_cases():
    from benchmarks.kernel_gate import VARIANTS

    return [(torch.float32, "served_small"), (torch.float32, "served_large")] + [
        (torch.bfloat16, name) for name in VARIANTS
    ]


@pytest.mark.parametrize("dtype,variant", _gate_cases())
def test_prefill_gate_compiles_for_sm90_within_shared_memory(dtype, variant):
    """The Triton prefill write gate at Llama-3.1-8B's shape (D 128, 8 KV heads, inner 512) with the
    admission epilogue, in the served launch shapes and each one ``benchmarks/kernel_gate.py`` times:
    its tile (block_t x block_i, stages, precision) must fit sm_90's 227 KiB; the first tile (64 x 64,
    3 stages) asked for 320 KiB, which only a GPU run would otherwise reveal."""
    from benchmarks.kernel_gate import VARIANTS
    from sglang_wgkv.gate import GateConfig, WriteGates
    from sglang_wgkv.gate.triton_prefill_gate import PrefillGate

    T, H, D = 64, 8, 128
    gates = WriteGates(GateConfig(num_layers=1, num_kv_heads=H, head_dim=D, local_window=256))
    gate = PrefillGate(gates, launch=VARIANTS[variant])
    k = torch.zeros(T, H, D, dtype=dtype)
    tau = torch.full((T,), 0.1)
    ((kernel, bound, options),) = launches(lambda: gate.admit(0, k, k.clone(), tau))
    compiled = compile_sm90(kernel, bound, options)
    assert compiled.metadata.shared <= SM90_MAX_SHARED


# (query heads, KV heads, head_dim): Llama-3.1-8B and the embedded SmolLM2-135M
SHAPES = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}


def _prefill_launches(dtype, shape, fa3=None):
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

    lens, (Hq, Hkv, D) = [300, 129], shape
    N = sum(lens)
    q = torch.zeros(N, Hq, D, dtype=dtype)
    k = torch.zeros(N, Hkv, D, dtype=dtype)
    indptr = torch.tensor([0, lens[0], N], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    admitted = torch.zeros(N, Hkv, dtype=torch.bool)
    with device_checks_off():
        return launches(
            lambda: vertical_slash_attention(q, k, k.clone(), admitted, indptr, indptr, pos, pos, 64, fa3=fa3)
        )


def _fa3_shapes(q, k_cache, v_cache, **kwargs):
    """FA3's outputs in shape only: the capture records Triton launches, and FA3 is not one."""
    return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])


def _prefill_band_launches(dtype, shape):
    """The prefill with FA3 on the local window: plan, compaction, and the band launch from FA3's state
    (its outputs in shape only), on a chunk after a cached prefix beside a prompt."""
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
    from sglang_wgkv.testing.prefill_cases import pool_layout_case

    lens, (Hq, Hkv, D) = [300, 129], shape
    q, k, v, adm, qo, kv, qp, kp = pool_layout_case(
        lens, [200, 0], 40, 64, Hq, Hkv, D, 0.25, dtype, index_dtype=torch.int64
    )

    def window_shapes(q, *args, **kwargs):
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    band = (window_shapes, qo.to(torch.int32), kv.to(torch.int32), max(lens), int((kv[1:] - kv[:-1]).max()))
    with device_checks_off():
        return launches(lambda: vertical_slash_attention(q, k, v, adm, qo, kv, qp, kp, 64, band=band))


def _prefill_fa3_launches(dtype, shape):
    """The prefill with FA3 on the vertical range: plan, paged compaction, FA3 entries, band launch."""
    return _prefill_launches(dtype, shape, fa3=_fa3_shapes)


def _snapkv_launches(dtype, shape, kv_dtype=None):
    """The SnapKV score kernel over keys of ``kv_dtype`` (an FP8 pool's, with per-stream scales) or of
    the queries' dtype."""
    from sglang_wgkv.memory.triton_snapkv import snapkv_scores_triton

    (Hq, Hkv, D), S, Wq, Ng, Nr = shape, 6, 32, 600, 256
    G = Hq // Hkv
    q = torch.zeros(S, Wq, G, D, dtype=dtype)
    keys = kv_dtype or dtype
    with device_checks_off():
        return launches(
            lambda: snapkv_scores_triton(
                q,
                torch.arange(Wq).repeat(S, 1),
                torch.zeros(S, Ng, D, dtype=keys),
                torch.full((S,), Ng),
                torch.zeros(S, Nr, D, dtype=keys),
                torch.arange(Nr).repeat(S, 1),
                0.088,
                k_scale=torch.ones(S) if kv_dtype else None,
            )
        )


def _decode_gate_launches(dtype, shape):
    from sglang_wgkv.gate import GateConfig, WriteGates
    from sglang_wgkv.gate.triton_gate import DecodeGate

    B, (_, H, D) = 4, shape
    gates = WriteGates(GateConfig(num_layers=1, num_kv_heads=H, head_dim=D, local_window=256))
    gate = DecodeGate(gates, max_rows=B * H)
    k = torch.zeros(B, H, D, dtype=dtype)
    with device_checks_off():
        return launches(lambda: gate(0, k, k.clone(), torch.full((B,), 0.1), num_splits=16))


def _pool_launches(dtype, shape, kv_dtype=None):
    """The decode step's pool kernels: promotion (one-program scan and, past PROMOTE_SCAN_BLOCK items,
    the blocked scan) and the ring write (into ``kv_dtype`` pages, default ``dtype``)."""
    from unittest import mock

    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.memory import DualCachePool, triton_pool

    _, H, D = shape
    pool = DualCachePool(
        2,
        H,
        D,
        num_pages=64,
        max_requests=4,
        max_context_len=1024,
        config=WGKVConfig(local_window=256),
        dtype=kv_dtype or dtype,
        triton_decode=False,
    )
    for r in range(3):
        pool.alloc_request(r)
    req, pos = torch.tensor([0, 2, 1]), torch.tensor([300, 256, 700])
    k = torch.zeros(3, H, D, dtype=dtype)

    def step():
        triton_pool.decode_promote(pool, req, pos)
        with mock.patch.object(triton_pool, "PROMOTE_SCAN_BLOCK", 2):
            triton_pool.decode_promote(pool, req, pos)
        triton_pool.decode_write(pool, 0, req, pos, k, k.clone(), torch.ones(3, H, dtype=torch.bool))

    with device_checks_off():
        return launches(step)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "launcher",
    [
        _prefill_launches,
        _prefill_fa3_launches,
        _prefill_band_launches,
        _snapkv_launches,
        _decode_gate_launches,
        _pool_launches,
    ],
    ids=[
        "prefill_attention",
        "prefill_attention_fa3",
        "prefill_attention_band",
        "snapkv_scores",
        "decode_gate",
        "pool_decode_step",
    ],
)
def test_served_kernels_compile_for_sm90(launcher, shape):
    """Every launch the served prefill (plan, compaction, vertical-slash attention), the evictor's
    scores and the decode gate make, at Llama-3.1-8B's and SmolLM2's shapes in bf16, compiles for
    sm_90 within its shared memory."""
    captured = launcher(torch.bfloat16, SHAPES[shape])
    assert captured
    for kernel, bound, options in captured:
        compiled = compile_sm90(kernel, bound, options)
        assert compiled.metadata.shared <= SM90_MAX_SHARED, kernel.fn.__name__


def test_prefill_with_fa3_launches_the_paged_compaction_entries_and_band():
    """With FA3 on the vertical range the prefill launches the plan, the compaction into pages, the FA3
    entries and the band kernel starting from FA3's state; without it, the one-pass kernel."""
    got = _prefill_fa3_launches(torch.bfloat16, SHAPES["llama8b"])
    names = [kernel.fn.__name__ for kernel, _, _ in got]
    assert names == ["_plan_kernel", "_compact_fwd", "_entries_kernel", "_vertical_slash_fwd"], names
    assert got[1][1]["ALIGN"] == 64 and got[3][1]["VERTICAL_GIVEN"] is True
    plain = _prefill_launches(torch.bfloat16, SHAPES["llama8b"])
    assert plain[1][1]["ALIGN"] == 64 and plain[-1][1]["VERTICAL_GIVEN"] is False


def test_compile_takes_the_launch_specialization():
    """The CPU compile specializes arguments as a CUDA launch does (16-byte aligned pointers, integers
    divisible by 16): the split kernel's K/V gathers then become 16-byte ``cp.async`` copies and the
    served shape fits in 128 registers without spilling. Compiled without that, every gather was a
    2-byte scalar load and ptxas gave 255 registers with spills, which misread the kernel's occupancy."""
    import re

    from benchmarks.sm90_registers import ptxas_stats
    from sglang_wgkv.attention.decode_config import DecodeConfig

    ptx = compile_sm90(*split_kernel_launch(DecodeConfig())).asm["ptx"]
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (0x[0-9a-f]+)", ptx)
    assert copies and set(copies) == {"0x10"}
    stats = ptxas_stats(ptx)
    assert stats["registers"] <= 128 and stats["spill_store_bytes"] == 0


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_extend_write_kernels_compile_for_sm90(kv_dtype):
    """The extend's row-movement launches as the pool makes them for a chunk after a cached prefix
    (Llama-3.1-8B's 8 KV heads, D 128, bf16 or FP8 pool): the attention inputs
    (``triton_extend.extend_context``) and the write (``extend_move``, ``extend_ring_write``) compile
    for sm_90 and fit its shared memory; on FP8 pages the writes quantize with IEEE division and
    saturation, as ``kv_quant.quantize``."""
    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.memory import DualCachePool

    L, H, D = 1, 8, 128
    pool = DualCachePool(
        L,
        H,
        D,
        num_pages=400,
        max_requests=2,
        max_context_len=2048,
        config=WGKVConfig(local_window=256),
        triton_decode=True,
        triton_extend=True,
        dtype=kv_dtype,
    )
    pool.alloc_request(1)
    k = torch.randn(300, H, D, dtype=torch.bfloat16)
    pool.begin_extend([1], [0], [300])
    launches(lambda: pool.write_extend(0, k, k, torch.rand(300, H) < 0.5))  # the launches recorded, not run
    pool.begin_extend([1], [300], [300])
    admit, positions = torch.rand(300, H) < 0.5, torch.arange(300, 600)
    got = launches(lambda: pool.extend_inputs(0, k, k, admit, positions, torch.bfloat16))
    got += launches(lambda: pool.write_extend(0, k, k, admit))
    names = [kernel.fn.__name__ for kernel, _, _ in got]
    assert names == ["_extend_context_kernel", "_extend_move_kernel", "_extend_ring_kernel"], names
    for kernel, bound, options in got:
        compiled = compile_sm90(kernel, bound, options)
        assert compiled.metadata.shared <= SM90_MAX_SHARED
        if kv_dtype != torch.bfloat16 and kernel.fn.__name__ != "_extend_context_kernel":
            ptx = compiled.asm["ptx"]
            assert "satfinite.e4m3x2" in ptx and "div.rn.f32" in ptx, kernel.fn.__name__


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_decode_kernels_compile_for_sm90(kv_dtype):
    """With FP8 pages: the split kernel (bf16 queries taken to fp16, FP8 keys and values converted to
    fp16 in registers, the fused ring write quantizing with saturation) and the decode step's pool
    kernels compile for sm_90 within its shared memory; the PTX converts with the hardware's
    saturating FP8 instructions and IEEE division."""
    from sglang_wgkv.attention.decode_config import DecodeConfig

    compiled = compile_sm90(
        *split_kernel_launch(DecodeConfig(), batch=2, pos=300, splits=16, observe=True, kv_dtype=kv_dtype)
    )
    assert compiled.metadata.shared <= SM90_MAX_SHARED
    fmt = "e4m3" if kv_dtype == torch.float8_e4m3fn else "e5m2"
    ptx = compiled.asm["ptx"]
    assert f"satfinite.{fmt}x2" in ptx and f".{fmt}x2" in ptx.replace(f"satfinite.{fmt}x2", "")
    # keys and values go FP8 -> fp16 (two per instruction) straight into fp16 dots, no bf16 step
    assert "cvt.bf16.f16" not in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    # quantizing divides as torch does (IEEE), so the stored bytes equal kv_quant.quantize's
    assert "div.rn.f32" in ptx
    for kernel, bound, options in _pool_launches(torch.bfloat16, SHAPES["llama8b"], kv_dtype):
        pool_kernel = compile_sm90(kernel, bound, options)
        assert pool_kernel.metadata.shared <= SM90_MAX_SHARED, kernel.fn.__name__
        if "satfinite" in pool_kernel.asm["ptx"]:  # the ring write: it quantizes
            assert "div.full.f32" not in pool_kernel.asm["ptx"], kernel.fn.__name__
    # the evictor's scores read the stored FP8 keys (one byte each) and convert them in registers
    ((kernel, bound, options),) = _snapkv_launches(torch.bfloat16, SHAPES["llama8b"], kv_dtype)
    scores = compile_sm90(kernel, bound, options)
    assert scores.metadata.shared <= SM90_MAX_SHARED
    assert "ld.global" in scores.asm["ptx"] and f".{fmt}x2" in scores.asm["ptx"]


# Sizes that change from launch to launch: specialized (an integer 1 made a constant, one divisible
# by 16 marked so), each new combination is a compile that a serving request waits for.
UNSPECIALIZED_SIZES = {
    "sglang_wgkv.attention.triton_prefill._vertical_slash_fwd": {"compact_rows", "num_blocks", "num_q"},
    "sglang_wgkv.attention.fa3_vertical._entries_kernel": {
        "num_q",
        "num_blocks",
        "rows_per_head",
        "max_pages",
    },
    "sglang_wgkv.attention.triton_prefill_plan._compact_fwd": {"num_keys", "num_seqs"},
    "sglang_wgkv.attention.triton_prefill_plan._plan_kernel": {"num_seqs", "num_q", "n_iter"},
    "sglang_wgkv.attention.triton_decode_split._split_kernel": {"num_splits"},
    "sglang_wgkv.attention.triton_decode_merge._merge_kernel": {"num_splits"},
    "sglang_wgkv.gate.triton_gate._decode_gate_kernel": {"num_splits", "slice_width"},
    "sglang_wgkv.gate.triton_prefill_gate._prefill_gate_kernel": {"T"},
    "sglang_wgkv.memory.triton_pool_write_kernels._prefill_write_kernel": {"n_tokens", "leaving"},
    "sglang_wgkv.memory.triton_pool_write_kernels._decode_write_kernel": {"layer"},
    "sglang_wgkv.memory.triton_extend._extend_context_kernel": {"layer"},  # the batch: a segment table
    "sglang_wgkv.memory.triton_extend._extend_move_kernel": {"layer", "n_cand", "stride_c"},
    "sglang_wgkv.memory.triton_extend._extend_ring_kernel": {"layer", "n_rows"},
    "sglang_wgkv.memory.triton_snapkv._snapkv_raw_kernel": {"Wq", "Nr"},
}


# Index and per-forward buffers that a launch passes as views at batch-dependent offsets (a layer's
# page-table rows, the decode rows of a mixed batch) or with batch-dependent strides: their pointers'
# alignment and their strides' divisibility are left unspecialized. Strides and pointers of the K/V
# pages, queries and outputs keep theirs: the loads' width depends on it.
UNSPECIALIZED_VIEWS = {
    # a layer's slices of a group of layers' arrays, a layer's row of the forward's segment table
    "sglang_wgkv.memory.triton_extend._extend_context_kernel": {"Segments", "Admit"},
    "sglang_wgkv.memory.triton_extend._extend_move_kernel": {"Flag", "DestPage", "Dest", "SrcPage"},
    "sglang_wgkv.memory.triton_extend._extend_ring_kernel": {"Admit"},
    "sglang_wgkv.attention.fa3_vertical._entries_kernel": {
        "QStart",
        "QEnd",
        "CompactStart",
        "Vertical",
        "CuQ",
        "SeqLens",
        "PageTable",
    },
    "sglang_wgkv.attention.triton_prefill._vertical_slash_fwd": {
        "stride_an",
        "stride_vn",
        "stride_vg",
        "stride_lg",
        "Adm",
        "QPos",
        "KPos",
        "BQStart",
        "BQEnd",
        "BCompactStart",
        "BBandStart",
        "BBandEnd",
        "BVertical",
        "OV",
        "LseV",
    },
    "sglang_wgkv.attention.triton_prefill_plan._compact_fwd": {
        "stride_an",
        "stride_ah",
        "stride_en",
        "stride_eh",
        "Adm",
        "Excl",
        "KV",
    },
    "sglang_wgkv.attention.triton_prefill_plan._plan_kernel": {
        "stride_en",
        "stride_eh",
        "QO",
        "KV",
        "QPos",
        "KPos",
        "Excl",
        "QStart",
        "QEnd",
        "KVStart",
        "BandStart",
        "BandEnd",
        "Vertical",
        "CompactStart",
    },
    "sglang_wgkv.attention.triton_decode_split._split_kernel": {
        "stride_yr",
        "stride_lb",
        "stride_lh",
        "obs_window",
        "PageTable",
        "GlobalLen",
        "Req",
        "RingTokens",
        "SplitsDone",
        "Pos",
        "ObsPos",
        "ObsRow",
        "KScale",
        "VScale",
    },
    "sglang_wgkv.attention.triton_decode_merge._merge_kernel": {
        "stride_lb",
        "stride_lh",
        "GlobalLen",
        "Req",
        "RingTokens",
    },
    "sglang_wgkv.gate.triton_gate._decode_gate_kernel": {
        "stride_ub",
        "Tau",
        "Uniform",
        "Partial",
        "Count",
        "Admit",
        "G",
    },
    "sglang_wgkv.gate.triton_prefill_gate._prefill_gate_kernel": {
        "stride_ut",
        "G",
        "Tau",
        "Uniform",
        "Admit",
    },
    "sglang_wgkv.memory.triton_pool_write_kernels._prefill_write_kernel": {
        "stride_an",
        "PageRow",
        "Admit",
        "Rank",
        "GlobalLen",
    },
    "sglang_wgkv.memory.triton_pool_write_kernels._decode_write_kernel": {
        "stride_ab",
        "PageTable",
        "RingFlag",
        "Admit",
        "Req",
        "Pos",
        "KScale",
        "VScale",
    },
}


@pytest.mark.parametrize("path", sorted(UNSPECIALIZED_SIZES))
def test_served_kernels_take_sizes_unspecialized(path):
    """Every launch-to-launch size of a served kernel is ``do_not_specialize``; strides and pointers
    keep their divisibility and alignment except those of :data:`UNSPECIALIZED_VIEWS`."""
    import importlib

    module, name = path.rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    params = {p.name: p for p in kernel.params}
    views = UNSPECIALIZED_VIEWS.get(path, set())
    missing = (UNSPECIALIZED_SIZES[path] | views) - params.keys()
    assert not missing, f"{path} has no parameters {missing}"
    assert {n for n in UNSPECIALIZED_SIZES[path] if not params[n].do_not_specialize} == set()
    loose = {n for n, p in params.items() if p.do_not_specialize or p.do_not_specialize_on_alignment}
    assert loose - UNSPECIALIZED_SIZES[path] == views
