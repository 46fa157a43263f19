"""Constrained decoding (regex, JSON schema, EBNF, ``gen_int`` / ``gen(dtype=...)``) on every device we serve.

SGLang 0.5.17's xgrammar backend cannot mask logits on a CPU: it allocates the token bitmask pinned
(``pin_memory=True`` needs a CUDA driver: "Found no NVIDIA driver on your system") and its
``apply_vocab_mask`` knows accelerators only (``Unsupported device: cpu``). Both raise inside the
scheduler's batch step, so the first constrained request takes the whole server down. xgrammar itself
ships a CPU kernel for the mask (``apply_token_bitmask_inplace``, C++); these hooks route CPU logits to
it. Inert on CUDA, so they apply with and without ``--attention-backend wgkv`` (the ``--disable-wgkv``
baseline gets the same fix).

Whatever the grammar backend and device, a backend that cannot mask there must not crash the
scheduler: :func:`create_grammar_backend` runs the whole mask path once at start-up (compile a
one-digit regex, allocate, fill, move, apply to a dummy logits row); if that fails, the scheduler
gets a :class:`UnservableGrammarBackend`, which fails each constrained request the way SGLang fails a
bad grammar: the request is aborted with a 400 that names the device and the cause, the server stays up.

==========================================================================  ======  ===================================
target (sglang.srt.constrained. ...)                                        type    effect
==========================================================================  ======  ===================================
xgrammar_backend._allocate_token_bitmask                                    AROUND  pageable bitmask without accelerator
xgrammar_backend.XGrammarGrammar.apply_vocab_mask                           AROUND  CPU logits: xgrammar's CPU kernel
xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask (static)           AROUND  CPU logits: xgrammar's CPU kernel
base_grammar_backend.create_grammar_backend                                 AROUND  probe; unservable -> 400 per request
==========================================================================  ======  ===================================
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammarObject

logger = logging.getLogger(__name__)

XGRAMMAR = "sglang.srt.constrained.xgrammar_backend"
# Any grammar with a few allowed first tokens: the probe checks the mask allows some, not all.
PROBE_REGEX = "[0-9]"


def allocate_token_bitmask(original, vocab_size: int, batch_size: int) -> torch.Tensor:
    """AROUND ``_allocate_token_bitmask``: pinned (for a non-blocking host-to-device copy) only where an
    accelerator exists; pinning without one raises. Returns int32 ``[batch_size, ceil(vocab_size / 32)]``,
    all bits set (every token allowed)."""
    if torch.accelerator.is_available():
        return original(vocab_size, batch_size)
    from xgrammar import bitmask_dtype, get_bitmask_shape

    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype)


def apply_bitmask_cpu(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """Set ``logits[i, j] = -inf`` where bit ``j`` of row ``i`` of ``vocab_mask`` is 0, in place.

    logits: ``[batch, vocab]`` float32/bf16/fp16 on the CPU; vocab_mask: int32 ``[batch, ceil(vocab / 32)]``
    on the CPU (bit ``j % 32`` of word ``j // 32``). Columns past ``32 * vocab_mask.shape[1]`` are kept.
    Torch reference: :func:`apply_bitmask_torch`.
    """
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device), backend="cpu")


def apply_bitmask_torch(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """Torch reference of :func:`apply_bitmask_cpu` (same signature, same result)."""
    width = min(logits.shape[-1], vocab_mask.shape[-1] * 32)
    bits = torch.arange(32, dtype=torch.int32, device=vocab_mask.device)
    allowed = ((vocab_mask.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., :width].bool()
    logits[..., :width].masked_fill_(~allowed.to(logits.device), float("-inf"))


def apply_grammar_mask(original, grammar, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """AROUND ``XGrammarGrammar.apply_vocab_mask``: CPU logits through :func:`apply_bitmask_cpu`."""
    if logits.device.type != "cpu":
        return original(grammar, logits, vocab_mask)
    apply_bitmask_cpu(logits, vocab_mask)
    return None


def apply_backend_mask(original, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """AROUND the static ``XGrammarGrammarBackend.apply_vocab_mask``: as :func:`apply_grammar_mask`."""
    if logits.device.type != "cpu":
        return original(logits, vocab_mask)
    apply_bitmask_cpu(logits, vocab_mask)
    return None


def probe_mask_path(backend, vocab_size: int, device) -> str | None:
    """Run ``backend``'s whole mask path once on ``device``; the failure as a sentence, or None if it
    masks (some, not all, of a ``vocab_size`` logits row)."""
    try:
        grammar, _ = backend.get_cached_or_future_value(("regex", PROBE_REGEX), False)
        grammar = grammar.result() if hasattr(grammar, "result") else grammar
        if isinstance(grammar, InvalidGrammarObject):
            return f"the probe regex {PROBE_REGEX!r} does not compile: {grammar.error_message}"
        mask = grammar.allocate_vocab_mask(vocab_size=vocab_size, batch_size=1, device=device)
        grammar.fill_vocab_mask(mask, 0)
        mask = grammar.move_vocab_mask(mask, device)
        logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        grammar.apply_vocab_mask(logits=logits, vocab_mask=mask)
        masked = int(torch.isinf(logits).sum())
    except Exception as e:  # any failure here would otherwise happen inside a batch step
        return f"{type(e).__name__}: {e}"
    if not 0 < masked < vocab_size:
        return f"the mask of regex {PROBE_REGEX!r} blocked {masked} of {vocab_size} tokens"
    return None


def create_grammar_backend(original, server_args, tokenizer, vocab_size, *args, **kwargs):
    """AROUND ``create_grammar_backend`` (scheduler start-up): SGLang's backend if its mask path works on
    ``--device``, else an :class:`UnservableGrammarBackend` carrying the reason."""
    backend = original(server_args, tokenizer, vocab_size, *args, **kwargs)
    if backend is None:  # --grammar-backend none: SGLang rejects constrained requests itself
        return None
    device = torch.device(server_args.device)
    error = probe_mask_path(backend, vocab_size, device)
    if error is None:
        return backend
    reason = (
        f"constrained decoding is not available on device {device.type} with --grammar-backend "
        f"{server_args.grammar_backend} ({error})"
    )
    logger.error("%s; constrained requests will be rejected with 400", reason)
    return UnservableGrammarBackend(reason)


class UnservableGrammarBackend(BaseGrammarBackend):
    """A grammar backend whose every grammar is invalid, with the reason: SGLang's grammar manager then
    aborts each constrained request with a 400 ``Failed to compile <kind> grammar: <reason>`` before it
    reaches a batch."""

    def __init__(self, reason: str):
        super().__init__()
        self.reason = reason

    def _init_value_dispatch(self, key, require_reasoning):
        return InvalidGrammarObject(self.reason)


HOOKS = (
    (f"{XGRAMMAR}._allocate_token_bitmask", allocate_token_bitmask),
    (f"{XGRAMMAR}.XGrammarGrammar.apply_vocab_mask", apply_grammar_mask),
    (f"{XGRAMMAR}.XGrammarGrammarBackend.apply_vocab_mask", apply_backend_mask),
    ("sglang.srt.constrained.base_grammar_backend.create_grammar_backend", create_grammar_backend),
)


def register() -> None:
    """Register the hooks above (AROUND) with SGLang's HookRegistry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn in HOOKS:
        HookRegistry.register(target, fn, HookType.AROUND)
