"""The dual pool in FP8 against the same pool in float32, driven through the same extends and decodes.

What must hold (:mod:`sglang_wgkv.memory.kv_quant`): the same page tables, lengths and flags; every
stored byte equal to one rounding of the exact value, ``fp8(x / scale)`` (so promotion, snapshots and
compaction moved bytes and never rounded twice); attention within the error FP8's precision allows
and equal to attention over the once-rounded values. Each check is shown to fail under a mutation
(scale skipped, double rounding, scale skipped on read).
"""

import math

import pytest
import torch

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import paged_decode_attention, vertical_slash_attention
from sglang_wgkv.config import PAGE_SIZE, WGKVConfig
from sglang_wgkv.memory import DualCachePool, decode_step, extend_step, kv_quant, kv_scales
from sglang_wgkv.memory.kv_quant import dequantize, mantissa_bits, quantize

pytestmark = pytest.mark.core

L, H, HQ, D, W = 2, 2, 4, 16, 32
K_SCALE, V_SCALE = [0.37, 2.0], [1.5, 0.25]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_error(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Largest error of one rounding of ``x`` (float64) to ``dtype`` at ``scale``: half an ulp,
    relative in the normal range, absolute (half the smallest subnormal) below it."""
    m = mantissa_bits(dtype)
    smallest_subnormal = torch.finfo(dtype).smallest_normal * 2.0**-m
    return x.abs() * 2.0 ** -(m + 1) + scale * smallest_subnormal / 2


def attention_bound(q, keys, values, k_err, v_err, sm_scale) -> float:
    """Bound on ``|softmax(q k^T s) v - softmax(q k'^T s) v'|`` with ``|k - k'| <= k_err``,
    ``|v - v'| <= v_err`` elementwise: logits move by at most ``delta``, probabilities by a factor
    ``e^{±2 delta}``."""
    delta = sm_scale * float((q.abs().double().reshape(-1, D) @ k_err.reshape(-1, D).t()).max())
    return math.expm1(2 * delta) * float(values.abs().max()) + float(v_err.max())


def make_pool(dtype):
    pool = DualCachePool(L, H, D, 160, 3, 192, WGKVConfig(local_window=W), dtype=dtype)
    if pool.quantized:
        pool.set_kv_scales(K_SCALE, V_SCALE)
    return pool


def extend(pool, slots, prefix, lens, q, k, v, admit):
    plan = pool.begin_extend(slots, prefix, lens)
    outs = []
    for layer in range(L):
        keys, values, k_pos, adm = pool.extend_inputs(
            layer, k[layer], v[layer], admit[layer], q_pos(prefix, lens), torch.float32
        )
        qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        kv_lens = [
            sum(extend_step.context_rows(S, gc[layer], W)) + n
            for gc, S, n in zip(plan.context_gcols, prefix, lens)
        ]
        kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
        outs.append(
            vertical_slash_attention(q[layer], keys, values, adm, qo, kv, q_pos(prefix, lens), k_pos, W)
        )
        pool.write_extend(layer, k[layer], v[layer], admit[layer])
    return torch.stack(outs)


def q_pos(prefix, lens):
    return torch.cat([torch.arange(S, S + n) for S, n in zip(prefix, lens)])


def decode(pool, slots, seq_lens, q, k, v, admit):
    pool.begin_decode(slots, seq_lens)
    outs = []
    for layer in range(L):
        pool.write_decode(layer, k[layer], v[layer], admit[layer])
        rows, num_pages, last, _ = pool.decode_page_rows(layer)
        indptr, indices, last_len = build_folded_indices(rows, num_pages, last)
        outs.append(
            paged_decode_attention(
                q[layer], pool.k_pages, pool.v_pages, indptr, indices, last_len,
                k_scale=pool.k_scale[layer], v_scale=pool.v_scale[layer],
            )
        )  # fmt: skip
    return torch.stack(outs)


def page_scales(pool, scales) -> torch.Tensor:
    """``[num_pages + 1]`` the scale of each page's layer (1.0 for free pages)."""
    out = torch.ones(pool.k_pages.shape[0], dtype=torch.float32)
    for layer in range(L):
        rows = pool.page_table[:, layer, :, : pool.dump_col]
        out[rows[rows != pool.dump_page].long()] = scales[layer]
    return out


def live_entries(pool) -> torch.Tensor:
    """``[num_pages + 1, 16]`` bool: the entries holding a cached token (ring or global)."""
    live = torch.zeros(pool.k_pages.shape[:2], dtype=torch.bool)
    for r in range(pool.max_requests):
        ring = min(int(pool.cached_len[r]), W)
        for l in range(L):
            for h in range(H):
                row = pool.page_table[r, l, h].long()
                for s in range(ring):
                    live[row[s // PAGE_SIZE], s % PAGE_SIZE] = True
                for i in range(int(pool.global_len[r, l, h])):
                    live[row[pool.ring_cols + i // PAGE_SIZE], i % PAGE_SIZE] = True
    return live


def run(dtype, seed=0):
    """The same workload on a float32 pool and an FP8 pool; returns the names of the checks that fail."""
    gen = torch.Generator().manual_seed(seed)
    ref, q8 = make_pool(torch.float32), make_pool(dtype)
    failed = set()

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 2

    def compare(out_ref, out_q8, keys, values, q, ok_name):
        # error bound over every key and value the queries could have read (the pool's all)
        k_err = fp8_error(keys.double(), dtype, max(K_SCALE))
        v_err = fp8_error(values.double(), dtype, max(V_SCALE))
        bound = attention_bound(q, keys, values, k_err, v_err, 1 / math.sqrt(D))
        if not (out_q8 - out_ref).abs().max() <= bound:
            failed.add(ok_name)

    for pool in (ref, q8):
        for r in (0, 1, 2):
            pool.alloc_request(r)
    steps = [("extend", [0, 1], [0, 0], [40, 20]), ("extend", [0, 1], [40, 20], [33, 50])]
    steps += [("decode",)] * 20
    steps += [("snapshot",), ("extend", [2], [93], [24])] + [("decode",)] * 6 + [("compact",)]
    for step in steps:
        if step[0] == "extend":
            _, slots, prefix, lens = step
            N = sum(lens)
            q, k, v = rand(L, N, HQ, D), rand(L, N, H, D), rand(L, N, H, D)
            admit = torch.rand(L, N, H, generator=gen) < 0.5
            for layer in range(L):  # the cached context reads back as the once-rounded values
                for r, S in zip(slots, prefix):
                    if not S:
                        continue
                    got, want = q8.gather_context(layer, r, S), ref.gather_context(layer, r, S)
                    live = (want[2] != extend_step.FAR_POSITION)[:, None] | want[3]  # [Nk, H]
                    for x8, xr, scale in ((got[0], want[0], K_SCALE), (got[1], want[1], V_SCALE)):
                        once = dequantize(quantize(xr, scale[layer], dtype), scale[layer], torch.float32)
                        if not torch.equal(x8[live], once[live]):
                            failed.add("extend context over once-rounded values")
            out_ref = extend(ref, slots, prefix, lens, q, k, v, admit)
            out_q8 = extend(q8, slots, prefix, lens, q, k, v, admit)
            compare(out_ref, out_q8, torch.cat([ref.k_pages.flatten(0, 1), k.flatten(0, 2)]),
                    torch.cat([ref.v_pages.flatten(0, 1), v.flatten(0, 2)]), q, "extend attention")  # fmt: skip
        elif step[0] == "decode":
            slots = [r for r in (0, 1, 2) if ref.cached_len[r]]
            B = len(slots)
            q, k, v = rand(L, B, HQ, D), rand(L, B, H, D), rand(L, B, H, D)
            admit = torch.rand(L, B, H, generator=gen) < 0.5
            seq = [int(ref.cached_len[r]) for r in slots]
            out_ref = decode(ref, slots, seq, q, k, v, admit)
            out_q8 = decode(q8, slots, seq, q, k, v, admit)
            compare(out_ref, out_q8, ref.k_pages, ref.v_pages, q, "decode attention")
            # equal to attention over the once-rounded values
            once = make_pool(torch.float32)
            once.k_pages = dequantize(quantize(ref.k_pages, page_scales(ref, K_SCALE)[:, None, None], dtype),
                                      page_scales(ref, K_SCALE)[:, None, None], torch.float32)  # fmt: skip
            once.v_pages = dequantize(quantize(ref.v_pages, page_scales(ref, V_SCALE)[:, None, None], dtype),
                                      page_scales(ref, V_SCALE)[:, None, None], torch.float32)  # fmt: skip
            for layer in range(L):
                rows, num_pages, last, _ = ref.decode_page_rows(layer)
                ind = build_folded_indices(rows, num_pages, last)
                exact = paged_decode_attention(q[layer], once.k_pages, once.v_pages, *ind)
                if not torch.allclose(out_q8[layer], exact, atol=1e-5, rtol=1e-5):
                    failed.add("decode attention over once-rounded values")
        elif step[0] == "snapshot":  # slot 0's prefix continued by slot 2
            for pool in (ref, q8):
                snap = pool.take_snapshot(0)
                pool.free_request(2)
                pool.alloc_request(2)
                pool.restore_snapshot(2, snap)
                pool.release_snapshot(snap)
        else:  # the evictor's compaction: every other global entry of each of slot 1's streams
            for pool in (ref, q8):
                S = L * H
                r, l, h = (
                    torch.ones(S, dtype=torch.long),
                    torch.arange(L).repeat_interleave(H),
                    torch.arange(H).repeat(L),
                )
                ng = -(-int(pool.global_len[1].max()) // PAGE_SIZE) * PAGE_SIZE
                keep = (torch.arange(ng) % 2 == 0).expand(S, ng).clone()
                pool.release_pages(pool.compact_global(r, l, h, keep))
    for name in ("page_table", "global_len", "ring_flag"):
        if not torch.equal(getattr(ref, name), getattr(q8, name)):
            failed.add(name)
    live = live_entries(ref)  # (free pages and page tails keep stale bytes of another layer)
    for pages, scales in (("k_pages", K_SCALE), ("v_pages", V_SCALE)):
        expect = quantize(getattr(ref, pages), page_scales(ref, scales)[:, None, None], dtype)
        if not torch.equal(expect.view(torch.uint8)[live], getattr(q8, pages).view(torch.uint8)[live]):
            failed.add(f"{pages} bytes")
    ref.check_integrity(), q8.check_integrity()
    return sorted(failed)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_pool_stores_one_rounding_and_attends_within_fp8_error(dtype):
    assert run(dtype) == []


def _skip_scale(real):
    return lambda x, scale, dtype: real(x, 1.0, dtype)


def _round_twice(real):  # (only FP8 writes: the float32 pool must keep the exact values)
    return lambda x, scale, dtype: real(
        x.to(torch.bfloat16).float() if kv_quant.is_fp8(dtype) else x, scale, dtype
    )


@pytest.mark.parametrize(
    "target, mutation, expect",
    [
        (
            "write",
            _skip_scale,
            {"k_pages bytes", "v_pages bytes", "decode attention over once-rounded values"},
        ),
        ("write", _round_twice, {"k_pages bytes", "v_pages bytes"}),
        (
            "read",
            _skip_scale,
            {"decode attention over once-rounded values", "extend context over once-rounded values"},
        ),
    ],
    ids=["write-without-scale", "write-rounding-twice", "read-without-scale"],
)
def test_mutations_fail_the_checks(monkeypatch, target, mutation, expect):
    dtype = torch.float8_e4m3fn
    if target == "write":
        for module in (decode_step, extend_step):
            monkeypatch.setattr(module, "quantize", mutation(kv_quant.quantize))
    else:
        monkeypatch.setattr(kv_scales, "dequantize", mutation(kv_quant.dequantize))
        monkeypatch.setattr("sglang_wgkv.attention.reference.dequantize", mutation(kv_quant.dequantize))
    failed = set(run(dtype))
    assert expect <= failed, failed


def test_scales_are_checked_and_set_only_on_an_empty_fp8_pool():
    pool = make_pool(torch.float8_e4m3fn)
    assert pool.page_bytes == 2 * PAGE_SIZE * D and make_pool(torch.bfloat16).page_bytes == 4 * PAGE_SIZE * D
    with pytest.raises(ValueError, match="positive and finite"):
        pool.set_kv_scales([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 layers"):
        pool.set_kv_scales([1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="applies no KV scales"):
        make_pool(torch.bfloat16).set_kv_scales(K_SCALE, V_SCALE)
    pool.alloc_request(0)
    pool.begin_extend([0], [0], [5])
    with pytest.raises(RuntimeError, match="holds no page"):
        pool.set_kv_scales(K_SCALE, V_SCALE)
    # compaction moves stored bytes: dequantized keys are refused
    with pytest.raises(ValueError, match="stored keys"):
        pool.compact_global(
            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.ones(1, 16, dtype=torch.bool), g_keys=torch.zeros(1, 16, D),
        )  # fmt: skip


def test_quantize_saturates_instead_of_overflowing():
    for dtype in FP8:
        big = torch.tensor([1e6, -1e6, 3.0])
        out = dequantize(quantize(big, 0.5, dtype), 0.5, torch.float32)
        limit = torch.finfo(dtype).max * 0.5
        assert out.tolist()[:2] == [limit, -limit] and out[2] == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_cpu_pages_are_zeros_not_resident_until_written(dtype):
    """A CPU pool's pages equal ``torch.zeros`` (contiguous, writable, any served dtype) but come from
    calloc'd memory: 512 MiB of them add almost nothing to the resident set until written, so a
    default CPU server neither spends its start-up zero-filling gigabytes nor holds them in RAM."""
    import psutil

    from sglang_wgkv.memory.dual_pool import zeroed_pages

    small = zeroed_pages((3, 16, 8), dtype, torch.device("cpu"))
    assert small.dtype == dtype and small.shape == (3, 16, 8) and small.is_contiguous()
    assert torch.equal(small.float(), torch.zeros(3, 16, 8))
    small[1, 2, 3] = 1
    assert small.float().sum() == 1
    rows = (512 << 20) // (16 * 64 * small.element_size())
    rss = psutil.Process().memory_info().rss
    big = zeroed_pages((rows, 16, 64), dtype, torch.device("cpu"))
    assert psutil.Process().memory_info().rss - rss < (64 << 20)
    assert big[-1].float().abs().sum() == 0
