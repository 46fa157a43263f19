"""Runtime configuration of WG-KV admission, validated on construction."""

from dataclasses import dataclass

PAGE_SIZE = 16
FAR_POSITION = -(2**30)  # position given to global entries: beyond every query's local band
# The one definition of each default (the gate checkpoint format, the trainer and the launcher read these).
DEFAULT_TAU = 0.1
DEFAULT_LOCAL_WINDOW = 256
# The decode-time observation window (queries kept per request and layer; paper App. K.1); at most W_local.
DEFAULT_EVICTOR_WINDOW = 256
# The prompt-end compression scores with the prompt's last 32 queries (SnapKV's observation window),
# max-pooled over 13 positions: scored by the last 256, the question's few queries drown among the
# haystack's, and SnapKV's kernel 7 cuts digits off multi-digit needles (one token per digit); 32 and 13
# answer as the full cache does (benchmarks/results/accuracy/prompt_window.json).
DEFAULT_PROMPT_WINDOW = 32
DEFAULT_PROMPT_KERNEL = 13
# Serving's evictor cuts streams this far under the budget when it looks (at most 1/8 of the budget), so
# it looks at the device about once per this many decode steps instead of nearly every step.
DEFAULT_EVICTOR_LEAD = 32


@dataclass(frozen=True)
class WGKVConfig:
    """Admission parameters shared by the pool, the attention paths and the server.

    Parameters
    ----------
    local_window : W_local, ring slots per (request, layer, KV head); a multiple of ``PAGE_SIZE``.
    tau : admission threshold; a token leaving the ring is promoted when ``g >= tau``.
    random_admission : if set, admit each (token, head) with this probability instead of ``g >= tau``
        (the paper's profiling protocol; the gate is still evaluated).
    kv_budget : average global tokens per head per request enforced by the evictor (None = unbounded).
    """

    local_window: int = DEFAULT_LOCAL_WINDOW
    tau: float = DEFAULT_TAU
    random_admission: float | None = None
    kv_budget: int | None = None
    page_size: int = PAGE_SIZE

    def __post_init__(self):
        if self.page_size != PAGE_SIZE:
            raise ValueError(f"page_size must be {PAGE_SIZE}, got {self.page_size}")
        if self.local_window <= 0 or self.local_window % self.page_size:
            raise ValueError(
                f"local_window must be a positive multiple of {self.page_size}, got {self.local_window}"
            )
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")
        if self.random_admission is not None and not 0.0 <= self.random_admission <= 1.0:
            raise ValueError(f"random_admission must be in [0, 1], got {self.random_admission}")
        if self.kv_budget is not None and self.kv_budget < self.page_size:
            raise ValueError(f"kv_budget must be >= {self.page_size} tokens, got {self.kv_budget}")

    @property
    def evictor_window(self) -> int:
        """Queries per (request, layer) the evictor keeps with ``kv_budget``: its window, capped at
        W_local (global entries must precede every window query)."""
        return min(DEFAULT_EVICTOR_WINDOW, self.local_window)

    @property
    def long_request_window(self) -> int:
        """Queries per (request, layer) the evictor keeps without ``kv_budget``, for the requests it
        bounds alone (their own ``kv_budget``, or longer than the pool): the prompt-end scoring's
        window (the decode-time bottom-ratio rule then scores by the same few queries)."""
        return min(DEFAULT_PROMPT_WINDOW, self.local_window)

    @property
    def evictor_lead(self) -> int:
        """The evictor's ``lead`` with ``kv_budget`` (see memory/evictor.py, host syncs)."""
        return 0 if self.kv_budget is None else min(DEFAULT_EVICTOR_LEAD, self.kv_budget // 8)
