"""Launch shape, workspace and split count of the folded decode (:func:`~sglang_wgkv.attention.triton_decode.folded_decode`).

Host-only: the kernels are in :mod:`~sglang_wgkv.attention.triton_decode_split` and
:mod:`~sglang_wgkv.attention.triton_decode_merge`.
"""

from dataclasses import dataclass

import torch

from sglang_wgkv.config import PAGE_SIZE

MAX_SPLIT_COUNT = 128


# The split kernel's shape over FP8 pages: fields that differ from DecodeConfig's defaults (see there).
FP8_SHAPE = {"block_n": 32}


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split kernel: tokens per step (a multiple of 16), warps, pipeline stages;
    whether the split kernel merges the splits itself (one launch) or a merge kernel follows;
    ``pdl``: programmatic dependent launch (sm90+, CUDA only): the split kernel may be launched while
    the kernel before it drains and waits for it (``griddepcontrol.wait``) before its first load, so
    the launch gap overlaps the previous kernel's tail (measured by ``benchmarks/decode_fixed_cost.py``);
    ``programs_per_sm``: the split count's target (:func:`choose_num_splits`); and ``maxnreg``: a cap on
    the registers per thread (0: the compiler's choice; CUDA only). On sm_90 the default shape takes 120
    registers and 38 KiB of shared memory (four programs of 4 warps per SM by registers, six by shared
    memory; ``benchmarks/sm90_registers.py``, ptxas on CPU at the launch's specialization), and its K/V
    gathers are ``cp.async`` copies. No other shape beat it at the served W1 length
    (``benchmarks/results/kernels/decode_launch_configs.json``).

    FP8 pages start from :data:`FP8_SHAPE` instead (:meth:`for_pages`): converting the FP8 tiles to the
    dots' fp16 takes the default shape to 168 registers, so three of the four programs per SM that the
    split count plans for fit, and the fourth runs in a second wave; at 32 tokens a step it takes 128,
    without spills (``tests/test_sm90_compile.py`` checks the served shapes fit their programs).

    The served path uses these unless ``--wgkv-decode-launch`` (:meth:`parse`) says otherwise: a switch
    for measuring launch shapes in service (issue 15), not a tuning knob for users."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fused_merge: bool = True
    pdl: bool = False
    programs_per_sm: int = 4
    maxnreg: int = 0

    def __post_init__(self):
        if self.block_n < PAGE_SIZE or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= {PAGE_SIZE}, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 8:
            raise ValueError(
                f"num_warps must be 1, 2, 4, 8 or 16 and num_stages 1-8, got {self.num_warps}, "
                f"{self.num_stages}"
            )
        if not 1 <= self.programs_per_sm <= 64:
            raise ValueError(f"programs_per_sm must be 1-64, got {self.programs_per_sm}")
        if self.maxnreg and not (24 <= self.maxnreg <= 255 and self.maxnreg % 8 == 0):
            raise ValueError(
                f"maxnreg must be 0 (the compiler's choice) or a multiple of 8 in 24-255, got {self.maxnreg}"
            )

    def launch_options(self, device_type: str) -> dict:
        """The split kernel's launch options on ``device_type``: warps and stages; on CUDA also PDL and
        the register cap where asked (the interpreter has neither)."""
        cuda = device_type == "cuda"
        return {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **({"launch_pdl": True} if cuda and self.pdl else {}),
            **({"maxnreg": self.maxnreg} if cuda and self.maxnreg else {}),
        }

    @classmethod
    def for_pages(cls, dtype, spec: str = "") -> "DecodeConfig":
        """The served shape for K/V pages of ``dtype`` (:data:`FP8_SHAPE` for FP8 ones), with ``spec``'s
        fields (:meth:`parse`) over it."""
        from sglang_wgkv.memory.kv_quant import is_fp8

        return cls.parse(spec, FP8_SHAPE if is_fp8(dtype) else {})

    @classmethod
    def parse(cls, spec: str, base: dict | None = None) -> "DecodeConfig":
        """``"block_n=32,pdl=1"`` -> DecodeConfig (unnamed fields keep ``base``'s values or the defaults;
        ``""``: all). ValueError naming the field on an unknown name or a bad value."""
        kwargs: dict = dict(base or {})
        ints, flags = (
            ("block_n", "num_warps", "num_stages", "programs_per_sm", "maxnreg"),
            ("fused_merge", "pdl"),
        )
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, eq, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not eq or name not in ints + flags:
                raise ValueError(
                    f"decode launch {item!r}: expected NAME=VALUE with NAME one of {', '.join(ints + flags)}"
                )
            if name in ints:
                if not value.isdigit():
                    raise ValueError(f"decode launch {name} must be a positive integer, got {value!r}")
                kwargs[name] = int(value)
            elif value in ("0", "1", "false", "true"):
                kwargs[name] = value in ("1", "true")
            else:
                raise ValueError(f"decode launch {name} must be 0/1 or false/true, got {value!r}")
        return cls(**kwargs)


class FoldedDecodeWorkspace:
    """Partial outputs ``[max_batch, Hq, max_splits, D]``, log2-sum-exps ``[max_batch, Hq, max_splits]``
    and, for the fused merge, ``splits_done`` ``[max_batch, num_kv_heads]`` int32: the splits of each
    stream that have stored their partials in the running launch, zero between launches (zeroed here
    once; the last split of each stream resets its counter).

    Allocated once; :func:`folded_decode` with this workspace allocates nothing, so it can be captured
    in a CUDA graph. Runs that share a workspace must not overlap (one stream).
    ``num_kv_heads`` defaults to ``num_q_heads``, which fits any GQA grouping of those heads.
    """

    def __init__(
        self,
        max_batch: int,
        num_q_heads: int,
        head_dim: int,
        max_splits: int,
        device,
        dtype: torch.dtype = torch.float32,
        *,
        num_kv_heads: int | None = None,
    ):
        if not 1 <= max_splits <= MAX_SPLIT_COUNT:
            raise ValueError(f"max_splits must be in [1, {MAX_SPLIT_COUNT}], got {max_splits}")
        num_kv_heads = num_q_heads if num_kv_heads is None else num_kv_heads
        if not 1 <= num_kv_heads <= num_q_heads or num_q_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_q_heads {num_q_heads}, got {num_kv_heads}")
        self.max_batch, self.num_q_heads, self.head_dim, self.max_splits = (
            max_batch,
            num_q_heads,
            head_dim,
            max_splits,
        )
        self.num_kv_heads = num_kv_heads
        self.part_out = torch.empty(max_batch, num_q_heads, max_splits, head_dim, dtype=dtype, device=device)
        self.part_lse = torch.empty(max_batch, num_q_heads, max_splits, dtype=torch.float32, device=device)
        self.splits_done = torch.zeros(max_batch, num_kv_heads, dtype=torch.int32, device=device)


def choose_num_splits(
    batch: int, num_kv_heads: int, max_kv_len: int, device=None, programs_per_sm: int = 4
) -> int:
    """Splits per (request, KV head): about ``programs_per_sm`` programs per SM, chunks of at least
    256 tokens.

    Host-only; keep it fixed for a captured batch size (``max_kv_len`` = the context limit then).
    """
    sms = 132
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    streams = max(1, batch * num_kv_heads)
    want = -(-programs_per_sm * sms // streams)
    return int(max(1, min(want, -(-max_kv_len // 256), MAX_SPLIT_COUNT)))
