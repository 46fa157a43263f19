"""One layer of an extend forward in the ``wgkv`` backend: admission of the new rows (the prefill gate's
one launch on the kernels path, else the torch gate), the attention inputs the pool builds (the new
rows beside each request's cached context), the vertical-slash prefill or one dense FA3 call, and the
rows staged for the pool's grouped write."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_wgkv.attention.fa3_dense import dense_attention
from sglang_wgkv.gate.admission import admission_flags
from sglang_wgkv.integration.backend.tracing import traced

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention


class ExtendLayer:
    """Per-layer extend of :class:`~sglang_wgkv.integration.backend.attn_backend.WGKVAttnBackend` (a mixin:
    the backend owns the pool ``dual``, the forward's plan (``_indptrs``, ``_dense``, ``_band``, ``_longest_keys``,
    ``_row_tau``, ``_row_uniform``, ``_all_kept``), the gates and their check, the evictor, the
    prefill attention and FA3 calls, and the staged writes ``_writes``)."""

    def _admit_extend(self, layer: RadixAttention, k_pre: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The extend rows' admission flags ``[N, H]``: all True where every request of the rows keeps
        every token (no gate runs); on the kernels path gate values, check copy and flags in the prefill
        gate's one launch (its values land in the gate check's buffer); else :meth:`_admit`."""
        if self._all_kept is not None:
            return self._all_kept
        if self.prefill_gate is None:
            return self._admit(layer, k_pre, k, self._row_tau, check=True)
        lid = layer.layer_id
        g = self._gate_check.slot(lid, k.shape[:2])
        uniform = self._row_uniform[:, lid] if self._row_uniform is not None else None
        random_p = self.config.random_admission if uniform is not None else None
        admit = self.prefill_gate.admit(lid, k_pre, k, self._row_tau, uniform, random_p, g_out=g)
        self._gate_check.record(g, lid)
        return admit

    def _admit(
        self,
        layer: RadixAttention,
        k_pre: torch.Tensor,
        k: torch.Tensor,
        tau: torch.Tensor,
        check: bool,
        uniform: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Admission flags ``[N, H]`` from the gate's values (``check``: recorded for the gate check):
        the extend rows' off the kernels path, and the torch decode layer's (:class:`~sglang_wgkv.integration.backend.decode_layer.DecodeLayer`)."""
        gate = self.prefill_gate if self.prefill_gate is not None else self.gates
        g = gate(layer.layer_id, k_pre, k)
        if check:
            self._gate_check.record(g, layer.layer_id)
        tau = tau.to(g.dtype)  # g's dtype: the same rounding as a scalar tau
        if uniform is not None:
            admit = uniform[:, layer.layer_id] < self.config.random_admission
        else:
            admit = admission_flags(g, tau, self.config.random_admission, self.generator)
        if self.config.random_admission is not None:
            admit |= torch.isneginf(tau)  # requests with admission off keep every token
        return admit

    def _extend_rows(self, q3, k3, v3, k_pre, layer: RadixAttention, positions, out=None) -> torch.Tensor:
        """q3 ``[N, Hq, D]``, k3, v3, k_pre ``[N, H, D]``, positions ``[N]``: the extend plan's packed
        rows in ``layer``; returns ``[N, Hq, Dv]`` (``out``, q's dtype, when given)."""
        with traced("wgkv.extend_gate"):
            admit = self._admit_extend(layer, k_pre, k3)
            if self.evictor is not None:
                self.evictor.observe_extend(layer.layer_id, q3)
        with traced("wgkv.extend_inputs"):
            keys, values, k_pos, admitted = self.dual.extend_inputs(
                layer.layer_id, k3, v3, admit, positions, q3.dtype
            )
        qo_indptr, kv_indptr = self._indptrs
        lid = layer.layer_id
        fa3 = self._fa3 if self._fa3 is not None and self._longest_keys[lid] >= self._fa3_min_keys else None
        band = None
        if fa3 is None and self._band is not None:  # FA3's window call over this layer's keys
            fn, qo32, kv32, most_rows = self._band
            band = (fn, qo32, kv32[lid], most_rows, self._longest_keys[lid])
        if self._dense is not None:  # every key admitted: causal attention, one FA3 call
            qo32, kv32, longest = self._dense
            with traced("wgkv.extend_attention_dense"):
                out = dense_attention(
                    self._fa3_dense,
                    q3,
                    keys,
                    values,
                    qo32,
                    kv32[lid],
                    longest,
                    self._longest_keys[lid],
                    layer.scaling,
                    out=out,
                )
        else:
            with traced("wgkv.extend_attention"):
                out = self._prefill(
                    q3,
                    keys,
                    values,
                    admitted,
                    qo_indptr,
                    kv_indptr[lid],
                    positions,
                    k_pos,
                    self.config.local_window,
                    sm_scale=layer.scaling,
                    out=out,
                    **({"fa3": fa3} if fa3 is not None else {"band": band} if band is not None else {}),
                )
        with traced("wgkv.extend_write"):
            self._writes.stage(layer.layer_id, k3, v3, admit)
        if layer.layer_id == self.dual.num_layers - 1:
            self._gate_check.end_forward()
        return out
