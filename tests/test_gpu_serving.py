"""WG-KV serving on the GPU: the kernels path with decode CUDA graphs against the torch reference path.

Two servers on the embedded SmolLM2 (its real weights; skipped when its GGUF is not installed),
same gates: per-KV-head fixed biases (head 0 admits nothing at the default tau, heads 1 and 2
everything) and W_local = 64, so decode steps promote ring victims and drop head 0's:

* ``kernels`` (bfloat16): Triton prefill, ``folded_decode`` decode (ring write fused) under SGLang's
  decode CUDA graphs (small capture set, padded batches);
* ``reference`` (bfloat16): the torch reference attention, no CUDA graphs;

and the float32 truth offline (``sglang_wgkv.testing.serving.OfflineTruth``: the model's HF copy under the same
gates, each path's own greedy tokens teacher-forced; the float32 reference server equals it to ~1e-5
on CPU, and SGLang's CUDA RMSNorm has no float32 kernel, so no float32 server runs here).

Checks: greedy continuations agree with the bf16 reference (up to a divergence at a near-tie of its
top-2 logprobs, which bfloat16 noise may flip), and the kernels path's logprobs lie no farther from
float32's than the bf16 reference's do (times FLOOR_FACTOR, plus FLOOR_SLACK), one by one and as one
concurrent batch of different lengths (prompts shorter and longer than W_local, one crossing it while
decoding). Two bf16 paths are not compared with each other at a fixed tolerance: each lies up to
~0.1-0.14 from float32 on these prompts (CPU, benchmarks/logprob_floor.py), so two correct ones can
lie farther apart than either from float32 with every token equal. The kernels server logs decode batches run
on CUDA graphs; per-request tau holds under graphs; after aborted streams the idle check (no slot or
page leaked, integrity) passes; with SGLang's overlap scheduler and the radix cache (both on by
default), shared-prefix traffic restored into just-freed slots gives each request's cold tokens.
"""

import threading
import time

import pytest
import requests
import torch

from sglang_wgkv.testing.gpu_serving_cases import (
    HEAD_BIAS,
    NEW_TOKENS,
    PROMPTS,
    SERVER_ARGS,
    W_LOCAL,
    agree,
    common_args,
    path_errors,
    within_floor,
)
from sglang_wgkv.testing.serving import (
    OfflineTruth,
    Server,
    embedded_model_dir,
    flush_cache,
    long_prompt,
    save_head_gates,
    stream_generate,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.serving,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU host)"),
]


@pytest.fixture(scope="module")
def gates_dir(tmp_path_factory):
    return save_head_gates(tmp_path_factory.mktemp("gpu_serving") / "gates", HEAD_BIAS, W_LOCAL)


@pytest.fixture(scope="module")
def servers(gates_dir):
    common = common_args(embedded_model_dir(), gates_dir)
    started = {
        name: Server([*common, *args], gates_dir.parent / f"{name}.log") for name, args in SERVER_ARGS.items()
    }
    try:
        yield tuple(started[name].wait_healthy() for name in ("kernels", "reference"))
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def truth(gates_dir):
    return OfflineTruth(embedded_model_dir(), gates_dir, W_LOCAL, device="cuda")


def _run(server, prompts):
    outs = server.generate(
        prompts,
        max_new_tokens=NEW_TOKENS,
        return_logprob=True,
        top_logprobs_num=2,
        sampling_params={"ignore_eos": True},
    )
    return [
        (
            o["output_ids"],
            [lp[0] for lp in o["meta_info"]["output_token_logprobs"]],
            [[lp[0] for lp in top] for top in o["meta_info"]["output_top_logprobs"]],
        )
        for o in outs
    ]


def _check_floor(got, ref, truth, prompt):
    e_k, e_r = (
        path_errors(got, truth.logprobs(prompt, got[0])),
        path_errors(ref, truth.logprobs(prompt, ref[0])),
    )
    # on failure: both errors token by token
    assert within_floor(e_k, e_r), (
        f"{prompt[:50]!r}: kernels vs float32 up to {max(e_k):.3f}, bf16 reference vs float32 up to "
        f"{max(e_r):.3f} (each along its own {len(e_k)} tokens); per token kernels: "
        f"{' '.join(f'{e:.2f}' for e in e_k)}; reference: {' '.join(f'{e:.2f}' for e in e_r)}"
    )


def _kernels_server_with(gates_dir, option: str, log: str, *extra: str):
    """The kernels server with ``option fa3`` (and ``extra``) where sgl_kernel's FA3 loads (skips
    elsewhere)."""
    from sglang_wgkv.attention.fa3_vertical import load_fa3

    if load_fa3(torch.device("cuda")) is None:
        pytest.skip("FA3 (sgl_kernel.flash_attn on a Hopper GPU) is not installed here")
    args = [*common_args(embedded_model_dir(), gates_dir), *SERVER_ARGS["kernels"], option, "fa3", *extra]
    srv = Server(args, gates_dir.parent / log)
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def fa3_server(gates_dir):
    """The kernels server with FA3 on every prefill's vertical range."""
    yield from _kernels_server_with(gates_dir, "--wgkv-prefill-vertical", "kernels_fa3.log")


def test_fa3_vertical_prefill_served_matches_reference(fa3_server, servers, truth):
    """``--wgkv-prefill-vertical fa3``: the same tokens as the bf16 reference up to near-ties, logprobs
    as close to float32's as the reference's, batched (several sequences in one extend)."""
    from sglang_wgkv.integration.backend.prefill_vertical import LOG_FA3

    got, want = _run(fa3_server, PROMPTS), _run(servers[1], PROMPTS)
    for p, g, w in zip(PROMPTS, got, want):
        agree(g, w, p)
        _check_floor(g, w, truth, p)
    assert LOG_FA3 in fa3_server.log_path.read_text()


@pytest.fixture(scope="module")
def band_server(gates_dir):
    """The kernels server with FA3 on the local window of prefills, in chunks of 128 tokens (the longer
    prompts' later chunks read global entries and a full ring)."""
    yield from _kernels_server_with(
        gates_dir, "--wgkv-prefill-band", "kernels_band.log", "--chunked-prefill-size", "128"
    )


def test_fa3_band_prefill_served_matches_reference(band_server, servers, truth):
    """``--wgkv-prefill-band fa3``: the same tokens as the bf16 reference up to near-ties, logprobs as
    close to float32's as the reference's, batched (several prompts in one extend, chunks after cached
    prefixes)."""
    from sglang_wgkv.integration.backend.prefill_band import LOG_BAND

    got, want = _run(band_server, PROMPTS), _run(servers[1], PROMPTS)
    for p, g, w in zip(PROMPTS, got, want):
        agree(g, w, p)
        _check_floor(g, w, truth, p)
    assert LOG_BAND in band_server.log_path.read_text()


@pytest.mark.parametrize("batched", [False, True], ids=["one_by_one", "batched"])
def test_kernels_with_cuda_graphs_match_reference(servers, truth, batched):
    kernels, reference = servers
    if batched:
        got, want = _run(kernels, PROMPTS), _run(reference, PROMPTS)
    else:
        got = [_run(kernels, [p])[0] for p in PROMPTS]
        want = [_run(reference, [p])[0] for p in PROMPTS]
    # Each prompt: identical tokens up to its first divergence, which must be a near-tie of the
    # reference (bf16 rounding differs between the paths; no length bar: a long prompt may legitimately
    # split within its first tokens on a near-tie), and logprobs as close to float32's as
    # the bf16 reference's are.
    for p, g, w in zip(PROMPTS, got, want):
        agree(g, w, p)
        _check_floor(g, w, truth, p)
    assert "cuda graph: True" in kernels.log_path.read_text(), "no decode batch ran on a CUDA graph"
    stats = kernels.wait_idle_checked()
    assert stats["tokens_left_ring"] > 0


def test_per_request_tau_under_cuda_graphs(servers):
    """One batch, three thresholds: head 0 admits nothing at tau 0.1, everything at tau 0 or with
    admission off. Decoding 96 tokens past W_local = 64 puts graph-decoded tokens through the ring."""
    kernels = servers[0]
    params = [
        {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True, **extra}
        for extra in (
            {},
            {"custom_params": {"wgkv": {"tau": 0.0}}},
            {"custom_params": {"wgkv": {"admission": False}}},
        )
    ]
    r = requests.post(
        kernels.url + "/generate", json={"text": ["Hi"] * 3, "sampling_params": params}, timeout=600
    )
    r.raise_for_status()
    default, tau0, off = (o["meta_info"]["wgkv"][-1] for o in r.json())
    assert default["admitted_fraction"] == pytest.approx(2 / 3, abs=1e-6)
    assert tau0["admitted_fraction"] == pytest.approx(1.0) and off["admitted_fraction"] == pytest.approx(1.0)
    kernels.wait_idle_checked()


def test_aborts_under_cuda_graphs_leave_pool_intact(servers):
    kernels = servers[0]
    rids = [f"gpu-abort-{i}" for i in range(6)]
    results = {}
    threads = [
        threading.Thread(
            target=stream_generate,
            args=(kernels, rid, long_prompt(3 + 5 * i, seed=i), 64, 4 if i % 2 == 0 else None, results, 600),
        )
        for i, rid in enumerate(rids)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for i, rid in enumerate(rids):
        reason = results[rid]["finish_reason"]["type"]
        assert reason == ("abort" if i % 2 == 0 else "length"), results[rid]
    stats = kernels.wait_idle_checked()
    assert stats["free_pages"] + stats["radix"]["snapshot_pages"] == stats["total_pages"]
    assert kernels.alive()


def test_prefix_hits_under_overlap_and_cuda_graphs(servers):
    """SGLang's overlap scheduler (on by default) with the radix cache and decode CUDA graphs
    (``sglang_wgkv/integration/plugin/overlap.py``): requests on a shared prefix finish at different
    steps while others decode, and arrivals restore snapshots into the slots just freed, the order the
    forward fence guards. Each gives the tokens it gives alone on a cold cache (up to near-ties of bf16
    batching), with prefix hits, prompt-end snapshots taken ahead and none missed; idle check clean."""
    kernels = servers[0]
    system = long_prompt(12, seed=3)  # past W_local = 64: promoted pages in every snapshot
    jobs = [(f"{system} Item {i}:", 8 + 6 * (i % 5)) for i in range(12)]

    def generate(prompt, n):
        (o,) = kernels.generate(
            [prompt],
            max_new_tokens=n,
            return_logprob=True,
            top_logprobs_num=2,
            sampling_params={"ignore_eos": True},
        )
        lps = [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]
        tops = [[lp[0] for lp in top] for top in o["meta_info"]["output_top_logprobs"]]
        return (o["output_ids"], lps, tops), o["meta_info"]["cached_tokens"]

    cold = []
    for prompt, n in jobs:
        flush_cache(kernels)
        cold.append(generate(prompt, n)[0])
    flush_cache(kernels)
    before = kernels.wait_idle_checked()["radix"]
    warm = {}

    def run(i):
        time.sleep(0.05 * i)  # arrivals interleaved with decode steps and finishes
        warm[i] = generate(*jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for i, (prompt, _) in enumerate(jobs):
        agree(warm[i][0], cold[i], prompt)
    stats = kernels.wait_idle_checked()
    radix = stats["radix"]
    assert sum(cached for _, cached in warm.values()) > 0
    assert radix["snapshots_ahead"] > before["snapshots_ahead"]
    assert radix["snapshots_missed"] == before["snapshots_missed"]
    assert stats["free_pages"] + radix["snapshot_pages"] == stats["total_pages"]
    assert "cuda graph: True" in kernels.log_path.read_text()
