"""The bounded capacity plan's rule for a prompt being prefilled: what it may hold and where that room
comes from (:mod:`~sglang_wgkv.integration.capacity`, :mod:`~sglang_wgkv.integration.prefill_guard`)."""

from dataclasses import dataclass

from sglang_wgkv.config import PAGE_SIZE


@dataclass(frozen=True)
class PromptRule:
    """What a prompt may hold while it is prefilled in bounded mode and where that room comes from
    (:mod:`~sglang_wgkv.integration.capacity`'s docstring), in tokens per stream.

    local_window : W_local.
    slot_tokens : ``S``, the pages one request slot holds between steps (ring + budget + 2 pages).
    cap : ``prompt_cap``, the global entries a stream keeps until its prompt ends (budget + ``P``).
    chunk_tokens : ``C``, SGLang's ``chunked_prefill_size`` (new tokens of one extend at most).
    requests : ``R``, the request slots.
    spare_tokens : the dual pool's pages beyond ``R x S``.
    """

    local_window: int
    slot_tokens: int
    cap: int
    chunk_tokens: int
    requests: int
    spare_tokens: int

    def excess_tokens(self, prompt_len: int) -> int:
        """Tokens per stream beyond ``slot_tokens`` that a prompt of ``prompt_len`` tokens (prefix
        included) may hold while it is prefilled: at a boundary, or within an extend of up to
        ``chunk_tokens`` new tokens with what its step reserves. A chunk starts from at most ``cap``
        global entries and adds at most its own tokens, so the global part stays within
        ``min(prompt_len - W_local, cap + C)``; on top of the ring and those pages, one page for the
        two partial pages (the chunk's and the cache's) and the two that ``begin_extend`` reserves
        (:meth:`~sglang_wgkv.memory.DualCachePool.extend_bound`)."""
        held_global = min(max(0, prompt_len - self.local_window), self.cap + self.chunk_tokens)
        held = self.local_window + PAGE_SIZE * (-(-held_global // PAGE_SIZE) + 3)
        return max(0, held - self.slot_tokens)

    def room(self, holding: int) -> int:
        """Tokens per stream of the pages no request slot's bound covers while ``holding`` requests
        (running, and in the prefill batch) hold a slot: the other slots' and the spare pages."""
        return (self.requests - holding) * self.slot_tokens + self.spare_tokens
