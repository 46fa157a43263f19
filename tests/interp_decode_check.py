"""Triton ``folded_decode`` against the reference over a DualCachePool filled through its real API.

Imported by the GPU tests; run as a script (one process per case) for the CPU interpreter tests,
since ``TRITON_INTERPRET=1`` must be set before the kernel module is imported::

    TRITON_INTERPRET=1 python tests/interp_decode_check.py CASE

prints one JSON line per comparison and exits 1 if any mismatched.
"""

import json
import sys

import torch

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention.reference import paged_decode_attention
from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.kv_quant import is_fp8, mantissa_bits

EMPTY_SLOT = 0  # PoolCase never allocates request slots 0 and 1
TOL = {torch.float16: (3e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative norm, max abs)

# Interpreter cases: small, but with ring-only streams, ring + global streams, a 1-token stream
# (a request that joins at position 0), many splits (some empty), several block sizes and groups.
CASES = {
    # D, Hq, Hkv, dtype, W, prefill lengths, late joiners, decode steps, admit prob, [(splits, block_n)]
    "d64_g3_fp16": dict(
        D=64,
        Hq=9,
        Hkv=3,
        dtype=torch.float16,
        W=32,
        plens=[300, 20, 77],
        late=0,
        steps=1,
        p_admit=0.5,
        launches=[(1, 64), (3, 32), (8, 16)],
    ),
    "d128_g4_bf16": dict(
        D=128,
        Hq=8,
        Hkv=2,
        dtype=torch.bfloat16,
        W=32,
        plens=[200, 45],
        late=1,
        steps=1,
        p_admit=0.3,
        launches=[(2, 64), (16, 16)],
    ),
    # group 6: the fused merge takes the query heads of a KV head in two passes of at most 4
    "d64_g6_fp16": dict(
        D=64,
        Hq=12,
        Hkv=2,
        dtype=torch.float16,
        W=32,
        plens=[120, 50],
        late=1,
        steps=1,
        p_admit=0.5,
        launches=[(1, 64), (4, 16)],
    ),
    # FP8 pages (kv_dtype) read by bf16 / fp16 queries, with per-layer scales (SCALES)
    "d64_g3_e4m3_bf16": dict(
        D=64,
        Hq=9,
        Hkv=3,
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn,
        W=32,
        plens=[150, 20],
        late=1,
        steps=1,
        p_admit=0.5,
        launches=[(1, 64), (3, 16)],
    ),
    "d128_g2_e5m2_fp16": dict(
        D=128,
        Hq=4,
        Hkv=2,
        dtype=torch.float16,
        kv_dtype=torch.float8_e5m2,
        W=32,
        plens=[90, 20],
        late=0,
        steps=1,
        p_admit=0.5,
        launches=[(2, 32)],
    ),
}
SCALES = ([0.6, 1.7], [1.3, 0.45])  # (k_scale, v_scale) per layer of an FP8 case's pool


def pages_match(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Pages equal bit for bit (the GPU converts to FP8 by round-to-nearest-even, as torch). FP8 pages
    under Triton's interpreter (``exact`` False): within one ulp, or half of torch's value where torch
    rounded up to a power of two (the interpreter's conversion drops that carry into the exponent)."""
    if not is_fp8(a.dtype):
        return torch.equal(a, b)
    if exact:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    af, bf = a.float(), b.float()
    ulp = bf.abs() * 2.0 ** -mantissa_bits(a.dtype) + torch.finfo(a.dtype).smallest_normal
    power_of_two = (bf != 0) & (torch.frexp(bf).mantissa.abs() == 0.5)
    lost_carry = power_of_two & (af == bf / 2)
    return bool((((af - bf).abs() <= ulp) | lost_carry).all())


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

    def __init__(
        self,
        D,
        Hq,
        Hkv,
        dtype,
        W,
        plens,
        late,
        p_admit,
        device,
        num_layers=2,
        num_pages=None,
        max_context=None,
        seed=0,
        kv_dtype=None,
    ):
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.D, self.Hq, self.Hkv, self.dtype, self.device, self.p_admit = D, Hq, Hkv, dtype, device, p_admit
        self.L = num_layers
        B = len(plens) + late
        max_context = max_context or max(plens) + 64
        num_pages = num_pages or 2 * num_layers * Hkv * B * (-(-max_context // 16) + 2)
        self.pool = DualCachePool(
            num_layers,
            Hkv,
            D,
            num_pages=num_pages,
            max_requests=B + 2,
            max_context_len=max_context,
            config=WGKVConfig(local_window=W),
            dtype=kv_dtype or dtype,
            device=device,
            compute_dtype=dtype,
        )
        if self.pool.quantized:
            self.pool.set_kv_scales(
                [*SCALES[0], *SCALES[0]][:num_layers], [*SCALES[1], *SCALES[1]][:num_layers]
            )
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

    def step(self, before_write=None):
        """Begin a decode step; yields each layer after its write, ready to be read.
        ``before_write(layer, k, v)``, if given, sees each layer's new keys and values before the write."""
        self.plan = self.pool.begin_decode(self.slots, self.seq)
        B = len(self.slots)
        for layer in range(self.L):
            k, v = self.randn(B, self.Hkv, self.D), self.randn(B, self.Hkv, self.D)
            if before_write is not None:
                before_write(layer, k, v)
            self.pool.write_decode(layer, k, v, self.admit(B, self.Hkv))
            yield layer
        self.seq = [s + 1 for s in self.seq]

    def query(self):
        return self.randn(len(self.slots), self.Hq, self.D)

    def reference(self, q, layer, k_pages=None, v_pages=None):
        """The reference over the pool's pages (or ``k_pages``/``v_pages`` in the pool's layout)."""
        rows, num_pages, last, _ = self.pool.decode_page_rows(layer)
        indptr, indices, last = build_folded_indices(rows, num_pages, last)
        k_pages = self.pool.k_pages if k_pages is None else k_pages
        v_pages = self.pool.v_pages if v_pages is None else v_pages
        return paged_decode_attention(
            q, k_pages, v_pages, indptr, indices, last,
            k_scale=self.pool.k_scale[layer], v_scale=self.pool.v_scale[layer],
        )  # fmt: skip

    def kv_lengths(self, layer):
        """``[B, H]`` tokens per stream of the current step (after the write)."""
        return self.pool.decode_page_rows(layer)[3]


def run_case(name: str, device: str = "cpu") -> bool:
    """Every launch of the case with the fused merge and with two launches, over the pool's batch plus
    one row whose request slot holds no token (ring_tokens 0: its streams are empty, zeros expected).
    All runs share one workspace and write into NaN-filled outputs (a row left unwritten fails the
    comparison); the case's first launch shape runs twice, the second repeating the first bit for
    bit (the fused merge's counters were reset); the other shapes run once, after launches of other
    split counts in the same workspace.

    Each launch also runs with the ring write fused (``new_k``/``new_v``: ``write_new``; ``new_v``
    with other strides than ``new_k``), on a copy of the pages taken before the pool's own
    ``write_decode``: its output must match the reference after that write, and its copy of the pages
    must then equal the pool's, bit for bit. Those launches also record the queries in an observation
    window (``observe``, W_obs = W / 2; positions in layer 0 only), which must equal the evictor's
    torch record (``q_buf[row, pos % W_obs] = q``, ``q_pos[row, pos % W_obs] = pos``; ``row = req``,
    or a rotation of the slots given as ``obs_row`` in the two-launch runs)."""
    from sglang_wgkv.attention.decode_config import DecodeConfig, FoldedDecodeWorkspace
    from sglang_wgkv.attention.triton_decode import folded_decode

    c = CASES[name]
    case = PoolCase(
        c["D"], c["Hq"], c["Hkv"], c["dtype"], c["W"], c["plens"], c["late"], c["p_admit"], device,
        kv_dtype=c.get("kv_dtype"),
    )  # fmt: skip
    assert not case.pool.global_len[EMPTY_SLOT].any()
    ws = FoldedDecodeWorkspace(
        len(case.slots) + 1, c["Hq"], c["D"], max(s for s, _ in c["launches"]), device, num_kv_heads=c["Hkv"]
    )
    ok_all = True
    fused_writes = {}  # (layer, launch, merge) -> (outputs, k pages, v pages) of the fused-write runs

    R, w_obs = case.pool.max_requests, c["W"] // 2

    def window_buffers():
        return (
            torch.zeros(R, w_obs, c["Hq"], c["D"], dtype=c["dtype"], device=device),
            torch.full((R, w_obs), -1, dtype=torch.int64, device=device),
        )

    def launch(q, req, ring, layer, splits, block_n, fused, k_pages, v_pages, new=None, observe=None):
        extra = dict(zip(("new_k", "new_v", "pos", "window"), new)) if new else {}
        if observe is not None:
            extra["observe"] = observe
        return folded_decode(
            q,
            k_pages,
            v_pages,
            case.pool.page_table,
            case.pool.global_len,
            req,
            ring,
            layer,
            num_splits=splits,
            workspace=ws,
            out=torch.full_like(q, float("nan")),
            config=DecodeConfig(block_n=block_n, fused_merge=fused),
            k_scale=case.pool.k_scale[layer],
            v_scale=case.pool.v_scale[layer],
            **extra,
        )

    def runs(splits, block_n):
        return 2 if (splits, block_n) == c["launches"][0] else 1

    def rows(q_main):
        q = torch.cat([q_main, case.randn(1, c["Hq"], c["D"])])
        req = torch.cat([case.plan.req, case.plan.req.new_full((1,), EMPTY_SLOT)])
        ring = torch.cat([case.plan.ring_tokens, case.plan.ring_tokens.new_zeros(1)])
        return q, req, ring

    def before_write(layer, k, v):
        q, req, ring = rows(case.query())
        pos = torch.cat([case.plan.pos, case.plan.pos.new_zeros(1)])
        v_wide = torch.cat([v, v[:1]]).repeat(1, 1, 2)  # new_v [B, H, D] with row stride 2 * D
        new = (torch.cat([k, k[:1]]), v_wide[..., : c["D"]], pos, c["W"])
        # the two-launch runs map slots to window rows through a rotation (the evictor's rows
        # without a row per slot), the fused runs write row = slot
        rotation = torch.roll(torch.arange(R, device=device), 1)
        row_map = {True: None, False: rotation}  # by fused
        obs_refs = {}
        for fused, rows_of in row_map.items():
            ref = obs_refs[fused] = window_buffers()
            at = req if rows_of is None else rows_of[req]
            ref[0][at, pos % w_obs] = q
            if layer == 0:
                ref[1][at, pos % w_obs] = pos
        for splits, block_n in c["launches"]:
            for fused in (True, False):
                kp, vp = case.pool.k_pages.clone(), case.pool.v_pages.clone()
                obs_q, obs_pos = window_buffers()
                obs_ref = obs_refs[fused]
                outs = [
                    launch(
                        q,
                        req,
                        ring,
                        layer,
                        splits,
                        block_n,
                        fused,
                        kp,
                        vp,
                        new,
                        observe=(obs_q, obs_pos if layer == 0 else None, row_map[fused]),
                    )
                    for _ in range(runs(splits, block_n))
                ]
                observed = torch.equal(obs_q, obs_ref[0]) and torch.equal(obs_pos, obs_ref[1])
                fused_writes[layer, splits, block_n, fused] = (q, outs, kp, vp, observed)

    for step in range(c["steps"]):
        for layer in case.step(before_write):
            kv_len = case.kv_lengths(layer)
            n = torch.cat([kv_len, kv_len.new_zeros(1, c["Hkv"])]).long()
            q, req, ring = rows(case.query())
            for splits, block_n in c["launches"]:
                chunk = ((n + splits - 1) // splits + block_n - 1) // block_n * block_n
                used = (n + chunk.clamp(min=1) - 1) // chunk.clamp(min=1)  # non-empty splits per stream
                for fused in (True, False):
                    for write_new in (False, True):
                        if write_new:
                            q_w, outs, kp, vp, observed = fused_writes.pop((layer, splits, block_n, fused))
                            # FP8: the output is checked over the pages the kernel wrote (the GPU's
                            # equal the pool's; the interpreter's may hold a differently rounded token)
                            own = (kp, vp) if case.pool.quantized else (None, None)
                            ref = torch.cat(
                                [case.reference(q_w[:-1], layer, *own), torch.zeros_like(q_w[-1:])]
                            )
                            exact = device == "cuda"
                            pages_equal = pages_match(kp, case.pool.k_pages, exact) and pages_match(
                                vp, case.pool.v_pages, exact
                            )
                        else:
                            outs = [
                                launch(
                                    q,
                                    req,
                                    ring,
                                    layer,
                                    splits,
                                    block_n,
                                    fused,
                                    case.pool.k_pages,
                                    case.pool.v_pages,
                                )
                                for _ in range(runs(splits, block_n))
                            ]
                            ref = torch.cat([case.reference(q[:-1], layer), torch.zeros_like(q[-1:])])
                            pages_equal = observed = True
                        ok, rel, mx = close(outs[0], ref, c["dtype"])
                        repeat = torch.equal(outs[0], outs[-1])
                        good = ok and repeat and pages_equal and observed
                        print(
                            json.dumps(
                                {
                                    "case": name,
                                    "step": step,
                                    "layer": layer,
                                    "splits": splits,
                                    "block_n": block_n,
                                    "fused": fused,
                                    "write_new": write_new,
                                    "kv_len": kv_len.tolist(),
                                    "empty_streams": int((used == 0).sum()),
                                    "partial_streams": int(((used > 0) & (used < splits)).sum()),
                                    "rel": rel,
                                    "max_abs": mx,
                                    "repeat_equal": repeat,
                                    "pages_equal": pages_equal,
                                    "observed_equal": observed,
                                    "ok": good,
                                }
                            ),
                            flush=True,
                        )
                        ok_all &= good
    return ok_all


if __name__ == "__main__":
    sys.exit(0 if all([run_case(name) for name in sys.argv[1:]]) else 1)
