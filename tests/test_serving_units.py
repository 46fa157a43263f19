"""In-process tests of the serving glue: capacity split, request-slot lifecycle, pre-RoPE capture,
the sgl_kernel stand-in and the launcher's option handling (no server process)."""

import itertools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.plugin.settings import ENV_VAR, ServingSettings
from sglang_wgkv.integration.pools.capacity import SLACK_TOKENS, dense_split, physical_pages

pytestmark = pytest.mark.serving


def test_split_capacity_reserves_slack_per_request_slot():
    split = dense_split(4096, max_running_requests=2048)
    assert split.physical_tokens == 4096
    assert split.logical_tokens + SLACK_TOKENS * split.max_requests == 4096
    assert split.max_requests == 16  # slack limited to a quarter of the budget
    assert dense_split(100_000, 8).max_requests == 8
    assert physical_pages(4096, 30, 3) == 4096 * 90 // 16
    with pytest.raises(ValueError, match="at least"):
        dense_split(200, 8)


def test_capacity_plan_counts_per_slot_state():
    """The page-table rows, ring flags and (with --kv-budget) evictor windows of every request slot
    come out of SGLang's KV budget: physical pages + that state = the budget."""
    from sglang_wgkv.integration.pools.capacity import plan_capacity
    from sglang_wgkv.integration.pools.slot_costs import ModelShape, fixed_costs

    shape = ModelShape(
        num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, context_len=8192, dtype_bytes=2
    )
    costs = fixed_costs(shape, local_window=256, evictor_window=None)
    row_bytes = 90 * (4 * (16 + 496 + 1) + 256 + 4 + 8)  # int32 page table + flags + lengths + counters
    assert costs.slot_tokens == -(-row_bytes // shape.token_bytes) and costs.window_tokens == 0
    plan = plan_capacity(100_000, 4096, shape=shape, local_window=256)
    # without --kv-budget: the query windows (32 queries) of the bounded requests (long_requests.py)
    rows = fixed_costs(shape, 256, 32).window_tokens * plan.long_request_rows
    assert plan.long_request_rows == 4 and rows <= 100_000 // 16
    assert plan.mode == "dense" and plan.fixed_tokens == plan.max_requests * costs.slot_tokens + rows > rows
    assert plan.physical_tokens + plan.fixed_tokens == 100_000
    assert plan.logical_tokens + SLACK_TOKENS * plan.max_requests == plan.physical_tokens
    budgeted = plan_capacity(100_000, 4096, shape=shape, local_window=256, kv_budget=512, evictor_window=256)
    window = fixed_costs(shape, 256, 256).window_tokens
    assert window == 30 * 256 * 9 * 64 * 2 // shape.token_bytes  # the evictor's bf16 query window
    assert budgeted.fixed_tokens == budgeted.max_requests * (costs.slot_tokens + window)
    assert budgeted.max_requests * window <= 100_000 // 4


def test_runtime_makes_the_one_kernel_choice():
    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime

    choose = WGKVRuntime.choose_kernels
    assert choose(ServingSettings(attention="auto"), "cuda", torch.bfloat16)
    assert not choose(ServingSettings(attention="reference"), "cuda", torch.bfloat16)  # torch promotion too
    assert not choose(ServingSettings(attention="auto"), "cuda", torch.float32)
    assert not choose(ServingSettings(attention="auto"), "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="kernels needs a CUDA device"):
        choose(ServingSettings(attention="kernels"), "cpu", torch.bfloat16)


def test_settings_round_trip_through_the_environment():
    s = ServingSettings(
        config=WGKVConfig(local_window=64, tau=0.3, random_admission=0.25, kv_budget=512),
        gates_path="/x/gates",
        seed=7,
        attention="reference",
    )
    assert ServingSettings.from_env({ENV_VAR: s.to_env()}) == s
    assert ServingSettings.from_env({}) == ServingSettings()
    with pytest.raises(ValueError, match="malformed"):
        ServingSettings.from_env({ENV_VAR: "{not json"})
    with pytest.raises(ValueError, match="tau"):
        ServingSettings.from_env({ENV_VAR: s.to_env().replace('"tau": 0.3', '"tau": 3.0')})
    with pytest.raises(ValueError, match="attention"):
        ServingSettings(attention="fast")


def _dual(max_requests=4):
    from sglang_wgkv.memory import DualCachePool

    return DualCachePool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        num_pages=64,
        max_requests=max_requests,
        max_context_len=128,
        config=WGKVConfig(local_window=16),
        dtype=torch.float32,
    )


def _req_pool():
    """``(dual pool, runtime, WGKVReqToTokenPool of 3 slots)`` over :func:`_dual`."""
    from sglang_wgkv.integration.plugin.runtime import WGKVRuntime
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    dual = _dual()
    runtime = WGKVRuntime(ServingSettings(config=dual.config), dual=dual)
    pool = WGKVReqToTokenPool(
        size=3, max_context_len=128, device="cpu", enable_memory_saver=False, runtime=runtime
    )
    return dual, runtime, pool


def _req(custom_params, output_ids=(5, 6, 7)):
    """A finished SGLang ``Req`` stand-in with ``custom_params`` and no slot yet."""
    return SimpleNamespace(
        req_pool_idx=None,
        sampling_params=SimpleNamespace(custom_params=custom_params),
        output_ids=list(output_ids),
        customized_info=None,
        finished=lambda: True,
    )


def test_req_pool_owns_dual_slot_lifetimes():
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    dual, runtime, pool = _req_pool()
    a, b = _req({"wgkv": {"tau": 0.5}}), _req(None)
    pool.alloc([a, b])
    assert dual.active[[a.req_pool_idx, b.req_pool_idx]].all()
    assert pool.slot_tau[[a.req_pool_idx, b.req_pool_idx]].tolist() == pytest.approx([0.5, dual.config.tau])
    dual.begin_extend([a.req_pool_idx], [0], [40])
    dual.write_extend(0, torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.ones(40, 2, dtype=torch.bool))
    assert pool.idle_check()  # a slot is still held
    assert pool.idle_check() is None  # nothing changed since
    slot_a = a.req_pool_idx
    pool.free(a)
    assert not dual.active[slot_a] and dual.active[b.req_pool_idx]
    usage = a.customized_info["wgkv"]  # at the last output token
    assert usage[:2] == [None, None] and usage[2]["tau"] == 0.5 and usage[2]["cached_tokens"] == 40
    # layer 0 admitted the 24 tokens that left its 16-token window on both heads; layer 1 was not written
    assert usage[2]["admitted_fraction"] == pytest.approx(0.5)
    assert (
        usage[2]["mean_kv_tokens_per_head"] == pytest.approx(16 + 12) and usage[2]["eviction_triggers"] == 0
    )
    pool.clear()
    assert pool.idle_check() == [] and pool.stats()["idle_checks"] == 2
    assert pool.requests_started == pool.requests_released == 2
    with pytest.raises(ValueError, match="request slots"):
        WGKVReqToTokenPool(
            size=8, max_context_len=128, device="cpu", enable_memory_saver=False, runtime=runtime
        )


def test_req_pool_marks_requests_whose_cache_is_dense():
    """``slot_dense``: admission off, unbounded (neither by its own ``kv_budget`` nor by the server's)
    and no restored prefix (the dense prefill's condition, ``attention/fa3_dense.py``); cleared when
    the slot is freed."""
    dual, runtime, pool = _req_pool()

    def req(custom_params):
        return _req(custom_params, output_ids=[5])

    class Restoring:  # a prefix cache that restored 20 tokens into the second request's slot
        def restore_prefixes(self, reqs):
            dual.cached_len[reqs[1].req_pool_idx] = 20

        def slot_freed(self, slot):
            pass

    runtime._prefix_cache = Restoring()
    kept, restored, admitting = (
        req({"wgkv": {"admission": False}}),
        req({"wgkv": {"admission": False}}),
        req(None),
    )
    pool.alloc([kept, restored, admitting])
    assert [pool.slot_dense[r.req_pool_idx] for r in (kept, restored, admitting)] == [True, False, False]
    slot = kept.req_pool_idx
    dual.cached_len[restored.req_pool_idx] = 0
    pool.free(kept)
    assert not pool.slot_dense[slot]
    pool.clear()

    class ServerBudget:  # --kv-budget: every slot without a bound of its own is held to the server's
        budget, prompt_cap, lead = 512, None, 32

        def request_bound(self, slot):
            return self.budget

        def bound_request(self, *args):
            raise AssertionError("no request here sets its own kv_budget")

        def release_request(self, slot):
            pass

    runtime._evictor, runtime._prefix_cache = ServerBudget(), None
    evicted = req({"wgkv": {"admission": False}})
    pool.alloc([evicted])
    assert not pool.slot_dense[evicted.req_pool_idx]  # SnapKV may drop its keys: not dense


class InPlaceRope(torch.nn.Module):
    """Rotates q and k in place, as SGLang's CUDA rotary embedding does."""

    def forward(self, positions, query, key):
        angle = positions[:, None].float()
        for x in (query, key):
            a, b = x[..., 0::2].clone(), x[..., 1::2].clone()
            x[..., 0::2] = a * angle.cos() - b * angle.sin()
            x[..., 1::2] = a * angle.sin() + b * angle.cos()
        return query, key


def test_pre_rope_capture_sees_the_key_before_rotation():
    from sglang_wgkv.integration.backend.gates import PreRopeKeyCapture

    class Attn(torch.nn.Module):
        def __init__(self, rope):
            super().__init__()
            self.rotary_emb, self.attn = rope, torch.nn.Identity()

        def forward(self, positions, q, k):
            return self.rotary_emb(positions, q, k)

    shared = InPlaceRope()  # SGLang's get_rope caches modules: layers may share one
    model = torch.nn.Sequential(Attn(shared), Attn(shared))
    capture = PreRopeKeyCapture.install(model)
    assert len(capture._handles) == 1
    pos = torch.arange(1, 6)
    for layer in model:
        q, k = torch.randn(5, 2 * 16), torch.randn(5, 2 * 16)
        k_in = k.clone()
        _, k_post = layer(pos, q, k)
        assert not torch.allclose(k_post, k_in)
        assert torch.equal(capture.take(k_post.view(5, 2, 16)), k_in.view(5, 2, 16))
    with pytest.raises(RuntimeError, match="no pre-RoPE key"):
        capture.take(k_post)
    with pytest.raises(ValueError, match="rotary_emb"):
        PreRopeKeyCapture.install(torch.nn.Linear(2, 2))


def test_sgl_kernel_standin_is_installed_only_on_the_cpu_engine():
    code = (
        "import sys; from sglang_wgkv.integration.plugin import cpu_compat as c; c.install_if_needed(); "
        "m = sys.modules.get('sgl_kernel'); print(bool(m and getattr(m, c.STANDIN_MARKER, False)))"
    )

    def run(cpu: str) -> str:
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": cpu}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    from sglang_wgkv.integration.plugin.cpu_compat import (
        CPU_BUILD_NAMES,
        build_standin,
        real_sgl_kernel_loads,
    )

    expected = "False" if real_sgl_kernel_loads() else "True"
    assert run("1") == expected
    assert run("0") == "False"
    standin = build_standin()
    assert len(CPU_BUILD_NAMES) == 7 and all(hasattr(standin, n) for n in CPU_BUILD_NAMES)
    with pytest.raises(NotImplementedError, match="stand-in"):
        standin.copy_all_layer_kv_cache_cpu()


def test_launcher_fills_in_defaults(monkeypatch):
    from sglang_wgkv.embedded_model import ensure_embedded_model
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings, argv, env = resolve(["--wgkv-tau", "0.2", "--port", "1234"])
    assert argv[:2] == ["--model-path", str(ensure_embedded_model())]
    assert argv[argv.index("--device") + 1] == "cpu" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert argv[argv.index("--attention-backend") + 1] == "wgkv" and "--port" in argv
    assert settings.config.tau == 0.2 and ServingSettings.from_env(env) == settings
    # OpenMP threads that sleep when idle (a busy box starves spinning ones); the user's policy wins
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert resolve([])[2]["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert resolve([])[2]["OMP_WAIT_POLICY"] == "ACTIVE"
    # the embedded model is served with the gates trained for it; "fresh" opts out
    from sglang_wgkv.embedded_model import SHIPPED_GATES

    assert settings.gates_path == str(SHIPPED_GATES.resolve())
    assert resolve(["--wgkv-gates", "fresh"])[0].gates_path is None
    # CPU tensor parallelism: one OpenMP core set per rank, no CUDA NCCL
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    env = resolve(["--tp-size", "3"])[2]
    cores = os.cpu_count()
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "|".join(str(r % cores) for r in range(3))
    assert env["SGLANG_NCCL_SO_PATH"].startswith("/nonexistent")
    # SnapKV alone: every token admitted, the evictor enforces the budget
    settings = resolve(["--disable-wgkv", "--kv-budget", "64"])[0]
    assert settings.config.random_admission == 1.0 and settings.config.kv_budget == 64
    assert settings.gates_path is None
    settings, argv, env = resolve(["--disable-wgkv", "--model-path", "/m"])
    assert settings is None and ENV_VAR not in env
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"


def test_decode_launch_spec(monkeypatch):
    """--wgkv-decode-launch: the split kernel's launch shape for in-service measurements, parsed and
    checked by the launcher, handed to the schedulers with the other settings; defaults when absent."""
    from sglang_wgkv.attention.decode_config import DecodeConfig, choose_num_splits
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert DecodeConfig.parse("") == DecodeConfig() and resolve(["--model-path", "/m"])[0].decode_launch == ""
    cfg = DecodeConfig.parse(
        " block_n=32, num_warps=8,num_stages=3,pdl=1,fused_merge=false,programs_per_sm=2,maxnreg=128 "
    )
    assert cfg == DecodeConfig(
        block_n=32, num_warps=8, num_stages=3, fused_merge=False, pdl=True, programs_per_sm=2, maxnreg=128
    )
    settings, _, env = resolve(["--model-path", "/m", "--wgkv-decode-launch", "block_n=32,pdl=1"])
    assert ServingSettings.from_env(env) == settings and settings.decode_launch == "block_n=32,pdl=1"
    for bad, msg in (
        ("block_n=24", "power of two"),
        ("warps=4", "NAME=VALUE"),
        ("pdl=yes", "0/1"),
        ("num_stages=", "positive integer"),
        ("programs_per_sm=0", "1-64"),
        ("num_warps=3", "num_warps"),
        ("maxnreg=100", "multiple of 8"),
        ("maxnreg=256", "24-255"),
    ):
        with pytest.raises(ValueError, match=msg):
            resolve(["--model-path", "/m", "--wgkv-decode-launch", bad])
    with pytest.raises(ValueError, match="configure WG-KV"):
        resolve(["--model-path", "/m", "--disable-wgkv", "--wgkv-decode-launch", "pdl=1"])
    # the split count follows programs_per_sm (132 SMs without CUDA): 8 streams of 124K tokens
    assert choose_num_splits(1, 8, 126976) == 66 and choose_num_splits(1, 8, 126976, programs_per_sm=2) == 33


def test_extend_kernels_default(monkeypatch):
    """--[no-]wgkv-extend-kernels: the pool's Triton extend launches, on by default where the kernels
    path runs (CUDA, attention not ``reference``), off on CPU; either spelling wins over the default and
    reaches the schedulers with the other settings; asking for them with the reference attention or
    with --disable-wgkv is refused."""
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(["--model-path", "/m"])[0].extend_kernels is False
    from sglang_wgkv.memory import DualCachePool

    assert DualCachePool(1, 1, 16, 8, 1, 64).triton_extend is False
    settings, _, env = resolve(["--model-path", "/m", "--wgkv-extend-kernels"])
    assert settings.extend_kernels and ServingSettings.from_env(env) == settings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve(["--model-path", "/m"])[0].extend_kernels is True
    assert resolve(["--model-path", "/m", "--wgkv-attention", "reference"])[0].extend_kernels is False
    settings, _, env = resolve(["--model-path", "/m", "--no-wgkv-extend-kernels"])
    assert settings.extend_kernels is False and ServingSettings.from_env(env) == settings
    with pytest.raises(ValueError, match="needs the kernels path"):
        resolve(["--model-path", "/m", "--wgkv-extend-kernels", "--wgkv-attention", "reference"])
    with pytest.raises(ValueError, match="configure WG-KV"):
        resolve(["--model-path", "/m", "--disable-wgkv", "--wgkv-extend-kernels"])


def test_launcher_refuses_float32_on_cuda(monkeypatch):
    """SGLang's CUDA RMSNorm has no float32 kernel: such a server dies at its first forward. The
    launcher says so before start-up; CPU float32 (the tests' default) stays."""
    from sglang_wgkv.launch_server import resolve

    for cuda, args in ((True, []), (False, ["--device", "cuda"])):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        for dtype in ("float32", "float"):
            for extra in ([], ["--disable-wgkv"]):
                with pytest.raises(ValueError, match="float32 is not served on CUDA"):
                    resolve([*args, "--model-path", "/m", "--dtype", dtype, *extra])
        assert resolve([*args, "--model-path", "/m", "--dtype", "bfloat16"])[0] is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(["--model-path", "/m", "--dtype", "float32"])[0] is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve(["--model-path", "/m", "--dtype", "float32", "--device", "cpu"])[0] is not None
    # a repeated option: argparse keeps the last, and so does the launcher (the GPU tests' servers put
    # --dtype bfloat16 after sglang_wgkv.testing.serving's float32 default)
    assert resolve(["--model-path", "/m", "--dtype", "float32", "--dtype", "bfloat16"])[0] is not None
    with pytest.raises(ValueError, match="float32 is not served on CUDA"):
        resolve(["--model-path", "/m", "--dtype=bfloat16", "--dtype", "float32"])
    with pytest.raises(ValueError, match="float32 is not served on CUDA"):
        resolve(["--model-path", "/m", "--device", "cpu", "--device", "cuda", "--dtype", "float32"])


def test_cpu_default_kv_budget_is_a_fraction_of_ram(monkeypatch):
    """On CPU the launcher caps the KV cache at 1/8 of the RAM (SGLang's own default takes nearly all
    the memory available at start), for WG-KV and the --disable-wgkv baseline alike; an explicit
    --max-total-tokens or --mem-fraction-static wins."""
    from sglang_wgkv.embedded_model import ensure_embedded_model
    from sglang_wgkv.launch_server import CPU_KV_RAM_FRACTION, cpu_default_kv_tokens, resolve

    model = str(ensure_embedded_model())
    token_bytes = 2 * 30 * 3 * 64 * 2  # bf16 K and V of the embedded model's 30 layers x 3 KV heads
    assert (
        cpu_default_kv_tokens(model, [], ram_bytes=24 << 30)
        == int((24 << 30) * CPU_KV_RAM_FRACTION) // token_bytes
    )
    assert cpu_default_kv_tokens(model, ["--dtype", "float32"], ram_bytes=24 << 30) == int(
        (24 << 30) * CPU_KV_RAM_FRACTION
    ) // (2 * token_bytes)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from sglang_wgkv import launch_server

    # the budget follows the dtype the launcher picks, which depends on the CPU's half-precision units
    for half, args in itertools.product((False, True), ([], ["--disable-wgkv"], ["--dtype", "bfloat16"])):
        monkeypatch.setattr(launch_server, "cpu_half_matmul", lambda half=half: half)
        argv = resolve(args)[1]
        dtype = ["--dtype", argv[argv.index("--dtype") + 1]] if "--dtype" in argv else []
        assert ("--dtype" in argv) == (not half or "--dtype" in args)
        assert argv[argv.index("--max-total-tokens") + 1] == str(cpu_default_kv_tokens(model, dtype))
    for given in (["--max-total-tokens", "4096"], ["--mem-fraction-static", "0.3"]):
        argv = resolve(given)[1]
        assert argv.count("--max-total-tokens") == given.count("--max-total-tokens")


def test_cpu_default_dtype_is_float32_without_half_precision_matmuls(monkeypatch, tmp_path):
    """On a CPU without half-precision matmul units the launcher serves float32 (SGLang's ``auto``
    would serve the float32 checkpoint in float16, several times slower there), for WG-KV and the
    --disable-wgkv baseline alike; with such units, or with any --dtype given, SGLang decides."""
    from sglang_wgkv import launch_server
    from sglang_wgkv.launch_server import cpu_half_matmul, resolve

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse2 avx2 avx512f\n\nprocessor : 1\nflags : fpu avx2\n")
    assert not cpu_half_matmul(str(cpuinfo))
    cpuinfo.write_text("processor : 0\nflags : fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert cpu_half_matmul(str(cpuinfo))
    assert not cpu_half_matmul(str(tmp_path / "missing"))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for half, expected in ((False, "float32"), (True, None)):
        monkeypatch.setattr(launch_server, "cpu_half_matmul", lambda half=half: half)
        for args in ([], ["--disable-wgkv"]):
            argv = resolve(args)[1]
            assert (argv[argv.index("--dtype") + 1] if "--dtype" in argv else None) == expected, argv
    monkeypatch.setattr(launch_server, "cpu_half_matmul", lambda: False)
    for given in ("auto", "bfloat16", "float16"):
        argv = resolve(["--dtype", given])[1]
        assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == given
    argv = resolve(["--device", "cuda", "--dtype", "bfloat16"])[1]  # not on CPU: untouched
    assert argv.count("--dtype") == 1 and "--sleep-on-idle" not in argv


def test_cpu_servers_sleep_when_idle(monkeypatch):
    """On CPU an idle SGLang scheduler busy-polls a core unless --sleep-on-idle: the launcher adds it,
    for WG-KV and --disable-wgkv alike, once, and not on CUDA."""
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in ([], ["--disable-wgkv"], ["--sleep-on-idle"]):
        assert resolve(args)[1].count("--sleep-on-idle") == 1, args
    assert "--sleep-on-idle" not in resolve(["--device", "cuda"])[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--wgkv-tau", "2"], "tau must be in"),
        (["--wgkv-local-window", "20"], "multiple of 16"),
        (["--wgkv-random-admission", "1.5"], "random_admission"),
        (["--kv-budget", "3"], "kv_budget"),
        (["--disable-wgkv", "--wgkv-tau", "0.2"], "drop --disable-wgkv"),
        (["--disable-wgkv", "--kv-budget", "64", "--wgkv-tau", "0.2"], "SnapKV alone"),
        (["--attention-backend", "triton"], "--disable-wgkv for plain SGLang"),
        (["--tokenizer-worker-num", "2"], "tokenizer-worker-num 2 is not supported"),
        (["--disable-wgkv", "--kv-budget", "64", "--tokenizer-worker-num", "4"], "load no plugins"),
        (["--wgkv-gates", "/nonexistent/gates"], "no such gate checkpoint"),
        # the shipped gates were trained with W_local = 256: another served window is refused
        (["--wgkv-local-window", "32"], "trained with W_local = 256 cannot be served with W_local = 32"),
        (["--wgkv-prefill-vertical", "fa3"], "needs a Hopper GPU"),
        (["--wgkv-prefill-band", "fa3"], "needs a Hopper GPU"),
    ],
)
def test_launcher_rejects_bad_options(monkeypatch, args, message):
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=message):
        resolve(args)


def test_server_accepts_official_qwen3_gates_and_checks_the_model(tmp_path):
    """The authors' Qwen3 layout (hidden width 1.5 * head_dim) passes the launcher's and the backend's
    checks against a Qwen3-shaped model, keeps its width through a TP head cut, and a wrong model is named."""
    import json

    from sglang_wgkv.gate import GateConfig, WriteGates
    from sglang_wgkv.integration.backend.gates import build_gates
    from sglang_wgkv.launch_server import check_gates

    L, H, D = 2, 2, 32
    gates = WriteGates(GateConfig(num_layers=L, num_kv_heads=H, head_dim=D, hidden=48))
    state = {}
    for i, lg in enumerate(gates.layers):
        p = f"model.layers.{i}.self_attn.g_predictors."
        state[p + "pre_key_norm.weight"], state[p + "post_key_norm.weight"] = (
            lg.pre_norm.data,
            lg.post_norm.data,
        )
        state[p + "conv1.weight"] = lg.w1.data.transpose(1, 2).reshape(H * 48, 2 * D, 1)
        state[p + "conv1.bias"], state[p + "conv2.weight"] = lg.b1.data.reshape(-1), lg.w2.data[:, :, None]
        state[p + "conv2.bias"] = lg.b2.data
    torch.save(state, tmp_path / "qwen3_gates.pt")
    model = tmp_path / "qwen3"
    model.mkdir()
    cfg = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": L,
        "num_attention_heads": 4,
        "num_key_value_heads": H,
        "head_dim": D,
        "hidden_size": 128,
        "intermediate_size": 256,
        "vocab_size": 1000,
    }
    (model / "config.json").write_text(json.dumps(cfg))
    check_gates(str(tmp_path / "qwen3_gates.pt"), str(model), 256)
    settings = ServingSettings(config=WGKVConfig(), gates_path=str(tmp_path / "qwen3_gates.pt"))
    served = build_gates(settings, L, H, D, "cpu", heads=[1])
    assert served.config.hidden == 48 and tuple(served.layers[1].w1.shape) == (1, 2 * D, 48)
    torch.testing.assert_close(served.layers[1].w2, gates.layers[1].w2.data[1:])
    (model / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(
        ValueError, match=r"expected \(layers, kv_heads, head_dim\) = \(2, 4, 32\), found \(2, 2, 32\)"
    ):
        check_gates(str(tmp_path / "qwen3_gates.pt"), str(model), 256)


def test_server_process_waits_stops_the_group_and_reports_an_exit(tmp_path):
    """The shared server-process helper on stand-in servers (no SGLang): healthy once its path
    answers 200, stop() ends a child the server spawned (its process group), and a server that
    exits during start-up raises with the log's tail."""
    from sglang_wgkv.server_process import ServerProcess, free_port

    port = free_port()
    # the "launcher" spawns a child that holds the port, as SGLang's launcher spawns the scheduler
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-m', 'http.server', '{port}'])"
    srv = ServerProcess(
        [sys.executable, "-c", child],
        tmp_path / "ok.log",
        port=port,
        env=dict(os.environ),
        cwd=tmp_path,
        stop_timeout_s=10,
    )
    try:
        assert srv.wait_healthy(60, path="/", probe_timeout_s=5) > 0 and srv.alive()
    finally:
        srv.stop()
    assert not srv.alive()
    with pytest.raises(Exception):  # the spawned child went with the group
        __import__("requests").get(srv.url + "/", timeout=2)

    bad = ServerProcess(
        [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
        tmp_path / "bad.log",
        port=free_port(),
        env=dict(os.environ),
        cwd=tmp_path,
    )
    with pytest.raises(RuntimeError, match=r"exited with 3:\n(.|\n)*no model here"):
        bad.wait_healthy(60)
    bad.stop()


def test_wgkv_lowers_sglangs_own_memory_fraction_only():
    """reserve_gpu_memory: SGLang's own choice of --mem-fraction-static (none given) is lowered by
    GPU_RESERVE_MIB of the GPU's memory for the wgkv backend; a given fraction, another backend and a
    CPU (no gpu_mem) keep SGLang's value. The hooked method exists in the pinned SGLang."""
    from sglang.srt.server_args import ServerArgs

    from sglang_wgkv.integration.plugin.hooks import reserve_gpu_memory
    from sglang_wgkv.integration.plugin.settings import GPU_RESERVE_MIB

    assert callable(getattr(ServerArgs, "_handle_gpu_memory_settings", None))

    def sglang_choice(args, gpu_mem):  # stands in for SGLang: fills the fraction when none was given
        if args.mem_fraction_static is None:
            args.mem_fraction_static = 0.907
        return "result"

    def run(backend, given, gpu_mem):
        args = SimpleNamespace(attention_backend=backend, mem_fraction_static=given)
        assert reserve_gpu_memory(sglang_choice, args, gpu_mem) == "result"
        return args.mem_fraction_static

    h200 = 143771
    lowered = run("wgkv", None, h200)
    assert lowered <= 0.907 - GPU_RESERVE_MIB / h200 and lowered > 0.907 - GPU_RESERVE_MIB / h200 - 0.001
    assert run("wgkv", 0.5, h200) == 0.5
    assert run("flashinfer", None, h200) == 0.907
    assert run("wgkv", None, None) == 0.907


def test_req_pool_alloc_and_a_bounded_row_make_no_host_copy():
    """Under the overlap scheduler ``alloc`` runs while a forward is in flight, its stream behind that
    forward (``forward_fence``): a blocking host-to-device copy there (``slot_tau[slot] = tau``: a 1-D
    tensor's element takes a copy of a host scalar) waited for the whole forward, and the host scheduled
    and launched the next one while the GPU idled. The pool's and the evictor's per-slot device state
    are written by fills (counted on CPU: ``sglang_wgkv.testing.op_count``)."""
    from sglang_wgkv.memory import SnapKVEvictor
    from sglang_wgkv.testing.op_count import counting_ops

    dual, runtime, pool = _req_pool()
    evictor = SnapKVEvictor(dual, budget=None, num_q_heads=4, window=8, rows=1)
    device = [pool.slot_tau, evictor.row, evictor.q_pos] + [
        t for t in vars(dual).values() if isinstance(t, torch.Tensor)
    ]
    a, b = _req({"wgkv": {"tau": 0.5}}), _req(None)
    with counting_ops(device) as counts:
        pool.alloc([a, b])
        evictor.bound_request(a.req_pool_idx, budget=48)
    assert not [k for k in counts if k[0] == "sync"], counts
    assert int(evictor.row[a.req_pool_idx]) == 0
    with counting_ops(device) as counts:  # a freed slot's row returned
        evictor.release_request(a.req_pool_idx)
    assert not [k for k in counts if k[0] == "sync"], counts
    assert int(evictor.row[a.req_pool_idx]) == evictor.rows
    assert pool.slot_tau[[a.req_pool_idx, b.req_pool_idx]].tolist() == pytest.approx([0.5, dual.config.tau])
