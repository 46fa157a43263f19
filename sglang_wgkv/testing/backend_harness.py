"""The ``wgkv`` attention backend without SGLang's model runner: a backend over a given pool and gates,
and the forward batches SGLang would hand it, for CPU checks of its forwards (the kernels path under
``TRITON_INTERPRET=1``) and for counting what a forward launches (:mod:`.op_count`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_wgkv.attention.decode_config import DecodeConfig
from sglang_wgkv.gate.admission import DeferredGateCheck
from sglang_wgkv.integration.backend.attn_backend import WGKVAttnBackend
from sglang_wgkv.memory import DualCachePool
from sglang_wgkv.memory.extend_writes import ExtendWrites


class Mode:
    """SGLang's ``ForwardMode`` as the backend reads it: ``decode``, ``extend`` or ``mixed``."""

    def __init__(self, kind: str):
        self.kind = kind

    def is_idle(self):
        return False

    def is_decode(self):
        return self.kind == "decode"

    def is_extend(self):
        return self.kind in ("extend", "mixed")

    def is_mixed(self):
        return self.kind == "mixed"


class Capture:
    """The pre-RoPE key capture, with the key itself standing in for it."""

    def take(self, k):
        return k


def layer_of(i: int, hq: int, h: int, d: int) -> SimpleNamespace:
    """A ``RadixAttention`` layer as the backend reads it."""
    return SimpleNamespace(
        layer_id=i,
        tp_q_head_num=hq,
        tp_k_head_num=h,
        qk_head_dim=d,
        v_head_dim=d,
        scaling=d**-0.5,
        sliding_window_size=None,
    )


def bare_backend(
    pool: DualCachePool,
    gates,
    *,
    use_kernels: bool,
    slot_tau: torch.Tensor,
    num_q_heads: int,
    evictor=None,
    tensor_core_gate: bool = False,
    decode_launch: str = "",
    prefill=None,
    deferred_gate_check: bool = False,
) -> WGKVAttnBackend:
    """A backend as ``WGKVAttnBackend.__init__`` would build it over ``pool``, with ``gates`` served
    (the decode gate's launch on the kernels path, and the prefill gate's when ``tensor_core_gate``),
    per-slot thresholds ``slot_tau``, the evictor given, no FA3 and no side stream; ``prefill``: the
    extend attention (default: the torch reference; the served kernels path passes the Triton one);
    ``deferred_gate_check``: the prefill gate's values checked once a forward, as on CUDA (else at
    once, a sync a layer, as on the CPU)."""
    from sglang_wgkv.attention import reference
    from sglang_wgkv.gate.triton_gate import DecodeGate
    from sglang_wgkv.gate.triton_prefill_gate import PrefillGate

    b = object.__new__(WGKVAttnBackend)
    decode_gate = DecodeGate(gates, max_rows=8 * pool.num_kv_heads) if use_kernels else None
    b.__dict__.update(
        dual=pool,
        config=pool.config,
        device=pool.device,
        use_kernels=use_kernels,
        generator=None,
        capture=Capture(),
        gates=gates,
        req_pool=SimpleNamespace(slot_tau=slot_tau),
        num_q_heads=num_q_heads,
        decode_gate=decode_gate,
        prefill_gate=PrefillGate(gates, decode_gate.layers) if tensor_core_gate else None,
        _sms=4,
        evictor=evictor,
        _extend=None,
        _rows=None,
        _row_tau=None,
        _row_uniform=None,
        _all_kept=None,
        _mixed_split=None,
        _q_pos=None,
        batch_slots=None,
        batch_prompt_ends=None,
        batch_decode_rows=0,
        _graph=None,
        _graph_launch={},
        _gate_stream=None,
        _indptrs=None,
        _gate_check=DeferredGateCheck(pool.num_layers, pool.device, deferred=deferred_gate_check or None),
        _writes=ExtendWrites(pool),
        _tensor_core_gate_rows=1,
        decode_launch=DecodeConfig.parse(decode_launch) if use_kernels else None,
        _prefill=prefill or reference.vertical_slash_attention,
        _fa3=None,
        _fa3_min_keys=0,
        _fa3_dense=None,
        _dense=None,
        _band_fn=None,
        _band=None,
        _longest_keys=None,
        _warned_slot_readback=False,
    )
    return b


def extend_batch(kind: str, slots, prefix, extend, positions: torch.Tensor) -> SimpleNamespace:
    """An extend (or mixed) ``ForwardBatch``: request ``slots`` with their cached ``prefix`` and
    ``extend`` lengths, the packed rows' ``positions``."""
    seq = [p + n for p, n in zip(prefix, extend)]
    return SimpleNamespace(
        forward_mode=Mode(kind),
        batch_size=len(slots),
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        extend_prefix_lens_cpu=list(prefix),
        extend_seq_lens_cpu=list(extend),
        extend_seq_lens=torch.tensor(extend),
        positions=positions,
        wgkv_req_slots=list(slots),
    )


def decode_batch(slots, seq_lens) -> SimpleNamespace:
    """A decode ``ForwardBatch``: ``seq_lens`` include the token being decoded."""
    seq = torch.tensor(seq_lens)
    return SimpleNamespace(
        forward_mode=Mode("decode"),
        batch_size=len(slots),
        req_pool_indices=torch.tensor(slots),
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),  # a tensor of its own, as SGLang's host copy
        wgkv_req_slots=list(slots),
    )


def run_extend(backend: WGKVAttnBackend, layers, slots, prefix, lens, rows, kind: str = "extend") -> None:
    """One extend forward of requests ``slots`` (already allocated in the pool) through every layer
    of ``layers``: ``prefix`` cached and ``lens`` new tokens each; ``rows(n)`` gives a layer's packed
    ``q, k, v`` (``[n, heads * D]`` each)."""
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)])
    fb = extend_batch(kind, slots, prefix, lens, positions)
    backend.batch_slots = list(slots)
    backend.init_forward_metadata(fb)
    for layer in layers:
        backend.forward_extend(*rows(positions.numel()), layer, fb)


def run_decode(backend: WGKVAttnBackend, layers, slots, seq_lens, rows) -> list[torch.Tensor]:
    """One decode step of requests ``slots`` through every layer (``seq_lens`` include the token
    decoded); each layer's outputs."""
    fb = decode_batch(slots, seq_lens)
    backend.init_forward_metadata(fb)
    return [backend.forward_decode(*rows(len(slots)), layer, fb) for layer in layers]


def batch_tensors(forward_batch) -> tuple[list, list]:
    """``(device tensors, host tensors)`` of a batch built here, as SGLang places them (its ``*_cpu``
    fields on the host): what ``testing.op_count.counting_ops`` needs to tell a host read's cost."""
    fields = [(k, v) for k, v in vars(forward_batch).items() if isinstance(v, torch.Tensor)]
    return [v for k, v in fields if not k.endswith("_cpu")], [v for k, v in fields if k.endswith("_cpu")]
