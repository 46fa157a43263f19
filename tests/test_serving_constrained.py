"""Constrained decoding on the CPU server (:mod:`sglang_wgkv.integration.requests.constrained`): the CPU mask
against its torch reference, the start-up probe with SGLang's real xgrammar backend (a device that
cannot mask gets a backend that rejects each constrained request), and one CPU server (SGLang's
default grammar backend) running SGLang's own frontend programs (:mod:`evals.frontend_programs`) plus
JSON schema / EBNF requests: every request succeeds, every constrained output obeys its constraint,
the server stays up."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import requests
import torch

from evals.frontend_programs import PROGRAMS, constraint_violation, run_programs, server_healthy
from sglang_wgkv.testing.server_pool import HeadGates, shared_server
from sglang_wgkv.testing.short_model import SHORT_LAYERS, ShortModel

pytestmark = pytest.mark.serving

# SGLang's default grammar backend on the short model (a constraint binds whatever the model would say):
# test_serving_api's server, shared (every KV head admits every token)
server = shared_server(
    "--model-path", ShortModel(), "--chunked-prefill-size", "128", "--wgkv-local-window", "32",
    "--wgkv-gates", HeadGates((30.0, 30.0, 30.0), 32, SHORT_LAYERS),
)  # fmt: skip
# The programs' own limits go up to 512 tokens; every constrained step is masked the same way, so a few
# tokens per generation show the mechanics (benchmarks/results/constrained/ ran with the same cap).
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def constrained():
    """The hooks module, imported at first use: it imports SGLang's grammar backends (seconds), which
    collection need not wait for."""
    from sglang_wgkv.integration.requests import constrained

    return constrained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,width", [(49152, 49152), (1000, 1003), (100, 200), (33, 40)])
def test_cpu_mask_matches_torch_reference(dtype, vocab, width, constrained):
    gen = torch.Generator().manual_seed(vocab + width)
    logits = torch.randn(3, width, generator=gen).to(dtype)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    mask[1] = -1  # a row that allows everything
    mask[2, 0] = 0  # ... and one with a fully blocked word
    got, want = logits.clone(), logits.clone()
    constrained.apply_bitmask_cpu(got, mask)
    constrained.apply_bitmask_torch(want, mask)
    assert torch.equal(got, want)
    assert not torch.isinf(got[1]).any() and torch.isinf(got[2, :32]).all()
    covered = min(width, mask.shape[1] * 32)
    assert torch.equal(got[:, covered:], logits[:, covered:])  # past the mask: untouched
    assert 0.3 < torch.isinf(got[0, :covered]).float().mean() < 0.7


def test_bitmask_is_pageable_without_an_accelerator(constrained):
    def pinned(vocab_size, batch_size):
        raise AssertionError("pinned allocation attempted")

    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: the pinned allocation is the right one")
    mask = constrained.allocate_token_bitmask(pinned, 49152, 4)
    assert mask.shape == (4, 1536) and mask.dtype == torch.int32 and (mask == -1).all()


def test_constraint_check():
    eos, stop, length = {"type": "stop", "matched": 2}, {"type": "stop", "matched": "\n"}, {"type": "length"}
    assert constraint_violation(r"[0-9]+", "24", eos) is None
    assert constraint_violation(r"[0-9]+", "24a", eos)
    assert constraint_violation(r"\"[a-z]*\"", '"abc', eos)  # EOS: must be a whole match
    assert constraint_violation(r"\"[a-z]*\"", '"abc', length) is None  # cut off: a prefix is enough
    assert constraint_violation(r"\"[a-z]*\"", '"ab1', stop)


def test_server_check_needs_an_answer():
    from sglang_wgkv.server_process import free_port

    assert not server_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=5)


@pytest.fixture(scope="module")
def xgrammar_backend():
    """SGLang's own xgrammar backend over the embedded model's tokenizer (no server)."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoConfig, AutoTokenizer

    from sglang_wgkv.embedded_model import ensure_embedded_model

    path = ensure_embedded_model()
    vocab = AutoConfig.from_pretrained(path).vocab_size
    backend = XGrammarGrammarBackend(AutoTokenizer.from_pretrained(path), vocab_size=vocab)
    return backend, vocab


@pytest.fixture
def hooked_xgrammar(monkeypatch, constrained):
    """The two xgrammar hooks applied in this process, as the plugin's HookRegistry entries apply them
    in a scheduler (undone after the test)."""
    from sglang.srt.constrained import xgrammar_backend as xgb

    allocate, apply = xgb._allocate_token_bitmask, xgb.XGrammarGrammar.apply_vocab_mask
    monkeypatch.setattr(
        xgb, "_allocate_token_bitmask", lambda *a: constrained.allocate_token_bitmask(allocate, *a)
    )
    monkeypatch.setattr(
        xgb.XGrammarGrammar,
        "apply_vocab_mask",
        lambda g, logits, vocab_mask: constrained.apply_grammar_mask(apply, g, logits, vocab_mask),
    )


def test_upstream_mask_path_fails_on_cpu(xgrammar_backend, constrained):
    """Without the hooks SGLang's xgrammar backend cannot mask CPU logits (the issue's crash)."""
    backend, vocab = xgrammar_backend
    error = constrained.probe_mask_path(backend, vocab, torch.device("cpu"))
    assert error is not None and ("NVIDIA driver" in error or "Unsupported device" in error), error


def test_probe_passes_on_cpu_and_rejects_a_device_that_cannot_mask(
    xgrammar_backend, hooked_xgrammar, constrained
):
    """The hooked ``create_grammar_backend`` keeps SGLang's backend where the hooked mask path works (CPU)
    and swaps in the rejecting backend where it does not (``meta``: upstream's apply knows no such
    device), with a reason (sent with the 400) that names the device and the cause."""
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    backend, vocab = xgrammar_backend
    args = SimpleNamespace(device="cpu", grammar_backend="xgrammar")
    assert constrained.create_grammar_backend(lambda *a: backend, args, None, vocab) is backend

    args = SimpleNamespace(device="meta", grammar_backend="xgrammar")
    unservable = constrained.create_grammar_backend(lambda *a: backend, args, None, vocab)
    assert isinstance(unservable, constrained.UnservableGrammarBackend)
    assert "device meta" in unservable.reason and "Unsupported device" in unservable.reason, unservable.reason
    grammar, cached = unservable.get_cached_or_future_value(("regex", "[0-9]+"), False)
    grammar = grammar.result()
    assert isinstance(grammar, InvalidGrammarObject) and grammar.error_message == unservable.reason


def test_probe_reports_a_mask_that_blocks_nothing(constrained):
    class Grammar:
        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)

        def fill_vocab_mask(self, mask, idx):
            pass

        def move_vocab_mask(self, mask, device):
            return mask

        def apply_vocab_mask(self, logits, vocab_mask):
            constrained.apply_bitmask_torch(logits, vocab_mask)

    backend = SimpleNamespace(get_cached_or_future_value=lambda key, reasoning: (Grammar(), True))
    assert "blocked 0 of 64" in constrained.probe_mask_path(backend, 64, torch.device("cpu"))


def test_frontend_programs_on_the_cpu_server(server):
    results = run_programs(server.url, MAX_NEW_TOKENS)
    assert list(results) == [name for name, _, _ in PROGRAMS]
    errors = {name: r for name, r in results.items() if r["outcome"] == "error"}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    constrained_outputs = {name: r["constrained_outputs"] for name, r in results.items()}
    for name in ("decode_int", "decode_json_regex", "decode_json", "regex", "dtype_gen"):
        assert constrained_outputs[name] > 0, constrained_outputs
    assert server.alive()


def test_json_schema_ebnf_and_a_bad_grammar(server):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    out = server.generate(
        "Describe a person as JSON:", max_new_tokens=48, sampling_params={"json_schema": json.dumps(schema)}
    )
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        obj = json.loads(out["text"])
        assert isinstance(obj["name"], str) and isinstance(obj["age"], int)
    else:  # cut off: still the schema's first property (xgrammar keeps the schema's order)
        assert re.match(r'\{\s*"name"\s*:\s*"', out["text"]), out["text"]
    out = server.generate(
        "Is the sky blue?", max_new_tokens=8, sampling_params={"ebnf": 'root ::= "yes" | "no"'}
    )
    assert out["text"] in ("yes", "no")
    bad = requests.post(
        server.url + "/generate",
        timeout=120,
        json={"text": "x", "sampling_params": {"max_new_tokens": 4, "regex": "("}},
    )
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]
    assert server.generate("The capital of France is", max_new_tokens=4)["text"]
    assert server.alive()
