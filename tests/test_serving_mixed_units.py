"""In-process tests of mixed batches with WG-KV (no server process): the forward token budget, the
overcommit pool guard of a mixed pass, the scheduler hook around SGLang's prefill pass, the mixed
batch's decode rows, and the launcher's defaults."""

from types import SimpleNamespace

import pytest
import torch

from sglang_wgkv.config import WGKVConfig
from sglang_wgkv.integration.plugin.settings import ServingSettings
from sglang_wgkv.integration.scheduling.mixed_batches import (
    ForwardBudget,
    PassInputs,
    pass_inputs,
    pool_holds_mixed,
    schedule_prefill,
)
from sglang_wgkv.memory import DualCachePool

pytestmark = pytest.mark.serving

OWN = PassInputs(chunked_prefill_size=8192, max_prefill_tokens=16384, is_mixed_chunk=True)


def test_budget_prefill_share_keeps_a_quarter():
    budget = ForwardBudget(2048)
    assert [budget.prefill_share(d) for d in (0, 1, 1000, 1536, 5000)] == [2048, 2047, 1048, 512, 512]
    with pytest.raises(ValueError, match="at least 16"):
        ForwardBudget(8)


@pytest.mark.parametrize("decoding", [1, 100, 1900])
def test_pass_with_decodes_takes_the_budget(decoding):
    """Mixed: SGLang takes the decode rows out of the chunk, so the chunk is the share plus them; the
    forward then holds max(T, d + T/4) tokens, whatever SGLang's own chunk."""
    got = pass_inputs(OWN, decoding, ForwardBudget(2048))
    share = max(2048 - decoding, 512)
    assert got == PassInputs(share + decoding, share + decoding, True)
    unmixed = pass_inputs(OWN, decoding, ForwardBudget(2048), pool_holds_mixed=False)
    assert unmixed == PassInputs(share, share, False)


def test_pass_without_decodes_or_budget_is_sglangs_own():
    budget = ForwardBudget(2048)
    assert pass_inputs(OWN, 0, budget) == OWN  # the first wave: full chunks
    assert pass_inputs(OWN, 50, None) == OWN
    no_chunks = PassInputs(None, 16384, False)
    assert pass_inputs(no_chunks, 50, budget) == no_chunks
    small = PassInputs(256, 16384, True)  # a chunk below the budget is kept
    assert pass_inputs(small, 10, budget) == PassInputs(256, 2048, True)
    assert pass_inputs(OWN, 10, None, pool_holds_mixed=False) == PassInputs(8192, 16384, False)


L, H, W = 2, 2, 32


def _runtime(mode, pages):
    dual = DualCachePool(L, H, 16, pages, 8, 512, WGKVConfig(local_window=W), dtype=torch.float32)
    return SimpleNamespace(plan=SimpleNamespace(mode=mode), dual=dual, settings=ServingSettings())


def _hold(dual, slot, tokens):
    dual.alloc_request(slot)
    dual.begin_extend([slot], [0], [tokens])
    n = tokens
    for layer in range(L):
        dual.write_extend(
            layer, torch.zeros(n, H, 16), torch.zeros(n, H, 16), torch.ones(n, H, dtype=torch.bool)
        )
    return SimpleNamespace(req_pool_idx=slot, full_untruncated_fill_ids=[0] * tokens)


def test_pool_guard_mixes_only_when_chunk_and_decode_step_fit():
    """Overcommit: a chunked prompt's remaining reserve plus the running decode step must fit, else
    the pass runs the chunk alone; other modes and passes without a chunked prompt always mix."""
    runtime = _runtime("overcommit", 64)
    dual = runtime.dual
    running = [_hold(dual, 1, 40), _hold(dual, 2, 40)]  # past the ring: each promotes in every stream
    chunked = _hold(dual, 3, 16)
    chunked.full_untruncated_fill_ids = [0] * 400
    need = dual.extend_bound(16, 384) + dual.decode_worst_case([40, 40])
    free = dual.num_free_pages()
    assert need > free and not pool_holds_mixed(runtime, chunked, running)
    chunked.full_untruncated_fill_ids = [0] * 17  # one token left
    assert dual.extend_bound(16, 1) + dual.decode_worst_case([40, 40]) <= free
    assert pool_holds_mixed(runtime, chunked, running)
    assert pool_holds_mixed(runtime, None, running)
    assert pool_holds_mixed(runtime, chunked, [])
    runtime.plan.mode = "dense"
    assert pool_holds_mixed(runtime, chunked, running)


class _Scheduler:
    """The fields SGLang's prefill pass reads, and a pass that records them."""

    def __init__(self, runtime, chunked_req=None):
        self.token_to_kv_pool_allocator = SimpleNamespace(
            get_kvcache=lambda: SimpleNamespace(runtime=runtime)
        )
        self.chunked_prefill_size, self.max_prefill_tokens, self.is_mixed_chunk = 8192, 16384, True
        self.chunked_req = chunked_req
        self.seen = []

    def raw(self, prefill_delayer_single_pass=None, running_batch=None):
        self.seen.append((self.chunked_prefill_size, self.max_prefill_tokens, self.is_mixed_chunk))
        return "batch", running_batch


def _call(scheduler, running):
    return schedule_prefill(
        type(scheduler).raw, scheduler, prefill_delayer_single_pass=None, running_batch=running
    )


def test_schedule_prefill_sets_the_pass_and_restores_the_scheduler():
    runtime = _runtime("dense", 64)
    runtime.settings = ServingSettings(forward_tokens=64)
    scheduler = _Scheduler(runtime)
    running = SimpleNamespace(reqs=[object()] * 10)
    assert _call(scheduler, running) == ("batch", running)
    assert scheduler.seen[-1] == (64, 64, True)  # 54 prefill tokens beside 10 decode rows
    assert (scheduler.chunked_prefill_size, scheduler.max_prefill_tokens) == (8192, 16384)
    _call(scheduler, SimpleNamespace(reqs=[]))
    assert scheduler.seen[-1] == (8192, 16384, True)
    runtime.settings = ServingSettings()  # no budget: SGLang's own pass
    _call(scheduler, running)
    assert scheduler.seen[-1] == (8192, 16384, True)
    plain = _Scheduler(None)  # not a WG-KV pool
    _call(plain, running)
    assert plain.seen[-1] == (8192, 16384, True)


def test_schedule_prefill_unmixes_a_chunk_the_pool_cannot_hold_with_decodes():
    runtime = _runtime("overcommit", 64)
    running = [_hold(runtime.dual, 1, 40)]
    chunked = _hold(runtime.dual, 3, 16)
    chunked.full_untruncated_fill_ids = [0] * 2000
    scheduler = _Scheduler(runtime, chunked_req=chunked)
    _call(scheduler, SimpleNamespace(reqs=running))
    assert scheduler.seen[-1] == (8192, 16384, False) and scheduler.is_mixed_chunk
    chunked.full_untruncated_fill_ids = [0] * 20
    _call(scheduler, SimpleNamespace(reqs=running))
    assert scheduler.seen[-1] == (8192, 16384, True)


def test_mixed_batch_decode_rows_are_its_decoding_tail():
    from sglang_wgkv.integration.backend.batch_slots import mixed_decode_rows

    class Mode:
        def __init__(self, mixed):
            self.mixed = mixed

        def is_mixed(self):
            return self.mixed

    reqs = [object() for _ in range(5)]
    batch = SimpleNamespace(forward_mode=Mode(True), reqs=reqs, decoding_reqs=reqs[2:])
    assert mixed_decode_rows(batch) == 3
    assert mixed_decode_rows(SimpleNamespace(forward_mode=Mode(False), reqs=reqs, decoding_reqs=None)) == 0
    for bad in (reqs[1:4], reqs, [], [object()]):
        with pytest.raises(RuntimeError, match="not its last rows"):
            mixed_decode_rows(SimpleNamespace(forward_mode=Mode(True), reqs=reqs, decoding_reqs=bad))


def test_launcher_forward_budget_defaults(monkeypatch):
    """CUDA: the budget and SGLang's --enable-mixed-chunk by default; 0 turns both off; CPU: off unless
    given; refused below 16 tokens and with --disable-wgkv."""
    from sglang_wgkv.integration.plugin.settings import DEFAULT_GPU_FORWARD_TOKENS
    from sglang_wgkv.launch_server import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    settings, argv, env = resolve(["--model-path", "/m"])
    assert settings.forward_tokens == DEFAULT_GPU_FORWARD_TOKENS and "--enable-mixed-chunk" in argv
    assert ServingSettings.from_env(env) == settings
    settings, argv, _ = resolve(["--model-path", "/m", "--wgkv-forward-tokens", "0"])
    assert settings.forward_tokens is None and "--enable-mixed-chunk" not in argv
    _, argv, _ = resolve(["--model-path", "/m", "--enable-mixed-chunk"])
    assert argv.count("--enable-mixed-chunk") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings, argv, _ = resolve(["--model-path", "/m"])
    assert settings.forward_tokens is None and "--enable-mixed-chunk" not in argv
    settings, argv, _ = resolve(["--model-path", "/m", "--wgkv-forward-tokens", "64"])
    assert settings.forward_tokens == 64 and "--enable-mixed-chunk" in argv
    with pytest.raises(ValueError, match="at least 16"):
        resolve(["--model-path", "/m", "--wgkv-forward-tokens", "8"])
    with pytest.raises(ValueError, match="configure WG-KV"):
        resolve(["--model-path", "/m", "--disable-wgkv", "--wgkv-forward-tokens", "64"])


def test_mixed_chunk_accepted_by_the_backend_options():
    """``--enable-mixed-chunk`` is no longer refused with ``--attention-backend wgkv``."""
    from sglang_wgkv.integration.plugin.hooks import prepare_server_args

    args = SimpleNamespace(
        attention_backend="wgkv",
        prefill_attention_backend=None,
        decode_attention_backend=None,
        speculative_algorithm=None,
        enable_mixed_chunk=True,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        enable_hierarchical_cache=False,
        pp_size=1,
        dp_size=1,
        page_size=None,
        kv_cache_dtype="auto",
        disable_radix_cache=True,
        device="cpu",
        dtype="float32",
        disable_prefill_cuda_graph=False,
        disable_decode_cuda_graph=False,
    )
    prepare_server_args(args)
    assert args.enable_mixed_chunk and args.disable_decode_cuda_graph and args.disable_prefill_cuda_graph


def test_running_batch_capped_at_the_largest_decode_graph():
    """Without ``--max-running-requests`` a wgkv server with decode CUDA graphs runs at most its
    largest captured decode batch; a given cap, graphs off or another backend leave SGLang's own. The
    cap runs after ``__post_init__``, where SGLang's ``ServerArgs`` refuse plain assignment, so the
    cases are SGLang's own resolved objects (on CPU its decode graphs default to ``full``)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_wgkv.integration.plugin.hooks import cap_running_requests
    from sglang_wgkv.testing.short_model import SHORT_LAYERS, short_model_dir

    def resolved(backend="wgkv", **kwargs):
        args = ServerArgs(model_path=str(short_model_dir(SHORT_LAYERS)), device="cpu", **kwargs)
        if backend:
            args.override("test", attention_backend=backend)
        return args

    plain = resolved()
    with pytest.raises(AttributeError, match="read-only"):
        plain.max_running_requests = 1
    largest = plain.cuda_graph_config.decode.max_bs
    assert largest and plain.max_running_requests is None
    cases = [(plain, largest), (resolved(max_running_requests=1000), 1000)]
    cases += [(resolved(disable_cuda_graph=True), None), (resolved(backend=None), None)]
    for args, want in cases:
        cap_running_requests(None, args)
        assert args.max_running_requests == want
