"""The host's time in the backend's part of a served forward, on CPU: the forwards of
``benchmarks/host_ops.py`` with every Triton launch returning at once, so what is timed is the Python
and the torch dispatch around the kernels (the tensors are tiny: a torch op costs its dispatch). A
forward whose GPU work takes less than this plus the model's own Python waits for the host; the op
census (``host_ops``) says how many launches, this says how long the rest takes.

    python -m benchmarks.host_time --out benchmarks/results/kernels/host_time_cpu.json

Per scenario: the forward's plan (``init_forward_metadata``) and one layer (``forward_extend`` or
``forward_decode``), and inside a layer the backend's named spans (``wgkv.extend_gate`` ...), each the
median over layers and repeats of a fresh pool (a forward moves the pool on).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from unittest import mock

# host_ops' scenarios and more rows: the host's time must not grow with them
SCENARIOS = {
    "extend_1x40": ("extend", [40], [0], 0),
    "extend_8x40": ("extend", [40] * 8, [0] * 8, 0),
    "chunk_after_prefix_4": ("extend", [24] * 4, [72] * 4, 0),
    "mixed_1_chunk_4_decode": ("mixed", [24], [72], 4),
    "mixed_1_chunk_11_decode": ("mixed", [24], [72], 11),
    "mixed_1_chunk_11_decode_fp8": ("mixed", [24], [72], 11, 40, "float8_e4m3fn"),
    "decode_4": ("decode", [], [], 4),
    "decode_11": ("decode", [], [], 11),
}
LAYERS = 4


def _stubbed_launches():
    """Every Triton launch returns at once (its host cost is Triton's, not ours: counted by host_ops)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    stack = contextlib.ExitStack()
    for cls in (InterpretedFunction, JITFunction):
        stack.enter_context(mock.patch.object(cls, "run", lambda self, *a, **k: None))
    return stack


@contextlib.contextmanager
def _clock(times: dict, name: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        times[name].append(time.perf_counter() - t)


def _timed(times: dict, name: str, fn):
    def wrapped(*args, **kwargs):
        with _clock(times, name):
            return fn(*args, **kwargs)

    return wrapped


def _spans(times: dict):
    """The backend's ``traced`` spans, timed (they are no-ops outside a profiler)."""
    from sglang_wgkv.integration.backend import attn_backend, extend_layer

    stack = contextlib.ExitStack()
    for module in (attn_backend, extend_layer):
        stack.enter_context(mock.patch.object(module, "traced", lambda name: _clock(times, name)))
    return stack


def measure(scenario: str, repeats: int) -> dict:
    from benchmarks import host_ops
    from sglang_wgkv.integration.backend.attn_backend import WGKVAttnBackend

    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        forward = host_ops._setup(LAYERS, scenario, SCENARIOS[scenario])
        with contextlib.ExitStack() as stack:
            stack.enter_context(_stubbed_launches())
            stack.enter_context(_spans(times))
            for name in ("init_forward_metadata", "forward_extend", "forward_decode"):
                original = getattr(WGKVAttnBackend, name)
                stack.enter_context(mock.patch.object(WGKVAttnBackend, name, _timed(times, name, original)))
            forward()
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in sorted(times.items())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    from benchmarks.host_ops import interpreted

    interpreted("benchmarks.host_time")
    import torch

    torch.set_num_threads(1)
    results = {
        "command": " ".join(["python -m benchmarks.host_time", *sys.argv[1:]]),
        "unit": "us, median over layers and repeats",
        "layers": LAYERS,
        "scenarios": {},
    }
    for name in args.scenarios.split(","):
        results["scenarios"][name] = got = measure(name, args.repeats)
        print(name, json.dumps(got), flush=True)
    if args.out:
        from benchmarks.common import write_json

        write_json(args.out, results, "host_time")


if __name__ == "__main__":
    main()
