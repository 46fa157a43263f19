"""What a served forward launches on the kernels path, counted on CPU (``sglang_wgkv.testing.op_count``):
per layer and per forward, for extends of several sizes, a chunk after a cached prefix, a mixed
forward and an eager decode step, on a pool with the Triton extend launches (``triton_extend``, as
served on CUDA). A host-bound forward's time is about its launches times a launch's
host cost, so these counts are what the host does; that they do not grow with the batch is checked
by ``tests/test_core_host_ops.py``.

    python -m benchmarks.host_ops --out benchmarks/results/kernels/host_ops_cpu.json

Runs the Triton kernels under the interpreter (it re-executes itself with ``TRITON_INTERPRET=1``).
Per layer = (count with 4 layers - count with 2) / 2; per forward = the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SCENARIOS = {
    # name: (kind, prefill lengths, cached prefix of each, decode rows)
    "extend_1x40": ("extend", [40], [0], 0),
    "extend_4x40": ("extend", [40] * 4, [0] * 4, 0),
    "chunk_after_prefix_1": ("extend", [24], [72], 0),
    "chunk_after_prefix_4": ("extend", [24] * 4, [72] * 4, 0),
    "mixed_1_prefill_4_decode": ("mixed", [40], [0], 4),
    "mixed_1_prefill_8_decode": ("mixed", [40], [0], 8),
    # a burst's forward: a prompt's next chunk beside the decode rows
    "mixed_1_chunk_4_decode": ("mixed", [24], [72], 4),
    "mixed_2_chunks_8_decode": ("mixed", [24, 24], [72, 72], 8),
    # the same forwards on an FP8 pool (--kv-cache-dtype fp8_e4m3)
    "mixed_1_chunk_4_decode_fp8": ("mixed", [24], [72], 4, 40, "float8_e4m3fn"),
    "mixed_2_chunks_8_decode_fp8": ("mixed", [24, 24], [72, 72], 8, 40, "float8_e4m3fn"),
    "decode_4_fp8": ("decode", [], [], 4, 40, "float8_e4m3fn"),
    "decode_8_fp8": ("decode", [], [], 8, 40, "float8_e4m3fn"),
    "decode_4": ("decode", [], [], 4),
    "decode_8": ("decode", [], [], 8),
}
# The forwards of SCENARIOS' kinds again at other sizes (odd lengths, one and eleven decode rows): the
# Triton variants a forward compiles must depend on its kind only (jit_variants).
SIZE_VARIANTS = {
    "extend_3_odd": ("extend", [37, 50, 41], [0] * 3, 0),
    "chunk_after_prefix_3_odd": ("extend", [24, 33, 17], [72, 40, 90], 0),
    "mixed_2_prefill_5_decode": ("mixed", [33, 41], [0, 0], 5),
    "mixed_1_prefill_11_decode": ("mixed", [40], [0], 11),
    "decode_1": ("decode", [], [], 1),
    "decode_11": ("decode", [], [], 11),
    # decode rows 300 tokens in: two splits a stream where 40 tokens take one
    "mixed_1_prefill_3_decode_long": ("mixed", [40], [0], 3, 300),
    "decode_3_long": ("decode", [], [], 3, 300),
}
H, HQ, D, W = 2, 4, 64, 32


def _setup(num_layers: int, scenario: str, spec: tuple | None = None):
    """A kernels-path backend over a fresh pool, with the scenario's cached state in place, and the
    counted forward as a function (its inputs already built)."""
    import torch

    from sglang_wgkv.attention import reference
    from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
    from sglang_wgkv.config import WGKVConfig
    from sglang_wgkv.gate import GateConfig, WriteGates
    from sglang_wgkv.memory import DualCachePool
    from sglang_wgkv.testing.backend_harness import (
        bare_backend,
        batch_tensors,
        decode_batch,
        extend_batch,
        layer_of,
    )

    kind, lens, prefix, decode_rows, *rest = spec or {**SCENARIOS, **SIZE_VARIANTS}[scenario]
    decode_len = rest[0] if rest else 40  # tokens each decoding request holds before the forward
    dt = torch.float16
    kv_dtype = getattr(torch, rest[1]) if len(rest) > 1 else dt
    pool = DualCachePool(
        num_layers,
        H,
        D,
        num_pages=600,
        max_requests=32,
        max_context_len=512,
        config=WGKVConfig(local_window=W, tau=0.1),
        triton_decode=True,
        triton_extend=True,
        dtype=kv_dtype,
        compute_dtype=dt,
    )
    gates = WriteGates(GateConfig(num_layers=num_layers, num_kv_heads=H, head_dim=D, hidden=2 * D)).eval()
    gates.requires_grad_(False)
    backend = bare_backend(
        pool,
        gates,
        use_kernels=True,
        slot_tau=torch.full((32,), 0.1),
        num_q_heads=HQ,
        tensor_core_gate=True,
        prefill=vertical_slash_attention,
        deferred_gate_check=True,
    )
    layers = [layer_of(i, HQ, H, D) for i in range(num_layers)]
    gen = torch.Generator().manual_seed(0)

    def rows(n):
        return [torch.randn(n, c * D, generator=gen).to(dt) for c in (HQ, H, H)]

    def extend(kind, slots, pre, ext):
        """The forward's inputs built, then a function running it (what is counted)."""
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(pre, ext)])
        fb = extend_batch(kind, slots, pre, ext, positions)
        q, k, v = rows(positions.numel())

        def run():
            backend.batch_slots = list(slots)
            backend.init_forward_metadata(fb)
            for layer in layers:
                backend.forward_extend(q, k, v, layer, fb)

        return placed(run, fb)

    def placed(forward, fb):
        """``forward`` with the tensors that live on the device and on the host when served."""
        on_device, on_host = batch_tensors(fb)
        forward.device_tensors = on_device + [t for t in vars(pool).values() if isinstance(t, torch.Tensor)]
        forward.host_tensors = on_host
        return forward

    # the cached state, prefilled on the torch path (not counted; the interpreter is slow)
    served = backend._prefill, backend.prefill_gate
    backend._prefill, backend.prefill_gate = reference.vertical_slash_attention, None
    decoding = list(range(20, 20 + decode_rows))  # requests already decoding, decode_len tokens in
    for r in decoding:
        pool.alloc_request(r)
    if decoding:
        extend("extend", decoding, [0] * len(decoding), [decode_len] * len(decoding))()
    slots = list(range(1, 1 + len(lens)))
    for r in slots:
        pool.alloc_request(r)
    if any(prefix):
        extend("extend", slots, [0] * len(slots), prefix)()
    backend._prefill, backend.prefill_gate = served

    if kind == "decode":
        fb = decode_batch(decoding, [decode_len + 1] * len(decoding))
        q, k, v = rows(len(decoding))

        def forward():
            backend.init_forward_metadata(fb)
            for layer in layers:
                backend.forward_decode(q, k, v, layer, fb)

        return placed(forward, fb)
    if kind == "mixed":
        backend.batch_decode_rows = len(decoding)
        return extend(
            "mixed", slots + decoding, prefix + [decode_len] * len(decoding), lens + [1] * len(decoding)
        )
    return extend("extend", slots, prefix, lens)


def count(num_layers: int, scenario: str):
    from sglang_wgkv.testing.op_count import counting_ops

    forward = _setup(num_layers, scenario)
    with counting_ops(forward.device_tensors, forward.host_tensors) as counts:
        forward()
    return counts


def jit_variants(scenarios) -> dict[str, dict[tuple, list[str]]]:
    """``{kernel: {variant key: [scenarios that launch it]}}`` of two-layer forwards: the variant each
    Triton launch would compile on an sm_90 GPU (``sglang_wgkv.testing.jit_keys``)."""
    from sglang_wgkv.testing.jit_keys import recording_jit_keys

    out: dict[str, dict[tuple, list[str]]] = {}
    for name in scenarios:
        forward = _setup(2, name)
        with recording_jit_keys() as keys:
            forward()
        for kernel, got in keys.items():
            for key in got:
                out.setdefault(kernel, {}).setdefault(key, []).append(name)
    return out


def _split(with_two: dict, with_four: dict) -> tuple[dict, dict]:
    """``(per layer, per forward)`` of counts made with 2 and with 4 layers, key by key."""
    keys = sorted(set(with_two) | set(with_four))
    layer = {k: (with_four.get(k, 0) - with_two.get(k, 0)) / 2 for k in keys}
    return layer, {k: with_two.get(k, 0) - 2 * layer[k] for k in keys}


def measure(scenario: str) -> dict:
    """Per-layer and per-forward counts by kind, and the per-layer ops by name."""
    from sglang_wgkv.testing.op_count import totals

    two, four = count(2, scenario), count(4, scenario)
    per_layer, per_forward = _split(totals(two), totals(four))

    def by_name(counts: dict) -> dict:
        named = {f"{kind}:{name}": n for (kind, name), n in counts.items() if n}
        return dict(sorted(named.items(), key=lambda kv: -kv[1]))

    layer_ops, forward_ops = _split(two, four)
    return {
        "per_layer": per_layer,
        "per_forward": per_forward,
        "per_layer_by_name": by_name(layer_ops),
        "per_forward_by_name": by_name(forward_ops),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args(argv)
    interpreted("benchmarks.host_ops")
    results = {
        "command": " ".join(["python -m benchmarks.host_ops", *sys.argv[1:]]),
        "shape": [H, HQ, D, W],
    }
    results["scenarios"] = {}
    for name in args.scenarios.split(","):
        results["scenarios"][name] = got = measure(name)
        print(
            name, json.dumps({"per_layer": got["per_layer"], "per_forward": got["per_forward"]}), flush=True
        )
    if args.out:
        from benchmarks.common import write_json

        write_json(args.out, results, "host_ops")


def interpreted(module: str) -> None:
    """Run ``python -m module`` again, this process replaced, with the Triton interpreter on and no
    GPU unless it already is (``TRITON_INTERPRET`` must be set before Triton is imported)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
