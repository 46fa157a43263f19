"""One layer of a decode step in the ``wgkv`` backend: the torch reference (gate, ring write, paged
attention) or the kernels (the folded split-KV decode with its fused ring write, and beside it, on a
side stream, gate + admission and the flags' write); the step's rows every layer reads
(:class:`DecodeRows`) and the request slot that pads CUDA-graph batches (:data:`SCRATCH_SLOT`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_wgkv.attention import reference

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention


# SGLang's request row 0 pads CUDA-graph batches and is never allocated to a request.
SCRATCH_SLOT = 0
# KV tokens (KV heads x cached tokens of the step's rows) up to which the torch decode layer runs on
# one CPU thread: its ops are then small, and under OpenMP's passive wait (the CPU launcher's default)
# each op that goes parallel pays a thread wake-up several times its own cost
# (benchmarks/results/serving/cpu_decode_threads.json).
CPU_ONE_THREAD_KV_TOKENS = 8192


def cpu_threads(kv_tokens: int) -> int | None:
    """The torch decode layer's threads for a step reading ``kv_tokens`` (None: torch's own)."""
    return 1 if kv_tokens <= CPU_ONE_THREAD_KV_TOKENS else None


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Torch's CPU ops on ``n`` threads inside (None: unchanged)."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class DecodeRows:
    """One decode step's rows, read by every layer (views of static buffers under CUDA graphs).

    req, pos : ``[B]`` int64 request slot and position of the token being decoded;
    ring : ``[B]`` int64 ring tokens after this step's write (``min(pos + 1, W)``);
    tau : ``[B, 1]`` float32 admission threshold; uniform : ``[B, L, H]`` random-admission draws or None;
    num_splits, workspace : :func:`folded_decode` launch parameters (kernels path);
    gate_splits : slices of the gate's hidden width per (row, head) (:class:`DecodeGate`, kernels path);
    threads : CPU threads of the torch layer (None: torch's own; :data:`CPU_ONE_THREAD_KV_TOKENS`).
    """

    req: torch.Tensor
    pos: torch.Tensor
    ring: torch.Tensor
    tau: torch.Tensor
    uniform: torch.Tensor | None
    num_splits: int | None = None
    workspace: object = None
    gate_splits: int = 1
    threads: int | None = None


class DecodeLayer:
    """Per-layer decode of :class:`~sglang_wgkv.integration.backend.attn_backend.WGKVAttnBackend` (a mixin: the
    backend owns the pool ``dual``, the step's rows ``_rows``, the gates, the evictor and ``_admit``)."""

    def _decode_rows(self, q3, k3, v3, k_pre, layer: RadixAttention, out=None) -> torch.Tensor:
        """q3 ``[B, Hq, D]``, k3, v3, k_pre ``[B, H, D]``: the decode step's rows (:attr:`_rows`) in
        ``layer``; returns ``[B, Hq, Dv]`` (the pool's dtype on the kernels path), or writes them into
        ``out`` (contiguous in Dv, any dtype) and returns it."""
        H = k3.shape[1]
        rows = self._rows
        if not self.use_kernels:
            with torch_threads(rows.threads):
                admit = self._admit(layer, k_pre, k3, rows.tau, check=False, uniform=rows.uniform)
                if self.evictor is not None:
                    self.evictor.observe_decode(layer.layer_id, q3)
                self.dual.write_decode(layer.layer_id, k3, v3, admit)
                pages, num_pages, last_len, _ = self.dual.decode_page_rows(layer.layer_id)
                res = reference.page_table_decode_attention(
                    q3,
                    self.dual.k_pages,
                    self.dual.v_pages,
                    pages,
                    num_pages,
                    last_len,
                    sm_scale=layer.scaling,
                    k_scale=self.dual.k_scale[layer.layer_id],
                    v_scale=self.dual.v_scale[layer.layer_id],
                )
                return res if out is None else out.copy_(res)
        from sglang_wgkv.attention.triton_decode import folded_decode

        observe = None
        if self.evictor is not None:  # the split kernel records the queries (and, in layer 0, positions)
            obs_q, obs_pos, obs_row = self.evictor.decode_window(layer.layer_id)
            observe = (obs_q, obs_pos if layer.layer_id == 0 else None, obs_row)
        uniform = rows.uniform[:, layer.layer_id] if rows.uniform is not None else None
        if k3.stride(2) != 1:  # the fused ring write reads rows contiguous in head_dim
            k3 = k3.contiguous()
        if v3.stride(2) != 1:
            v3 = v3.contiguous()
        # The gate and the flags it decides run on a side stream, beside this layer's attention: the
        # attention reads the new token's key and value (and writes them into their ring slot: the
        # program that holds the slot reads them from k3 / v3) but not its flag, which only the next
        # step's promotion reads. The split kernel is launched first, the side stream forking from
        # the point before it, so that in a captured graph its programs are issued ahead of the
        # gate's (which take the SMs it leaves); the main stream joins the side stream after it, so
        # the graph forks and joins within the layer. (One stream where there is none: the Triton
        # interpreter on CPU.)
        side = self._gate_stream
        main = torch.cuda.current_stream(self.device) if side is not None else None
        fork = main.record_event() if side is not None else None
        q3 = q3.to(self.dual.compute_dtype)
        into = out if out is not None and out.dtype == q3.dtype else None  # else copied in below
        res = folded_decode(
            q3,
            self.dual.k_pages,
            self.dual.v_pages,
            self.dual.page_table,
            self.dual.global_len,
            rows.req,
            rows.ring,
            layer.layer_id,
            sm_scale=layer.scaling,
            num_splits=rows.num_splits,
            workspace=rows.workspace,
            out=into,
            config=self.decode_launch,
            new_k=k3,
            new_v=v3,
            pos=rows.pos,
            window=self.dual.window,
            observe=observe,
            k_scale=self.dual.k_scale[layer.layer_id],
            v_scale=self.dual.v_scale[layer.layer_id],
        )
        if side is not None:
            side.wait_event(fork)
        random_p = self.config.random_admission if uniform is not None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if (
                self.prefill_gate is not None and k3.shape[0] * H >= self._tensor_core_gate_rows
            ):  # tensor cores
                admit = self.prefill_gate.admit(layer.layer_id, k_pre, k3, rows.tau, uniform, random_p)
            else:
                admit = self.decode_gate(
                    layer.layer_id, k_pre, k3, rows.tau, uniform, random_p, rows.gate_splits
                )
            self.dual.write_decode_flags(layer.layer_id, rows.req, rows.pos, admit)
        if side is not None:
            main.wait_stream(side)
        return res if out is None or into is not None else out.copy_(res)
