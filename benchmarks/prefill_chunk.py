"""One served prefill chunk after a long cached context (W0's and W1's last chunks), piece by piece:
WG-KV's vertical-slash prefill with FA3 on its vertical range against FA3 as upstream SGLang calls it
for the same chunk (paged, one token a page, causal) and over contiguous keys. One layer of the
Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16), W_local 256.

    python -m benchmarks.prefill_chunk [--context 118784] [--chunk 8192] [--admit 1.0 0.25] [--reps 5]
                                       [--out benchmarks/results/kernels/prefill_chunk.json]

=====================  =========================================================================
row                    what is timed (ms a layer, the fastest of ``--reps`` after a warm-up)
=====================  =========================================================================
plan                   ``build_vertical_slash_plan_triton``: the work lists, the served plan
compact                ``compact_admitted_triton``: the admitted keys and values in FA3's pages
fa3_vertical           the FA3 call over them (``fa3_vertical``: entries, the query copy, FA3)
fa3_vertical_pN        the same over pages of N rows (``--fa3-pages``; served: 64): FA3 loads a
                       paged KV cache with TMA only where the page is a multiple of its key tile
                       (176 rows at head_dim 128 without a mask, in FA3's heuristic), else row by row
wgkv_fa3               the served extend attention with FA3: the plan (one a layer: each layer admits
                       its own keys), then ``vertical_slash_attention`` with ``fa3`` (compaction,
                       FA3, the band launch)
wgkv_triton            the same with the one-pass Triton kernel (``--wgkv-prefill-vertical triton``)
upstream_paged         ``flash_attn_with_kvcache`` over a page table of one token a page, causal:
                       SGLang's ``fa3`` backend on a chunk after a cached prefix
upstream_contiguous    ``flash_attn_varlen_func`` over contiguous keys, causal (FA3 with TMA loads)
=====================  =========================================================================

The keys are the chunk's context and its own rows in position order, each admitted at random at
``--admit`` (1.0: every token kept, W0; 0.25: W1), as ``DualCachePool.extend_inputs`` hands them to
the attention; what reads them out of the pool is ``benchmarks.extend_step``. Needs a Hopper GPU
with ``sgl_kernel``'s FA3 (the upstream rows and ``wgkv_fa3``); elsewhere ``--fa3-reference`` runs the
WG-KV rows with the torch statement of the FA3 call in FA3's place (under ``TRITON_INTERPRET=1`` on a
CPU with ``--dtype float16``: a check that the pieces run and agree, not a timing).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from pathlib import Path

import torch

from benchmarks.common import cuda_ms, environment, write_json

HQ, HKV, D, W = 32, 8, 128, 256


def chunk_case(context: int, chunk: int, admit: float, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """The chunk's queries and its ``context + chunk`` keys, admitted at random at ``admit``."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = context + chunk
    q, k, v = (
        torch.randn(m, h, D, device=device, generator=g).to(dtype)
        for m, h in ((chunk, HQ), (n, HKV), (n, HKV))
    )
    return {
        "q": q,
        "k": k,
        "v": v,
        "admitted": torch.rand(n, HKV, device=device, generator=g) < admit,
        "qo": torch.tensor([0, chunk], dtype=torch.int32, device=device),
        "kv": torch.tensor([0, n], dtype=torch.int32, device=device),
        "q_pos": torch.arange(context, n, dtype=torch.int32, device=device),
        "k_pos": torch.arange(n, dtype=torch.int32, device=device),
    }


def wgkv_pieces(c: dict, fa3, pages: tuple[int, ...] = ()) -> dict:
    """The served extend attention's pieces as callables (table above); ``pages``: more FA3 page sizes."""
    from sglang_wgkv.attention.fa3_vertical import fa3_vertical
    from sglang_wgkv.attention.triton_prefill import compact_align, default_config, vertical_slash_attention
    from sglang_wgkv.attention.triton_prefill_plan import (
        build_vertical_slash_plan_triton,
        compact_admitted_triton,
    )

    cfg = default_config(D)
    align = compact_align(cfg)
    scale = D**-0.5
    args = (c["admitted"], c["qo"], c["kv"], c["q_pos"], c["k_pos"], W)

    def plan():
        return build_vertical_slash_plan_triton(*args, cfg.block_m, None, align)

    def compact():
        return compact_admitted_triton(c["k"], c["v"], c["admitted"], c["kv"], align=align)

    p = plan()
    kc, vc = compact()
    attn = (c["q"], c["k"], c["v"], *args)
    more = {}
    for page in pages:
        al = math.lcm(align, page)
        p_n = build_vertical_slash_plan_triton(*args, cfg.block_m, None, al)
        kc_n, vc_n = compact_admitted_triton(c["k"], c["v"], c["admitted"], c["kv"], align=al)
        more[f"fa3_vertical_p{page}"] = functools.partial(
            fa3_vertical, c["q"], kc_n, vc_n, p_n, scale, fa3, page
        )
    return {
        "plan": plan,
        "compact": compact,
        "fa3_vertical": lambda: fa3_vertical(c["q"], kc, vc, p, scale, fa3),
        "wgkv_fa3": lambda: vertical_slash_attention(*attn, scale, plan=plan(), config=cfg, fa3=fa3),
        "wgkv_triton": lambda: vertical_slash_attention(
            *attn,
            scale,
            plan=plan(),
            compacted=compact(),
            config=cfg,
        ),
        **more,
    }


def upstream_pieces(c: dict) -> dict:
    """FA3 as upstream runs the chunk: over SGLang's one-token pages, and over contiguous keys."""
    from sgl_kernel.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    q, k, v = c["q"], c["k"], c["v"]
    n, chunk = k.shape[0], q.shape[0]
    pages = torch.arange(n, dtype=torch.int32, device=q.device)[None]
    seqlens = torch.tensor([n], dtype=torch.int32, device=q.device)
    return {
        "upstream_paged": lambda: flash_attn_with_kvcache(
            q,
            k.view(n, 1, HKV, D),
            v.view(n, 1, HKV, D),
            cache_seqlens=seqlens,
            page_table=pages,
            cu_seqlens_q=c["qo"],
            max_seqlen_q=chunk,
            causal=True,
        ),
        "upstream_contiguous": lambda: flash_attn_varlen_func(
            q, k, v, c["qo"], c["kv"], chunk, n, causal=True
        ),
    }


def _out(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def host_ms(fn, reps: int, warmup: int = 1) -> list:
    """``cuda_ms``'s contract on a device without CUDA events (wall clock)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=118784)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--admit", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fa3-reference", action="store_true", help="the torch FA3 statement in FA3's place")
    ap.add_argument("--fa3-pages", type=int, nargs="*", default=[128, 704], help="more FA3 page sizes (rows)")
    # Triton's interpreter multiplies bf16 operands as raw bits: float16 for a CPU check
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "kernels" / "prefill_chunk.json")
    )
    a = ap.parse_args(argv)
    from sglang_wgkv.attention.fa3_vertical import fa3_paged_reference, load_fa3

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fa3 = fa3_paged_reference if a.fa3_reference else load_fa3(device)
    if fa3 is None:
        raise SystemExit("no FA3 here: sgl_kernel's FA3 on a Hopper GPU, or --fa3-reference")
    timer = cuda_ms if device.type == "cuda" else host_ms
    rows = []
    for admit in a.admit:
        c = chunk_case(a.context, a.chunk, admit, device, getattr(torch, a.dtype))
        pieces = wgkv_pieces(c, fa3, tuple(a.fa3_pages))
        if not a.fa3_reference:
            pieces.update(upstream_pieces(c))
        row = {"admit": admit, "ms": {}}
        for name, fn in pieces.items():
            try:
                row["ms"][name] = min(timer(fn, reps=a.reps))
            except Exception as exc:  # one piece failing must not lose the others' numbers
                row.setdefault("errors", {})[name] = repr(exc)[:300]
        with torch.no_grad():  # the outputs agree: the FA3 path with the one-pass kernel, and with
            # every key admitted (vertical-slash = causal attention) with upstream's dense FA3
            out = {
                name: _out(pieces[name]())
                for name in ("wgkv_fa3", "wgkv_triton", "upstream_contiguous")
                if name in pieces
            }
            row["max_abs_diff"] = {"wgkv_fa3_vs_triton": _diff(out["wgkv_fa3"], out["wgkv_triton"])}
            served = pieces["fa3_vertical"]()
            for page in a.fa3_pages:  # the same vertical outputs and log-sum-exps over other pages
                got = pieces[f"fa3_vertical_p{page}"]()
                row["max_abs_diff"][f"fa3_vertical_p{page}"] = max(_diff(x, y) for x, y in zip(got, served))
            if admit >= 1.0 and "upstream_contiguous" in out:
                row["max_abs_diff"]["wgkv_fa3_vs_upstream"] = _diff(
                    out["wgkv_fa3"], out["upstream_contiguous"]
                )
        ms = row["ms"]
        if "upstream_paged" in ms:
            row["wgkv_fa3_vs_upstream_paged"] = ms.get("wgkv_fa3", float("nan")) / ms["upstream_paged"]
        rows.append(row)
        print(row, flush=True)
        del c, pieces
    write_json(
        a.out,
        {
            "environment": environment(),
            "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "local_window": W, "dtype": a.dtype},
            "context": a.context,
            "chunk": a.chunk,
            "device": str(device),
            "fa3": "torch reference" if a.fa3_reference else "sgl_kernel",
            "rows": rows,
        },
        "prefill_chunk",
    )


if __name__ == "__main__":
    main()
