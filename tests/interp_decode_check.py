"""Triton ``folded_decode`` against the reference over a DualCachePool filled through its real API.

Imported by the GPU tests; run as a script (one process per case) for the CPU interpreter tests,
since ``TRITON_INTERPRET=1`` must be set before the kernel module is imported::

    TRITON_INTERPRET=1 python tests/interp_decode_check.py CASE

prints one JSON line per comparison and exits 1 on the first mismatch.
"""

import json
import sys

import torch

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import paged_decode_attention
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool

TOL = {torch.float16: (3e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative norm, max abs)

# Interpreter cases: small, but with ring-only streams, ring + global streams, a 1-token stream
# (a request that joins at position 0), many splits (some empty) and several block sizes.
CASES = {
    # D, Hq, Hkv, dtype, W, prefill lengths, late joiners, decode steps, admit prob, [(splits, block_n)]
    "d64_g3_fp16": dict(D=64, Hq=9, Hkv=3, dtype=torch.float16, W=32, plens=[300, 20, 77], late=0, steps=2,
                        p_admit=0.5, launches=[(1, 64), (3, 32), (8, 16)]),
    "d128_g4_bf16": dict(D=128, Hq=8, Hkv=2, dtype=torch.bfloat16, W=32, plens=[200, 45], late=1, steps=2,
                         p_admit=0.3, launches=[(2, 64), (16, 16)]),
}


def close(out: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[bool, float, float]:
    """Compare in fp32: (within tolerance, relative norm error, max abs error)."""
    err = out.float() - ref.float()
    rel = (err.norm() / ref.float().norm().clamp(min=1e-6)).item()
    mx = err.abs().max().item()
    rel_tol, abs_tol = TOL[dtype]
    return bool(torch.isfinite(out.float()).all()) and rel < rel_tol and mx < abs_tol, rel, mx


class PoolCase:
    """A pool with ``len(plens)`` prefilled requests plus ``late`` requests that start decoding at
    position 0; :meth:`step` runs one decode step (``begin_decode`` + ``write_decode`` per layer)."""

    def __init__(self, D, Hq, Hkv, dtype, W, plens, late, p_admit, device, num_layers=2, num_pages=None,
                 max_context=None, seed=0):
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.D, self.Hq, self.Hkv, self.dtype, self.device, self.p_admit = D, Hq, Hkv, dtype, device, p_admit
        self.L = num_layers
        B = len(plens) + late
        max_context = max_context or max(plens) + 64
        num_pages = num_pages or 2 * num_layers * Hkv * B * (-(-max_context // 16) + 2)
        self.pool = DualCachePool(num_layers, Hkv, D, num_pages=num_pages, max_requests=B + 2,
                                  max_context_len=max_context, config=WGKVConfig(local_window=W), dtype=dtype,
                                  device=device)
        free = self.pool.allocator.free_stack  # pages handed out in random order, as in a used pool
        free.copy_(free[torch.randperm(free.numel(), generator=self.gen).to(device)])
        # Slots out of order, one unused slot in between: the kernel must index rows by slot.
        self.slots = [B + 1 - i for i in range(B)]
        for r in self.slots:
            self.pool.alloc_request(r)
        pre = self.slots[: len(plens)]
        self.pool.begin_extend(pre, [0] * len(plens), plens)
        N = sum(plens)
        for layer in range(num_layers):
            k, v = self.randn(N, Hkv, D), self.randn(N, Hkv, D)
            self.pool.write_extend(layer, k, v, self.admit(N, Hkv))
        self.seq = list(plens) + [0] * late
        self.plan = None

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype).to(self.device)

    def admit(self, *shape):
        return (torch.rand(*shape, generator=self.gen) < self.p_admit).to(self.device)

    def step(self):
        """Begin a decode step; yields each layer after its write, ready to be read."""
        self.plan = self.pool.begin_decode(self.slots, self.seq)
        B = len(self.slots)
        for layer in range(self.L):
            k, v = self.randn(B, self.Hkv, self.D), self.randn(B, self.Hkv, self.D)
            self.pool.write_decode(layer, k, v, self.admit(B, self.Hkv))
            yield layer
        self.seq = [s + 1 for s in self.seq]

    def query(self):
        return self.randn(len(self.slots), self.Hq, self.D)

    def reference(self, q, layer):
        rows, num_pages, last, _ = self.pool.decode_page_rows(layer)
        indptr, indices, last = build_folded_indices(rows, num_pages, last)
        return paged_decode_attention(q, self.pool.k_pages, self.pool.v_pages, indptr, indices, last)

    def kv_lengths(self, layer):
        """``[B, H]`` tokens per stream of the current step (after the write)."""
        return self.pool.decode_page_rows(layer)[3]


def run_case(name: str, device: str = "cpu") -> bool:
    from sglang_wgkv.attention.triton_decode import DecodeConfig, folded_decode

    c = CASES[name]
    case = PoolCase(c["D"], c["Hq"], c["Hkv"], c["dtype"], c["W"], c["plens"], c["late"], c["p_admit"], device)
    ok_all = True
    for step in range(c["steps"]):
        for layer in case.step():
            q = case.query()
            ref = case.reference(q, layer)
            for splits, block_n in c["launches"]:
                out = folded_decode(q, case.pool.k_pages, case.pool.v_pages, case.pool.page_table,
                                    case.pool.global_len, case.plan.req, case.plan.ring_tokens, layer,
                                    num_splits=splits, config=DecodeConfig(block_n=block_n))
                ok, rel, mx = close(out, ref, c["dtype"])
                print(json.dumps({"case": name, "step": step, "layer": layer, "splits": splits, "block_n": block_n,
                                  "kv_len": case.kv_lengths(layer).tolist(), "rel": rel, "max_abs": mx, "ok": ok}),
                      flush=True)
                ok_all &= ok
    return ok_all


if __name__ == "__main__":
    sys.exit(0 if all([run_case(name) for name in sys.argv[1:]]) else 1)
