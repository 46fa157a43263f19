"""Run as a script with ``TRITON_INTERPRET=1`` by ``test_core_host_ops.py``: what a served forward
launches on the kernels path (``benchmarks.host_ops``), per layer and per forward, must not grow with
the requests of the batch, must hold no host sync, and must stay within the counts it has reached.

``variants``: the Triton variants a forward compiles do not depend on its sizes (:func:`check_variants`).

``python tests/host_ops_check.py CASE [CASE ...]``: a line per case, exit code 1 if any fails.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from benchmarks.host_ops import SIZE_VARIANTS, jit_variants, measure  # noqa: E402
from sglang_wgkv.testing.interp import check_seeds  # noqa: E402

# case: (the same forward with few and with more requests, most launches a layer it may make, the host
# syncs a forward it makes); the pool on its Triton extend launches, as served on CUDA: a move and a
# ring write a layer, the context read one launch a layer whatever the batch
CASES = {
    "extend": (("extend_1x40", "extend_4x40"), 15, {}),
    # ExtendPlan.context_gcols: each request's global page columns per layer, read once before the
    # first layer gathers its context (the packed keys' sizes are the host's)
    "chunk_after_prefix": (("chunk_after_prefix_1", "chunk_after_prefix_4"), 16, {"sync:tolist": 1}),
    "mixed": (("mixed_1_prefill_4_decode", "mixed_1_prefill_8_decode"), 20, {}),
    "mixed_after_prefix": (("mixed_1_chunk_4_decode", "mixed_2_chunks_8_decode"), 20, {"sync:tolist": 1}),
    "decode": (("decode_4", "decode_8"), 4, {}),
    # an FP8 pool: scales applied inside the same launches, no read of them to the host
    "mixed_after_prefix_fp8": (
        ("mixed_1_chunk_4_decode_fp8", "mixed_2_chunks_8_decode_fp8"),
        20,
        {"sync:tolist": 1},
    ),
    "decode_fp8": (("decode_4_fp8", "decode_8_fp8"), 4, {}),
}


def check(case: str) -> str:
    (few, more), ceiling, syncs = CASES[case]
    a, b = measure(few), measure(more)
    for part in ("per_layer", "per_forward"):
        if a[part] != b[part]:
            raise SystemExit(f"{part} launches grow with the requests: {few} {a[part]}, {more} {b[part]}")
    forward_syncs = {k: n for k, n in a["per_forward_by_name"].items() if k.startswith("sync:")}
    if a["per_layer"].get("sync") or forward_syncs != syncs:
        raise SystemExit(f"host syncs (expected {syncs} a forward): {a['per_layer_by_name']} {forward_syncs}")
    per_layer = sum(a["per_layer"].values())
    if per_layer > ceiling:
        raise SystemExit(f"{per_layer} launches a layer (at most {ceiling}): {a['per_layer_by_name']}")
    launches = sum(n for k, n in a["per_forward"].items() if k != "sync")
    return f"{per_layer:g} a layer, {launches:g} a forward, {sum(syncs.values())} host syncs a forward"


# one forward of each kind (benchmarks.host_ops.SCENARIOS)
BASE_KINDS = ("extend_1x40", "chunk_after_prefix_1", "mixed_1_prefill_4_decode", "decode_4")


def check_variants() -> str:
    """The Triton variants (``testing/jit_keys.py``) that the forwards of SIZE_VARIANTS need are those
    that one forward of each kind needs: a served batch of another size compiles nothing that the
    first forwards of its kind did not."""
    from sglang_wgkv.testing.jit_keys import differences

    base, other = jit_variants(BASE_KINDS), jit_variants(SIZE_VARIANTS)
    for kernel in sorted(set(base) | set(other)):
        new = set(other.get(kernel, {})) - set(base.get(kernel, {}))
        if new:
            every = set(base.get(kernel, {})) | new
            raise SystemExit(
                f"{kernel}: {len(new)} variant(s) only at other sizes "
                f"({sorted({n for k in new for n in other[kernel][k]})}); they differ in signature "
                f"positions {differences(every)}"
            )
    return f"{sum(len(v) for v in base.values())} variants of {len(base)} kernels"


def run_case(case: str) -> str:
    return check_variants() if case == "variants" else check(case)


if __name__ == "__main__":
    sys.exit(check_seeds(run_case, sys.argv[1:]))
