"""The ``wgkv`` attention backend: write gate + dual-cache pool + WG-KV attention inside SGLang.

Per forward (``init_forward_metadata``, once for all layers):

* extend: :meth:`DualCachePool.begin_extend` with the batch's request slots, prefix and extend
  lengths (chunked prefill continues a slot; a new or retracted request starts at prefix 0);
* decode: :meth:`DualCachePool.begin_decode` (ring pages, lazy promotion of every layer's victim);
* with ``--kv-budget``: first, :meth:`SnapKVEvictor.maybe_evict` (the step boundary), and every layer
  hands its queries to the evictor's observation window.

Per layer (``forward_extend`` / ``forward_decode``): the gate scores the new keys from the captured
pre-RoPE key and the post-RoPE key, admission flags follow (``g >= tau`` or random), attention runs
over what the pool keeps (vertical-slash over cached context + new tokens in extend; ring + global
pages in decode), and the new K/V are written to the pool.

Attention implementations (``ServingSettings.attention``): the torch reference
(:mod:`sglang_wgkv.attention.reference`, any device) or, on CUDA, the Triton vertical-slash prefill
and FlashInfer's paged decode over folded heads (same contracts). Both sync with the host once per
layer (per-request context gathering, page counts for the decode plan); CUDA graphs are off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_wgkv.attention.folded_index import build_folded_indices
from sglang_wgkv.attention import reference
from sglang_wgkv.gate import GateConfig, WriteGates, load_gates
from sglang_wgkv.gate.admission import admission_flags, check_gate_output
from sglang_wgkv.integration.key_capture import PreRopeKeyCapture
from sglang_wgkv.integration.kv_pool import WGKVTokenToKVPool
from sglang_wgkv.integration.settings import BACKEND_NAME, ServingSettings

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


def build_gates(settings: ServingSettings, num_layers: int, num_kv_heads: int, head_dim: int,
                device, heads: list[int] | None = None) -> WriteGates:
    """The checkpoint at ``settings.gates_path`` or fresh (admit-all) gates; checked against the model
    (``num_kv_heads``: all of its KV heads), then cut to ``heads`` (a tensor-parallel rank's) if given.

    Raises ValueError naming the file and the mismatch.
    """
    if settings.gates_path is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            gates = WriteGates(GateConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim))
    else:
        gates = load_gates(settings.gates_path)
        try:
            gates.check_model(num_layers, num_kv_heads, head_dim)
        except ValueError as e:
            raise ValueError(f"{settings.gates_path}: {e}") from e
    if heads is not None and list(heads) != list(range(num_kv_heads)):
        gates = gates.select_heads(heads)
    return gates.to(device).eval().requires_grad_(False)


def rank_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads SGLang's ``QKVParallelLinear`` gives ``tp_rank``: a contiguous block, or one
    replicated head when there are more ranks than KV heads."""
    if tp_size >= total_kv_heads:
        return [tp_rank * total_kv_heads // tp_size]
    per_rank = total_kv_heads // tp_size
    return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


class WGKVAttnBackend(AttentionBackend):
    """SGLang attention backend ``wgkv`` (registered by :mod:`sglang_wgkv.integration.plugin`)."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, WGKVTokenToKVPool):
            raise ValueError(f"--attention-backend {BACKEND_NAME} needs its KV pool, got {type(pool).__name__}")
        self.dual = pool.dual
        self.config = self.dual.config
        self.settings = ServingSettings.from_env()
        self.device = self.dual.device
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        self.kv_heads = rank_kv_heads(model_runner.model_config.get_total_num_kv_heads(),
                                      par.attn_tp_size, par.attn_tp_rank)
        if len(self.kv_heads) != self.dual.num_kv_heads:
            raise ValueError(f"rank {par.attn_tp_rank} holds KV heads {self.kv_heads}, "
                             f"its pool {self.dual.num_kv_heads}")
        self.gates = build_gates(self.settings, self.dual.num_layers,
                                 model_runner.model_config.get_total_num_kv_heads(),
                                 self.dual.head_dim, self.device, heads=self.kv_heads)
        self.capture = PreRopeKeyCapture.install(model_runner.model)
        self.generator = None
        if self.config.random_admission is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(self.settings.seed)
        self._extend = None   # (slots, prefix_lens, extend_lens) of the current extend forward
        kernels_fit = self.device.type == "cuda" and model_runner.dtype in (torch.float16, torch.bfloat16)
        self.use_kernels = self.settings.attention == "kernels" or (self.settings.attention == "auto" and kernels_fit)
        if self.use_kernels and not kernels_fit:
            raise ValueError("--wgkv-attention kernels needs a CUDA device and a float16/bfloat16 model")
        self._prefill = reference.vertical_slash_attention
        if self.use_kernels:
            from sglang_wgkv.attention.triton_prefill import vertical_slash_attention

            self._prefill = vertical_slash_attention
        self._decoder = None  # FoldedPagedDecode, built at the first decode (needs the layer's shapes)
        self.evictor = None
        if self.config.kv_budget is not None:
            from sglang_wgkv.memory.evictor import SnapKVEvictor

            self.evictor = SnapKVEvictor(
                pool=self.dual, budget=self.config.kv_budget,
                num_q_heads=model_runner.model_config.get_num_attention_heads(par.attn_tp_size),
                window=min(256, self.config.local_window))
        self.req_pool = model_runner.req_to_token_pool  # per-slot tau (request_control); usage at free
        self.req_pool.evictor = self.evictor
        if par.attn_tp_size > 1:
            from sglang_wgkv.integration.req_pool import tp_usage_reducer

            earlier = rank_kv_heads(model_runner.model_config.get_total_num_kv_heads(), par.attn_tp_size,
                                    par.attn_tp_rank - 1) if par.attn_tp_rank else []
            self.req_pool.reduce_usage = tp_usage_reducer(counts_heads=self.kv_heads != earlier)
        self._row_tau = None  # [tokens, 1] admission threshold of each row of the current forward

    # -- per forward ----------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return
        if self.evictor is not None:  # step boundary: bound what the previous forward admitted
            self.evictor.maybe_evict()
        slots = forward_batch.req_pool_indices
        if mode.is_decode():
            self._extend = None
            positions = forward_batch.seq_lens - 1
            self.dual.begin_decode(slots.tolist(), (forward_batch.seq_lens_cpu - 1).tolist(),
                                   req_slots_dev=slots, seq_lens_dev=positions)
            self._row_tau = self.req_pool.slot_tau[slots][:, None]
        elif mode.is_extend() and not mode.is_mixed():
            prefix, extend = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
            self._extend = (slots.tolist(), list(prefix), list(extend))
            self.dual.begin_extend(*self._extend)
            self._row_tau = torch.repeat_interleave(self.req_pool.slot_tau[slots],
                                                    forward_batch.extend_seq_lens)[:, None]
        else:
            raise NotImplementedError(f"the {BACKEND_NAME} backend does not run forward mode {mode.name}")

    # -- per layer ------------------------------------------------------------------------------
    def _admit(self, layer: RadixAttention, k: torch.Tensor, check: bool) -> torch.Tensor:
        k_pre = self.capture.take(k)
        g = self.gates(layer.layer_id, k_pre, k)
        if check:
            check_gate_output(g, layer.layer_id)
        tau = self._row_tau.to(g.dtype)  # g's dtype: the same rounding as a scalar tau
        admit = admission_flags(g, tau, self.config.random_admission, self.generator)
        if self.config.random_admission is not None:
            admit |= torch.isneginf(tau)  # requests with admission off keep every token
        return admit

    @staticmethod
    def _check_layer(layer: RadixAttention, save_kv_cache: bool) -> None:
        if not save_kv_cache:
            raise NotImplementedError(f"the {BACKEND_NAME} backend always writes the KV cache")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError(f"the {BACKEND_NAME} backend does not run sliding-window layers")

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs):
        self._check_layer(layer, save_kv_cache)
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q3, k3, v3 = q.view(-1, Hq, D), k.view(-1, H, D), v.view(-1, H, Dv)
        admit = self._admit(layer, k3, check=True)
        if self.evictor is not None:
            self.evictor.observe_extend(layer.layer_id, q3)
        slots, prefix_lens, extend_lens = self._extend
        keys, values, k_pos, admitted, kv_indptr, qo_indptr = [], [], [], [], [0], [0]
        start = 0
        for r, S, n in zip(slots, prefix_lens, extend_lens):
            num_keys = n
            if S:  # cached context first: global entries (admitted) and the ring
                ck, cv, cpos, cadm = self.dual.gather_context(layer.layer_id, r, S)
                keys.append(ck), values.append(cv), k_pos.append(cpos), admitted.append(cadm)
                num_keys += ck.shape[0]
            keys.append(k3[start:start + n]), values.append(v3[start:start + n])
            k_pos.append(forward_batch.positions[start:start + n]), admitted.append(admit[start:start + n])
            kv_indptr.append(kv_indptr[-1] + num_keys)
            start += n
            qo_indptr.append(start)
        dev = q.device
        out = self._prefill(
            q3, torch.cat(keys).to(q.dtype), torch.cat(values).to(q.dtype), torch.cat(admitted),
            torch.tensor(qo_indptr, device=dev), torch.tensor(kv_indptr, device=dev),
            forward_batch.positions, torch.cat(k_pos).to(forward_batch.positions.dtype),
            self.config.local_window, sm_scale=layer.scaling)
        self.dual.write_extend(layer.layer_id, k3, v3, admit)
        return out.reshape(-1, Hq * Dv)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs):
        self._check_layer(layer, save_kv_cache)
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        k3, v3 = k.view(-1, H, D), v.view(-1, H, Dv)
        admit = self._admit(layer, k3, check=False)
        q3 = q.reshape(-1, Hq, D)
        if self.evictor is not None:
            self.evictor.observe_decode(layer.layer_id, q3)
        self.dual.write_decode(layer.layer_id, k3, v3, admit)
        rows, num_pages, last_len, _ = self.dual.decode_page_rows(layer.layer_id)
        indptr, indices, last = build_folded_indices(rows, num_pages, last_len)
        if self.use_kernels:
            decoder = self._folded_decoder(layer, q3.dtype)
            decoder.plan(indptr, indices, last)
            out = decoder.run(q3, self.dual.k_pages, self.dual.v_pages)
        else:
            out = reference.paged_decode_attention(q3, self.dual.k_pages, self.dual.v_pages, indptr, indices,
                                                   last, sm_scale=layer.scaling)
        return out.reshape(-1, Hq * Dv)

    def _folded_decoder(self, layer: RadixAttention, q_dtype: torch.dtype):
        if self._decoder is None:
            from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode

            H = layer.tp_k_head_num
            self._decoder = FoldedPagedDecode(
                layer.tp_q_head_num, H, layer.qk_head_dim, max_batch_size=self.dual.max_requests,
                max_pages=self.dual.max_requests * H * self.dual.dump_col, device=self.device,
                q_dtype=q_dtype, kv_dtype=self.dual.dtype, sm_scale=layer.scaling)
        return self._decoder

    def support_triton(self):
        return False
