"""Tensor parallelism on CPU (gloo): the short model's 3 KV heads (the embedded model's first layers)
on 3 ranks, one dual pool, one slice of the gates and one evictor per rank, against the same server at
TP=1.

The gates make the ranks differ (KV head 0 never admits, heads 1-2 always, W_local = 16), so a rank
running another head's gate, or a pool holding the wrong head, changes the greedy tokens; with
``--kv-budget`` each rank's evictor cuts its admitting head, and the tokens it evicts must add up to
TP=1's. Both servers come from the session's pool.
"""

import pytest

from sglang_wgkv.testing.server_pool import HeadGates, ServerEnv, shared_server
from sglang_wgkv.testing.serving import flush_cache, long_prompt
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.scale

W_LOCAL = 16
PROMPTS = [long_prompt(10, seed=s) for s in range(2)] + ["The capital of France is"]
HEAD_GATES = HeadGates((-30.0, 30.0, 30.0), W_LOCAL, SHORT_LAYERS)


def test_rank_kv_heads():
    from sglang_wgkv.integration.plugin.runtime import counts_heads, rank_kv_heads

    assert [rank_kv_heads(3, 3, r) for r in range(3)] == [[0], [1], [2]]
    assert [rank_kv_heads(8, 2, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_kv_heads(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    # a replicated head counts once in a sum over ranks: on its first rank
    assert [counts_heads(2, 4, r) for r in range(4)] == [True, False, True, False]
    assert [counts_heads(8, 2, r) for r in range(2)] == [True, True]


def test_select_heads_matches_full_gates():
    import torch

    from sglang_wgkv.gate import GateConfig, WriteGates

    torch.manual_seed(0)
    full = WriteGates(GateConfig(num_layers=2, num_kv_heads=3, head_dim=8))
    k_pre, k_post = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    for heads in ([0], [1, 2], [2]):
        part = full.select_heads(heads)
        assert part.config.num_kv_heads == len(heads)
        torch.testing.assert_close(
            part(1, k_pre[:, heads], k_post[:, heads]), full(1, k_pre, k_post)[:, heads]
        )


# the TP=1 side: test_scale_serving's server (its metrics flags beside); --kv-budget makes the evictor
# cut the admitting heads on each rank
KV_BUDGET = 48
tp1_server = shared_server(
    "--model-path", ShortModel(), "--wgkv-local-window", str(W_LOCAL), "--wgkv-gates", HEAD_GATES,
    "--kv-budget", str(KV_BUDGET), "--enable-metrics", "--decode-log-interval", "1",
)  # fmt: skip


def _outputs(srv) -> tuple[list, list]:
    outs = srv.generate(PROMPTS, max_new_tokens=12)
    stats = srv.wait_idle_checked()
    assert stats["active_requests"] == 0 and stats["global_tokens"] == 0  # rank 0's pool, idle-checked
    return [o["output_ids"] for o in outs], [o["meta_info"]["wgkv"][-1] for o in outs]


# SGLang's CPU engine wants one core set per rank when there are more ranks than NUMA nodes (it binds
# threads to them only with AMX/arm64 kernels; here they are just a label per rank). The venv's CUDA
# build of torch ships libnccl, which SGLang would then try to use on the CPU: point it at no library
# so the TP group falls back to torch.distributed over gloo. At TP > 1 SGLang's vocab-parallel
# embedding is torch.compile'd: on CPU each rank's first forward then builds the inductor's ISA probes
# (about 25 s on two cores), which the eager function does not need.
TP3_ENV = ServerEnv.of(
    SGLANG_CPU_OMP_THREADS_BIND="0|1|0",
    SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so.2",
    TORCHDYNAMO_DISABLE="1",
)
# pooled as well (no other module shares it): it starts ahead, while the modules before this one run
tp3_server = shared_server(
    "--model-path", ShortModel(), "--wgkv-local-window", str(W_LOCAL), "--wgkv-gates", HEAD_GATES,
    "--kv-budget", str(KV_BUDGET), "--tp-size", "3", TP3_ENV,
)  # fmt: skip


def test_tp3_greedy_equals_tp1(tp1_server, tp3_server):
    flush_cache(tp1_server)  # shared: no prefix of another module's requests
    ids1, usage1 = _outputs(tp1_server)
    ids3, usage3 = _outputs(tp3_server)
    assert ids3 == ids1
    for u1, u3 in zip(usage1, usage3):  # rank 0 holds head 0 only; usage is reduced over the ranks
        assert u3["admitted_fraction"] == pytest.approx(u1["admitted_fraction"])
        assert u3["mean_kv_tokens_per_head"] == pytest.approx(u1["mean_kv_tokens_per_head"])
        assert u3["evicted_tokens"] == u1["evicted_tokens"]
    assert usage1[0]["admitted_fraction"] == pytest.approx(2 / 3)
    assert usage1[0]["evicted_tokens"] > 0  # the long prompts' admitting heads were cut to the budget
