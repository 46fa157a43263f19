"""The prefill half of ``benchmarks.kernel_attention``: the Triton vertical-slash kernel (with its
plan and compaction) at each rejection rate against dense causal FlashInfer FA3/FA2, torch SDPA and
``sgl_kernel``'s FA3 (what upstream SGLang runs on Hopper), after a launch-shape sweep at 64K tokens
(the best shape is saved for ``fig8_end_to_end``); where ``sgl_kernel``'s FA3 loads, also the prefill
with FA3 on its vertical range (``fa3_vertical``, what ``--wgkv-prefill-vertical`` serves) and with
FA3 on the local window (``fa3_band``, what ``--wgkv-prefill-band`` serves).
"""

import json

import torch

from benchmarks.common import cuda_ms, write_json

HQ, HKV, D, W = 32, 8, 128, 256
DT = torch.bfloat16


def visible_pairs(adm: torch.Tensor, n: int) -> int:
    """(query, key) pairs the vertical-slash mask keeps, summed over KV heads (prefill from scratch)."""
    j = torch.arange(n, device=adm.device)
    band = W * n - W * (W - 1) // 2 if n >= W else n * (n + 1) // 2
    vertical = ((n - W - j).clamp(min=0)[:, None] * adm).sum()
    return int(band * adm.shape[1] + vertical.item())


def inputs(n, fused: bool = False, pos_dtype: torch.dtype = torch.int32):
    """q, k, v (``fused``: views of one ``[n, (Hq + 2 Hkv) D]`` row each, as the model's QKV projection
    hands them to the served backend), the sequence's indptr and positions (``pos_dtype``)."""
    if fused:
        qkv = torch.randn(n, (HQ + 2 * HKV) * D, device="cuda", dtype=DT)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], 1)
        q, k, v = q.view(n, HQ, D), k.view(n, HKV, D), v.view(n, HKV, D)
    else:
        q = torch.randn(n, HQ, D, device="cuda", dtype=DT)
        k = torch.randn(n, HKV, D, device="cuda", dtype=DT)
        v = torch.randn(n, HKV, D, device="cuda", dtype=DT)
    ind = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    pos = torch.arange(n, dtype=pos_dtype, device="cuda")
    return q, k, v, ind, pos


def prefill_configs():
    from sglang_wgkv.attention.triton_prefill import PrefillConfig

    return [
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(128, 128, 8, 2),
        PrefillConfig(128, 64, 8, 2),
        PrefillConfig(64, 64, 4, 3),
        PrefillConfig(128, 64, 8, 4),
    ]


def run_prefill(args, deadline, results, path):
    from sglang_wgkv.attention.triton_prefill import (
        PrefillConfig,
        compact_align,
        default_config,
        vertical_slash_attention,
    )
    from sglang_wgkv.attention.vertical_slash_plan import build_vertical_slash_plan, compact_admitted

    if args.no_sweep:
        return _prefill_lengths(args, deadline, results, path, default_config(D))
    # Launch-shape sweep at 64K, 75% rejection; the best one is used below and saved for fig8.
    q, k, v, ind, pos = inputs(65536)
    adm = torch.rand(65536, HKV, device="cuda") < 0.25
    sweep = []
    for cfg in prefill_configs():
        try:
            plan = build_vertical_slash_plan(adm, ind, ind, pos, pos, W, cfg.block_m, compact_align(cfg))
            comp = compact_admitted(k, v, adm, ind, align=compact_align(cfg))
            ms = cuda_ms(
                lambda: vertical_slash_attention(
                    q, k, v, adm, ind, ind, pos, pos, W, plan=plan, compacted=comp, config=cfg
                ),
                reps=5,
                warmup=2,
            )
            sweep.append({"config": cfg.__dict__, "ms": sorted(ms)[len(ms) // 2]})
        except Exception as exc:
            sweep.append({"config": cfg.__dict__, "error": repr(exc)[:300]})
    ok = [s for s in sweep if "ms" in s]
    best = min(ok, key=lambda s: s["ms"])["config"]
    results["prefill_config_sweep_64k_75pct"] = sweep
    results["prefill_config"] = best
    with open("/tmp/wgkv_prefill_config.json", "w") as f:
        json.dump(best, f)
    del q, k, v
    _prefill_lengths(args, deadline, results, path, PrefillConfig(**best))


def _prefill_lengths(args, deadline, results, path, cfg):
    import flashinfer

    from sglang_wgkv.attention.fa3_vertical import load_fa3
    from sglang_wgkv.attention.triton_prefill import (
        build_vertical_slash_plan_triton,
        compact_admitted_triton,
        compact_align,
        vertical_slash_attention,
    )
    from sglang_wgkv.attention.vertical_slash_plan import (
        _exclusive_count,
        build_vertical_slash_plan,
        compact_admitted,
    )

    results["prefill_config"] = cfg.__dict__
    align = compact_align(cfg)  # the compacted regions' alignment the kernel reads whole tiles of
    fa3 = load_fa3(torch.device("cuda"))

    def sgl_fa3(q, k, v, ind, n):
        from sgl_kernel.flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, ind, ind, n, n, causal=True)

    def sdpa(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )

    rows = results.setdefault("prefill", [])
    for n in args.lengths:
        q, k, v, ind, pos = inputs(n, args.fused_qkv, torch.int64 if args.positions_int64 else torch.int32)
        dense_flops = 4 * D * HQ * n * (n + 1) / 2
        reps = 3 if n <= 131072 else 1
        # Expected dense time at ~500 TFLOP/s decides whether this length still fits.
        if deadline.left() < 14 * dense_flops / 5e14 + 10:
            rows.append({"n": n, "skipped": "deadline"})
            write_json(path, results, "kernel_attention")
            continue
        entry = {"n": n, "dense_tflop": dense_flops / 1e12}
        dense = [
            (
                "flashinfer_fa3",
                lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3"),
            ),
            ("torch_sdpa_flash", lambda: sdpa(q, k, v)),
        ]
        if fa3 is not None:
            dense.append(("sgl_kernel_fa3", lambda: sgl_fa3(q, k, v, ind, n)))
        dense = [(name, fn) for name, fn in dense if name in args.baselines]
        # FA2 (a further JIT build) only when the run has time to spare.
        if "flashinfer_fa2" in args.baselines and deadline.left() > 200 + 30 * dense_flops / 5e14:
            dense.append(
                (
                    "flashinfer_fa2",
                    lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2"),
                )
            )
        for name, fn in dense:
            try:
                ms = cuda_ms(fn, reps=reps, warmup=1 if n <= 131072 else 0)
                entry[name] = {"ms": min(ms), "tflops": dense_flops / min(ms) / 1e9}
            except Exception as exc:
                entry[name] = {"error": repr(exc)[:300]}
            torch.cuda.empty_cache()
        for rej in args.rejections:
            adm = torch.rand(n, HKV, device="cuda") >= rej
            pairs = visible_pairs(adm, n)
            flops = 4 * D * (HQ // HKV) * pairs
            # What the served prefill runs (the one-launch Triton plan, the Triton copy of admitted rows),
            # and, same run, the torch plan, the torch scatter and the 2-D row scan used before.
            # Files without "served_plan" predate the switch: their plan_ms is the torch plan.
            plan_ms = cuda_ms(
                lambda: build_vertical_slash_plan_triton(
                    adm, ind, ind, pos, pos, W, cfg.block_m, None, align
                ),
                reps=3,
            )
            plan_torch_ms = cuda_ms(
                lambda: build_vertical_slash_plan(adm, ind, ind, pos, pos, W, cfg.block_m, align), reps=3
            )
            comp_ms = cuda_ms(lambda: compact_admitted_triton(k, v, adm, ind, align=align), reps=3)
            comp_torch_ms = cuda_ms(lambda: compact_admitted(k, v, adm, ind, align=align), reps=3)
            scan_1d_ms = cuda_ms(lambda: _exclusive_count(adm), reps=3)
            scan_2d_ms = cuda_ms(lambda: torch.cumsum(adm.t().contiguous(), 1, dtype=torch.int32), reps=3)
            plan = build_vertical_slash_plan_triton(adm, ind, ind, pos, pos, W, cfg.block_m, None, align)
            comp = compact_admitted_triton(k, v, adm, ind, align=align)
            kern = cuda_ms(
                lambda: vertical_slash_attention(
                    q, k, v, adm, ind, ind, pos, pos, W, plan=plan, compacted=comp, config=cfg
                ),
                reps=reps,
                warmup=1 if n <= 131072 else 0,
            )
            total = min(kern) + min(plan_ms) + min(comp_ms)
            wg = {
                "rejection": rej,
                "kernel_ms": min(kern),
                "plan_ms": min(plan_ms),
                "compact_ms": min(comp_ms),
                "served_plan": "triton",
                "plan_torch_ms": min(plan_torch_ms),
                "compact_torch_ms": min(comp_torch_ms),
                "scan_1d_ms": min(scan_1d_ms),
                "scan_2d_ms": min(scan_2d_ms),
                "total_ms": total,
                "visible_pairs": pairs,
                "tflops_useful": flops / min(kern) / 1e9,
            }
            if fa3 is not None:
                # everything after the plan: paged compaction, FA3 entries, FA3, the band launch
                fa3_ms = cuda_ms(
                    lambda: vertical_slash_attention(
                        q, k, v, adm, ind, ind, pos, pos, W, plan=plan, config=cfg, fa3=fa3
                    ),
                    reps=reps,
                    warmup=1 if n <= 131072 else 0,
                )
                wg["fa3_vertical_ms"] = min(fa3_ms)
                wg["fa3_vertical_total_ms"] = min(fa3_ms) + min(plan_ms)
                # FA3's sliding window, then the launch over the compacted keys and the narrow band
                # (what --wgkv-prefill-band fa3 serves for prompts)
                from sgl_kernel.flash_attn import flash_attn_varlen_func

                band = (flash_attn_varlen_func, ind, ind, n, n)
                band_ms = cuda_ms(
                    lambda: vertical_slash_attention(
                        q, k, v, adm, ind, ind, pos, pos, W, plan=plan, compacted=comp, config=cfg, band=band
                    ),
                    reps=reps,
                    warmup=1 if n <= 131072 else 0,
                )
                wg["fa3_band_ms"] = min(band_ms)
                wg["fa3_band_total_ms"] = min(band_ms) + min(plan_ms) + min(comp_ms)
            for base in ("flashinfer_fa3", "flashinfer_fa2", "torch_sdpa_flash", "sgl_kernel_fa3"):
                if "ms" in entry.get(base, {}):
                    wg[f"speedup_vs_{base}"] = entry[base]["ms"] / total
                    if "fa3_vertical_total_ms" in wg:
                        wg[f"fa3_vertical_speedup_vs_{base}"] = (
                            entry[base]["ms"] / wg["fa3_vertical_total_ms"]
                        )
            entry.setdefault("wgkv_triton", []).append(wg)
            del plan, comp
        rows.append(entry)
        write_json(path, results, "kernel_attention")
        print(json.dumps({k: entry[k] for k in entry if k != "wgkv_triton"}), flush=True)
        for wg in entry.get("wgkv_triton", []):
            print("   ", json.dumps(wg), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
