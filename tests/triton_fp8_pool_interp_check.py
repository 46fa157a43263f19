"""Run as a script with ``TRITON_INTERPRET=1`` (set before Triton is imported) by
``test_triton_pool_interp.py``, and imported by ``test_gpu_fp8.py`` (compiled, CUDA): an FP8 pool's
Triton decode launches (promotion, which moves bytes, and the ring write, which quantizes) and extend
launches (chunks after a cached prefix: attention inputs dequantized from the pages, ring rows moved as
bytes, new rows quantized) against the same pool on torch ops, on CPU.

``python tests/triton_fp8_pool_interp_check.py SEED/DTYPE...`` (DTYPE ``e4m3`` or ``e5m2``) prints a
line per case and exits non-zero if any differs: page tables, lengths, flags and counters equal; page contents
equal within the interpreter's FP8 rounding (:func:`interp_decode_check.pages_match`: bit for bit on
a GPU).
"""

import os
import random
import sys

import torch  # noqa: E402
from interp_decode_check import pages_match

from sglang_wgkv.config import WGKVConfig  # noqa: E402
from sglang_wgkv.memory import DualCachePool  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402

L, H, D, W, R, CTX = 2, 3, 16, 32, 4, 320
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def make_pool(dtype, triton, device):
    pool = DualCachePool(
        L, H, D, num_pages=200, max_requests=R, max_context_len=CTX, config=WGKVConfig(local_window=W),
        dtype=dtype, device=device, triton_decode=triton, triton_extend=triton, compute_dtype=torch.bfloat16,
    )  # fmt: skip
    pool.set_kv_scales([0.8, 2.5], [1.7, 0.3])
    return pool


def check_same(a, b, where, exact):
    for name in ("page_table", "global_len", "ring_flag", "left_ring", "promoted"):
        if not torch.equal(getattr(a, name), getattr(b, name)):
            raise AssertionError(f"{where}: {name} differs")
    for name in ("k_pages", "v_pages"):
        if not pages_match(getattr(b, name)[:-1], getattr(a, name)[:-1], exact):
            raise AssertionError(f"{where}: {name} differs beyond FP8 rounding")


def main(seed: int, dtype: torch.dtype, device: str = "cpu") -> str:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ref, tri = make_pool(dtype, False, device), make_pool(dtype, True, device)
    slots = [1, 3]
    for pool in (ref, tri):
        for r in slots:
            pool.alloc_request(r)
    lens = [rng.randrange(20, 70) for _ in slots]
    k = (torch.randn(L, sum(lens), H, D, generator=gen) * 3).to(device)
    v = torch.randn(L, sum(lens), H, D, generator=gen).to(device)
    admit = (torch.rand(L, sum(lens), H, generator=gen) < 0.5).to(device)
    for pool in (ref, tri):
        pool.begin_extend(slots, [0, 0], lens)
    for pool in (ref, tri):  # one group (the pages allocated for both layers at once): each its own scale
        pool.write_extend_layers(0, k.bfloat16(), v.bfloat16(), admit)
    for step in range(40):  # rings fill, wrap and promote into new global pages
        seq = [int(ref.cached_len[r]) for r in slots]
        kd = (torch.randn(L, len(slots), H, D, generator=gen) * 3).bfloat16().to(device)
        vd = torch.randn(L, len(slots), H, D, generator=gen).bfloat16().to(device)
        ad = (torch.rand(L, len(slots), H, generator=gen) < 0.5).to(device)
        for pool in (ref, tri):
            plan = pool.begin_decode(slots, seq)
            for layer in range(L):
                pool.write_decode_rows(layer, plan.req, plan.pos, kd[layer], vd[layer], ad[layer])
        check_same(ref, tri, f"seed {seed} step {step}", exact=device == "cuda")
    if int(ref.promoted.sum()) == 0:
        raise AssertionError("no promotion ran")
    for chunk in range(2):  # chunks after the cached prefix: ring rows leave, new rows pass through and stay
        seq = [int(ref.cached_len[r]) for r in slots]
        lens = [rng.randrange(1, 2 * W) for _ in slots]
        N = sum(lens)
        kc = (torch.randn(L, N, H, D, generator=gen) * 3).bfloat16().to(device)
        vc = torch.randn(L, N, H, D, generator=gen).bfloat16().to(device)
        ac = (torch.rand(L, N, H, generator=gen) < 0.5).to(device)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(seq, lens)]).to(device)
        for pool in (ref, tri):
            pool.begin_extend(slots, seq, lens)
        for layer in range(L):
            args = (layer, kc[layer], vc[layer], ac[layer], positions, torch.float32)
            tri.triton_extend = False  # the torch read of the same pages is what the kernel must give
            want = tri.extend_inputs(*args)
            tri.triton_extend = True
            got = tri.extend_inputs(*args)
            for name, a, b in zip(("keys", "values", "k_pos", "admitted"), want, got):
                if a.dtype != b.dtype or not torch.equal(a, b):
                    raise AssertionError(
                        f"seed {seed} chunk {chunk} layer {layer}: extend input {name} differs"
                    )
            if chunk == 0:
                for pool in (ref, tri):
                    pool.write_extend(layer, kc[layer], vc[layer], ac[layer])
        if chunk == 1:  # the second chunk's writes in one group, after every layer read its context
            for pool in (ref, tri):
                pool.write_extend_layers(0, kc, vc, ac)
        check_same(ref, tri, f"seed {seed} chunk {chunk}", exact=device == "cuda")
    return f"{dtype}: {int(ref.promoted.sum())} promotions"


def run(case: str) -> str:
    """``SEED/DTYPE`` (DTYPE ``e4m3`` or ``e5m2``)."""
    seed, _, dtype = case.partition("/")
    return main(int(seed), DTYPES[dtype])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.exit(check_seeds(run, sys.argv[1:]))
