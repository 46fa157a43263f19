"""The ``wgkv`` attention backend: write gate + dual-cache pool + WG-KV attention inside SGLang.

Per forward (``init_forward_metadata``, once for all layers):

* extend: :meth:`DualCachePool.begin_extend` with the batch's request slots, prefix and extend
  lengths (chunked prefill continues a slot; a new or retracted request starts at prefix 0);
* decode: :meth:`DualCachePool.begin_decode` (ring pages, lazy promotion of every layer's victim);
* mixed (``--enable-mixed-chunk``: prefill chunks, then the running requests as one-token extends):
  :meth:`DualCachePool.begin_mixed`, the prefill rows extending and the decode rows decoding
  (:mod:`~sglang_wgkv.memory.mixed_step` says why); each layer runs the extend path on the first rows
  and the decode path on the rest. SGLang captures no mixed batch (``ForwardMode.is_cuda_graph``),
  so their decode rows run eagerly;
* with ``--kv-budget``: first, :meth:`SnapKVEvictor.maybe_evict` (the step boundary), and every layer
  hands its queries to the evictor's observation window; an extend declares which of its requests
  finish their prompt (:meth:`SnapKVEvictor.mark_extend`: prompt-end scoring), from the host
  ``extend_range`` of each request that :func:`~sglang_wgkv.integration.backend.batch_slots.record_batch_slots` records on the backend.

The decode layer lives in :mod:`~sglang_wgkv.integration.backend.decode_layer`, the CUDA-graph hooks in
:mod:`~sglang_wgkv.integration.backend.decode_graphs`, the served gates in
:mod:`~sglang_wgkv.integration.backend.gates`.

Per layer (``forward_extend`` / ``forward_decode``): the gate scores the new keys from the captured
pre-RoPE key and the post-RoPE key, admission flags follow (``g >= tau`` or random), attention runs
over what the pool keeps (vertical-slash over cached context + new tokens in extend; ring + global
pages in decode), and the new K/V are written to the pool.

Attention implementations (``ServingSettings.attention``): the torch reference
(:mod:`sglang_wgkv.attention.reference`, any device; syncs per layer, no CUDA graphs) or, on CUDA,
the kernels: a prefill with no host sync per layer (the Triton prefill gate,
:func:`~sglang_wgkv.gate.triton_prefill_gate.checked_prefill_gate`, or the torch gate where its
start-up check fails; Triton vertical-slash attention over context gathered at host-known page
columns) and a decode of device work only: :func:`~sglang_wgkv.attention.triton_decode.folded_decode`
(split-KV over ring + global pages, one launch per layer, whose programs also write the new keys and
values into their ring slots), and beside it, on a side stream, gate + admission in one launch
(:class:`~sglang_wgkv.gate.triton_gate.DecodeGate`; from
:data:`~sglang_wgkv.gate.prefill_gate_launch.DECODE_MIN_ROWS` (row, KV head) pairs a step, the
prefill gate's tensor-core launch, :meth:`PrefillGate.admit`) and the flags' write.

"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_wgkv.attention import reference
from sglang_wgkv.config import FAR_POSITION
from sglang_wgkv.gate.admission import DeferredGateCheck
from sglang_wgkv.integration.backend.decode_graphs import DecodeGraphs
from sglang_wgkv.integration.backend.decode_layer import DecodeLayer, DecodeRows, cpu_threads
from sglang_wgkv.integration.backend.extend_indptrs import extend_indptrs
from sglang_wgkv.integration.backend.extend_layer import ExtendLayer
from sglang_wgkv.integration.backend.gates import PreRopeKeyCapture, build_gates
from sglang_wgkv.integration.backend.tracing import traced
from sglang_wgkv.integration.plugin.runtime import get_runtime
from sglang_wgkv.integration.plugin.settings import BACKEND_NAME
from sglang_wgkv.integration.pools.kv_dtype import model_kv_scales
from sglang_wgkv.integration.pools.kv_pool import WGKVTokenToKVPool
from sglang_wgkv.memory.extend_writes import ExtendWrites

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# logged once by a backend handed a batch without its host request slots (batch_slots.py)
LOG_SLOT_READBACK = (
    "wgkv: a forward batch came without its host request slots; reading them back (a host sync)"
)


class WGKVAttnBackend(DecodeGraphs, DecodeLayer, ExtendLayer, AttentionBackend):
    """SGLang attention backend ``wgkv`` (registered by :mod:`sglang_wgkv.integration.plugin.register`)."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, WGKVTokenToKVPool):
            raise ValueError(
                f"--attention-backend {BACKEND_NAME} needs its KV pool, got {type(pool).__name__}"
            )
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        runtime = get_runtime()
        self.dual = runtime.dual
        self.config = self.dual.config
        self.settings = runtime.settings
        self.device = self.dual.device
        self.kv_heads = runtime.kv_heads
        if self.dual.quantized:  # the checkpoint's per-layer scales, loaded with the model
            self.dual.set_kv_scales(*model_kv_scales(model_runner.model, self.dual.num_layers))
        self.gates = build_gates(
            self.settings,
            self.dual.num_layers,
            model_runner.model_config.get_total_num_kv_heads(),
            self.dual.head_dim,
            self.device,
            heads=self.kv_heads,
        )
        self.capture = PreRopeKeyCapture.install(model_runner.model)
        self.generator = None
        if self.config.random_admission is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(self.settings.seed)
        self._extend = None  # (slots, prefix_lens, extend_lens) of the current extend forward's prefill rows
        self._mixed_split = None  # a mixed forward: its packed prefill rows (then its decode rows)
        self._q_pos = None  # the current extend's prefill rows' positions, int32
        self._indptrs = None  # (qo_indptr [B + 1], kv_indptr [L, B + 1]) on the device, per extend forward
        self._gate_check = DeferredGateCheck(self.dual.num_layers, self.device)  # prefill gate values
        self._writes = ExtendWrites(self.dual)  # an extend forward's pool writes, layers grouped
        self.use_kernels = runtime.use_kernels  # the runtime's one torch/Triton choice
        self._prefill = reference.vertical_slash_attention
        self.decode_gate = None
        self.prefill_gate = None  # the Triton prefill gate; None: the torch gate (self.gates)
        self.decode_launch = None  # the split kernel's launch shape (kernels path)
        if self.use_kernels:
            from sglang_wgkv.attention.decode_config import DecodeConfig
            from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
            from sglang_wgkv.gate.prefill_gate_launch import DECODE_MIN_ROWS
            from sglang_wgkv.gate.triton_gate import DecodeGate
            from sglang_wgkv.gate.triton_prefill_gate import checked_prefill_gate

            self._prefill = vertical_slash_attention
            self.decode_launch = DecodeConfig.for_pages(self.dual.dtype, self.settings.decode_launch)
            self.decode_gate = DecodeGate(
                self.gates, max_rows=model_runner.req_to_token_pool.size * len(self.kv_heads)
            )
            self.prefill_gate = checked_prefill_gate(
                self.gates,
                self.decode_gate.layers,
                dtype=model_runner.model_config.dtype,
                random_p=self.config.random_admission,
            )
            # decode steps of at least this many (row, KV head) pairs take the prefill gate's launch
            self._tensor_core_gate_rows = DECODE_MIN_ROWS
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # forward_decode (kernels): the gate beside the attention, on CUDA
        self._gate_stream = (
            torch.cuda.Stream(self.device) if self.use_kernels and self.device.type == "cuda" else None
        )
        self.evictor = runtime.evictor
        self.req_pool = model_runner.req_to_token_pool  # per-slot tau (requests/control.py)
        self.num_q_heads = model_runner.model_config.get_num_attention_heads(par.attn_tp_size)
        self._fa3 = None  # the FA3 call of the prefill's vertical range (backend/prefill_vertical.py)
        self._fa3_dense = None  # the dense FA3 call of prefills whose keys are all admitted (fa3_dense.py)
        self._band_fn = None  # FA3's window call for prefills (backend/prefill_band.py)
        self._band = None  # the current extend's (call, qo, kv [L, B + 1] int32, most rows) when it runs
        self._dense = None  # the current extend's (qo, kv [L, B + 1] int32, longest rows) when it is dense
        self._fa3_min_keys = 0  # a forward's longest key range from which it is used
        self._longest_keys = None  # [L] the current extend's longest key range per layer (host)
        mode = self.settings.prefill_vertical
        if mode == "fa3" and not self.use_kernels:
            raise RuntimeError("--wgkv-prefill-vertical fa3 needs the kernels path (a CUDA device)")
        if self.use_kernels:
            from sglang_wgkv.integration.backend.prefill_vertical import FA3_MIN_KEYS, choose_fa3, warm_up

            shape = (self.num_q_heads, self.dual.num_kv_heads, self.dual.head_dim)
            warm_up(self.device, model_runner.model_config.dtype, shape)  # no compile in a request's prefill
            from sglang_wgkv.integration.backend.startup_compiles import compile_served_variants

            compile_served_variants(
                self.dual, model_runner.req_to_token_pool, model_runner.model_config.dtype
            )
            self._fa3 = choose_fa3(mode, self.device, model_runner.model_config.dtype, shape)
            self._fa3_min_keys = 0 if mode == "fa3" else FA3_MIN_KEYS
            from sglang_wgkv.integration.backend.prefill_vertical import choose_dense

            self._fa3_dense = choose_dense(self._fa3, self.device, model_runner.model_config.dtype, shape)
            from sglang_wgkv.integration.backend.prefill_band import choose_band

            self._band_fn = choose_band(
                self.settings.prefill_band, self.device, model_runner.model_config.dtype, shape
            )
        self._row_tau = None  # [tokens, 1] admission threshold of each extend row
        self._all_kept = None  # [tokens, H] all True: every extend row's request keeps every token
        self._row_uniform = None  # [tokens, L, H] random-admission draws of the extend rows (kernels)
        self._rows: DecodeRows | None = None  # the current decode step
        self.batch_slots: list[int] | None = None  # record_batch_slots
        self._warned_slot_readback = False
        self.batch_prompt_ends: tuple[list[int], list[bool]] | None = None  # record_batch_slots (extend)
        self.batch_decode_rows = 0  # record_batch_slots: the decode rows ending a mixed batch
        self._graph: DecodeRows | None = None  # [max_bs] static buffers (init_cuda_graph_state)
        self._graph_launch = {}  # captured batch size -> (num_splits, FoldedDecodeWorkspace)

    # -- per forward ----------------------------------------------------------------------------
    def _host_slots(self, forward_batch: ForwardBatch) -> list[int]:
        slots = getattr(forward_batch, "wgkv_req_slots", None)
        if slots is None or len(slots) != forward_batch.batch_size:
            if not self._warned_slot_readback:
                self._warned_slot_readback = True
                logger.warning(LOG_SLOT_READBACK)
            slots = forward_batch.req_pool_indices.tolist()  # a batch not built by init_new (syncs)
        return slots

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        if forward_batch.forward_mode.is_idle():
            return
        with traced("wgkv.plan_forward"):
            self._plan_forward(forward_batch)

    def _plan_forward(self, forward_batch: ForwardBatch):
        if self._writes.pending:
            raise RuntimeError(f"a forward ended with {self._writes.pending} layers' pool writes unwritten")
        mode = forward_batch.forward_mode
        self._gate_check.poll()
        host_slots = self._host_slots(forward_batch)
        split = len(host_slots) - self._decode_rows_of(forward_batch, host_slots)  # prefill rows first
        if self.evictor is not None:  # step boundary: bound what the previous forward admitted
            if mode.is_extend():  # whose prompts go on (or start from a restored prefix): not decoding
                self.evictor.open_prompts(host_slots[:split])
            self.evictor.maybe_evict()
        slots = forward_batch.req_pool_indices
        self._extend, self._rows, self._mixed_split = None, None, None
        if mode.is_decode():
            host = (forward_batch.seq_lens_cpu - 1).tolist()
            plan = self.dual.begin_decode(
                host_slots, host, req_slots_dev=slots, seq_lens_dev=forward_batch.seq_lens - 1
            )
            self._rows = self._decode_step_rows(plan, slots, host)
        elif mode.is_mixed():
            prefix, extend = (
                list(forward_batch.extend_prefix_lens_cpu),
                list(forward_batch.extend_seq_lens_cpu),
            )
            if any(n != 1 for n in extend[split:]):
                raise RuntimeError(f"a mixed batch's decode rows extend by {extend[split:]} tokens, not 1")
            # a decode row is a one-token extend to SGLang; here it decodes (memory/mixed_step.py)
            self._extend = (host_slots[:split], prefix[:split], extend[:split])
            plan, dec_plan = self.dual.begin_mixed(
                *self._extend,
                host_slots[split:],
                prefix[split:],
                dec_slots_dev=slots[split:],
                dec_lens_dev=forward_batch.seq_lens[split:] - 1,
            )
            self._plan_extend_rows(plan, slots[:split], forward_batch.extend_seq_lens[:split])
            self._rows = self._decode_step_rows(dec_plan, slots[split:], prefix[split:])
            self._mixed_split = sum(extend[:split])
        elif mode.is_extend():
            prefix, extend = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
            self._extend = (host_slots, list(prefix), list(extend))
            plan = self.dual.begin_extend(*self._extend)
            self._plan_extend_rows(plan, slots, forward_batch.extend_seq_lens)
        else:
            raise NotImplementedError(f"the {BACKEND_NAME} backend does not run forward mode {mode.name}")
        self._q_pos = None
        if self._extend is not None:
            _, prefix, extend = self._extend
            if max((S + n for S, n in zip(prefix, extend)), default=0) > -FAR_POSITION:
                raise ValueError(f"positions past {-FAR_POSITION} (the global entries' far position)")
            # int32 positions: the prefill kernel's masks in int64 took ~1.25x its time
            # (benchmarks/results/kernels/kernel_attention_positions_int64_h100.json against _int32_h100.json)
            self._q_pos = forward_batch.positions[: self._mixed_split].to(torch.int32)

    def _decode_rows_of(self, forward_batch: ForwardBatch, host_slots: list[int]) -> int:
        """The decode rows ending a MIXED batch, as :func:`~sglang_wgkv.integration.backend.batch_slots.record_batch_slots` recorded them; 0 otherwise."""
        if not forward_batch.forward_mode.is_mixed():
            return 0
        if self.batch_slots != host_slots or not self.batch_decode_rows:
            raise RuntimeError(
                f"a mixed forward of request slots {host_slots}, but the last ForwardBatch built "
                f"recorded {self.batch_slots} with {self.batch_decode_rows} decode rows"
            )
        return self.batch_decode_rows

    def _plan_extend_rows(self, plan, slots: torch.Tensor, extend_lens: torch.Tensor) -> None:
        """The per-layer inputs of an extend plan's rows: indptrs, admission thresholds, and the
        evictor's prompt-end declaration. slots, extend_lens ``[B]`` on the device."""
        admissions = getattr(self.req_pool, "slot_admission", None)
        slots_, prefix, extend = self._extend
        all_kept = admissions is not None and not any(admissions[s].admission for s in slots_)
        dense = getattr(self.req_pool, "slot_dense", None)
        # every key visible to every later query: all admitted (the context then read without page
        # padding), or every request still inside its ring; one dense FA3 call (attention/fa3_dense.py)
        in_ring = all(S + n <= self.dual.window for S, n in zip(prefix, extend))
        kept = all_kept and dense is not None and all(dense[s] for s in slots_)
        plan.exact_global = bool(self._fa3_dense is not None and (kept or in_ring))
        ranges = extend_indptrs(plan, self.dual.num_layers, self.dual.window, self.device, self._band_fn)
        self._indptrs, self._dense, self._band = ranges.indptrs, ranges.dense, ranges.window
        self._longest_keys = ranges.longest_keys
        declared = self.batch_prompt_ends
        if self.evictor is not None and declared is not None and declared[0] == self._extend[0]:
            self.evictor.mark_extend(*declared)
        rows = sum(extend)
        self._all_kept = None
        if all_kept:
            # every prefill row's request keeps every token: no gate to run, in any layer
            self._all_kept = torch.ones(rows, self.dual.num_kv_heads, dtype=torch.bool, device=self.device)
            self._row_tau = self._row_uniform = None
            return
        tau = self.req_pool.slot_tau[slots]
        self._row_tau = torch.repeat_interleave(tau, extend_lens, output_size=rows).unsqueeze(1)
        # the prefill gate decides in its own launch: one [N, L, H] draw a forward, not one a layer
        self._row_uniform = self._draw_uniform(rows) if self.prefill_gate is not None else None

    def _decode_step_rows(self, plan, slots: torch.Tensor, host_pos: list[int]) -> DecodeRows:
        """One eager decode step's rows (a decode forward's, or a mixed forward's decode rows):
        ``slots`` ``[B]`` on the device, ``host_pos`` the positions being decoded."""
        rows = DecodeRows(
            plan.req,
            plan.pos,
            plan.ring_tokens,
            self.req_pool.slot_tau[slots][:, None],
            self._draw_uniform(len(host_pos)),
        )
        if not self.use_kernels and self.device.type == "cpu":
            rows.threads = cpu_threads(self.dual.num_kv_heads * sum(host_pos))
        if self.use_kernels:
            from sglang_wgkv.attention.decode_config import choose_num_splits

            rows.num_splits = choose_num_splits(
                len(host_pos),
                self.dual.num_kv_heads,
                max(host_pos) + 1,
                self.device,
                self.decode_launch.programs_per_sm,
            )
            rows.gate_splits = self.decode_gate.num_splits(len(host_pos) * self.dual.num_kv_heads, self._sms)
        return rows

    def _draw_uniform(self, batch: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's ``[B, L, H]`` random-admission draws on the kernels path (drawn eagerly, so a
        CUDA graph records no random op); None otherwise (the reference path draws per layer)."""
        if self.config.random_admission is None or not self.use_kernels:
            return None
        shape = (batch, self.dual.num_layers, self.dual.num_kv_heads)
        if out is None:
            return torch.rand(shape, device=self.device, generator=self.generator)
        return torch.rand(shape, device=self.device, generator=self.generator, out=out)

    # -- per layer ------------------------------------------------------------------------------
    @staticmethod
    def _check_layer(layer: RadixAttention, save_kv_cache: bool) -> None:
        if not save_kv_cache:
            raise NotImplementedError(f"the {BACKEND_NAME} backend always writes the KV cache")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError(f"the {BACKEND_NAME} backend does not run sliding-window layers")

    def forward_extend(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ):
        """An extend forward's layer; a mixed forward's (SGLang calls this for MIXED too): its packed
        prefill rows through the extend path, then its decode rows through the decode path."""
        self._check_layer(layer, save_kv_cache)
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q3, k3, v3 = q.view(-1, Hq, D), k.view(-1, H, D), v.view(-1, H, Dv)
        k_pre = self.capture.take(k3)
        n = self._mixed_split
        if n is None:
            return self._extend_rows(q3, k3, v3, k_pre, layer, self._q_pos).reshape(-1, Hq * Dv)
        # both parts write their rows of one output (a concatenation would copy the prefill's rows)
        out = q3.new_empty(q3.shape[0], Hq, Dv)
        self._extend_rows(q3[:n], k3[:n], v3[:n], k_pre[:n], layer, self._q_pos, out=out[:n])
        with traced("wgkv.mixed_decode_rows"):
            self._decode_rows(q3[n:], k3[n:], v3[n:], k_pre[n:], layer, out=out[n:])
        return out.view(-1, Hq * Dv)

    def forward_decode(
        self,
        q,
        k,
        v,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ):
        self._check_layer(layer, save_kv_cache)
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        k3, v3 = k.view(-1, H, D), v.view(-1, H, Dv)
        out = self._decode_rows(q.reshape(-1, Hq, D), k3, v3, self.capture.take(k3), layer)
        return out.to(q.dtype).reshape(-1, Hq * Dv)

    def support_triton(self):
        return False
