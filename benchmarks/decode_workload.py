"""The decode benchmarks' workload and timing (``benchmarks.kernel_decode``, ``benchmarks.decode_fixed_cost``).

One Llama-3.1-8B layer shape (Hq=32, Hkv=8, D=128, bf16, W_local=256): every (request, layer, KV head)
stream holds the full ring plus ``Binomial(n - 256, 1 - rejection)`` global tokens, on pages drawn in
random order from one big pool (:class:`FoldedPool`, as in a used
:class:`~sglang_wgkv.memory.DualCachePool`); :func:`graph_ms` times a function under CUDA-graph replay
and :func:`triton_fn` is the Triton folded decode of every layer.
"""

import math

import torch

from benchmarks.common import capture_graph, cuda_ms

HQ, HKV, D, W, PAGE = 32, 8, 128, 256, 16
DT = torch.bfloat16
TOKEN_BYTES = D * 2 * 2  # K + V of one token of one KV head, bf16
WORKING_SET = 256 << 20  # bytes each timed graph reads at least (L2 is 50 MB)


def layers_for(bytes_per_layer: int, cap: int) -> int:
    return max(1, min(cap, math.ceil(WORKING_SET / max(bytes_per_layer, 1))))


def global_lengths(batch: int, layers: int, n: int, rejection: float, gen) -> torch.Tensor:
    """``[batch, layers, HKV]`` global tokens: each token past the ring admitted w.p. 1 - rejection."""
    total = torch.full((batch, layers, HKV), float(max(n - W, 0)))
    return torch.binomial(total, torch.full_like(total, 1.0 - rejection), generator=gen).to(torch.int32)


class FoldedPool:
    """Pool tensors as :class:`DualCachePool` lays them out, pages shuffled; ring full (n >= W)."""

    def __init__(self, glen: torch.Tensor, gen, device="cuda"):
        B, L, H = glen.shape
        npages = W // PAGE + (glen.long() + PAGE - 1) // PAGE  # [B, L, H]
        total = int(npages.sum())
        cols = int(npages.max())
        self.k_pages = torch.randn(total + 1, PAGE, D, device=device, dtype=DT)
        self.v_pages = torch.randn_like(self.k_pages)
        perm = torch.randperm(total, generator=gen).to(torch.int32)
        valid = torch.arange(cols)[None, None, None, :] < npages[..., None]
        table = torch.full((B, L, H, cols), total, dtype=torch.int32)
        table[valid] = perm
        self.page_table = table.to(device)
        self.global_len = glen.to(device)
        self.npages, self.glen = npages, glen
        self.req = torch.arange(B, device=device)
        self.ring = torch.full((B,), W, dtype=torch.int64, device=device)
        self.kv_bytes_per_layer = int((glen.long() + W).sum()) * TOKEN_BYTES / L

    def flashinfer_plans(self, workspace):
        """One :class:`FoldedPagedDecode` per layer, planned (host page counts) outside the graph."""
        from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode
        from sglang_wgkv.attention.folded_index import build_folded_indices

        B, L, H, _ = self.page_table.shape
        decs = []
        for layer in range(L):
            n = self.npages[:, layer].cuda()
            last = torch.where(self.glen[:, layer] > 0, (self.glen[:, layer] - 1) % PAGE + 1, PAGE).cuda()
            indptr, indices, last = build_folded_indices(self.page_table[:, layer], n, last.to(torch.int32))
            dec = FoldedPagedDecode(HQ, HKV, D, B, int(indptr[-1]), "cuda", DT, float_workspace=workspace)
            dec.plan(indptr.cpu(), indices, last)
            decs.append(dec)
        return decs


def graph_ms(fn, inner: int = 20, reps: int = 7) -> float:
    """Median ms of one ``fn()`` under CUDA-graph replay (``inner`` replays per event pair)."""
    graph = capture_graph(fn)

    def replays():
        for _ in range(inner):
            graph.replay()

    ms = sorted(cuda_ms(replays, reps=reps, warmup=2))
    return ms[len(ms) // 2] / inner


def fp8_pages(pool, dtype=torch.float8_e4m3fn) -> dict:
    """``triton_fn``'s arguments for ``pool``'s pages stored in FP8 (as ``--kv-cache-dtype fp8_e4m3``
    serves them: the values in stored units, per-tensor scales of 1 on the device), and the bytes a
    layer's streams then hold."""
    one = torch.ones(1, dtype=torch.float32, device=pool.k_pages.device)
    return {
        "pages": (pool.k_pages.to(dtype), pool.v_pages.to(dtype)),
        "k_scale": one,
        "v_scale": one,
        "kv_bytes_per_layer": pool.kv_bytes_per_layer * dtype.itemsize / DT.itemsize,
    }


def triton_fn(pool, q, out, splits, cfg, pages=None, **extra):
    """The Triton folded decode of every layer (``pages``: ``(k_pages, v_pages)`` in place of the pool's,
    e.g. :func:`fp8_pages`' with its ``k_scale`` / ``v_scale`` in ``extra``; ``extra``:
    ``folded_decode``'s keyword arguments, e.g. the fused ring write's ``new_k``, ``new_v``, ``pos``,
    ``window``)."""
    from sglang_wgkv.attention.decode_config import FoldedDecodeWorkspace
    from sglang_wgkv.attention.triton_decode import folded_decode

    B, L = q.shape[0], pool.page_table.shape[1]
    ws = FoldedDecodeWorkspace(B, HQ, D, splits, q.device, num_kv_heads=HKV)
    k_pages, v_pages = pages or (pool.k_pages, pool.v_pages)

    def run():
        for layer in range(L):
            folded_decode(
                q,
                k_pages,
                v_pages,
                pool.page_table,
                pool.global_len,
                pool.req,
                pool.ring,
                layer,
                num_splits=splits,
                workspace=ws,
                out=out,
                config=cfg,
                **extra,
            )

    return run
