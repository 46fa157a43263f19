"""CUDA graphs (decode only, kernels path). SGLang's decode graph runner calls
``init_forward_metadata_out_graph`` eagerly before capture (``in_capture=True``) and before every
replay; per-layer work reads the step's rows from static device buffers (:class:`~sglang_wgkv.integration.backend.decode_layer.DecodeRows`
views of ``[max_bs]`` tensors). Replay preparation runs the step's host bookkeeping and
:meth:`DualCachePool.begin_decode` (ring pages, promotion) for the real rows and points the padded
rows at :data:`~sglang_wgkv.integration.backend.decode_layer.SCRATCH_SLOT`, SGLang's padding request row (index 0, never given to a request), whose
page-table rows are all dump pages: their K/V land on the dump page, their flags and (``--kv-budget``)
queries in state of a slot nobody owns. Capture and SGLang's warm-up runs see only padded rows, so
they cannot touch a live request. Random admission draws the step's ``[B, L, H]`` uniforms eagerly
with its own generator (nothing random is recorded in the graph). The evictor's per-layer
observation indexes the static rows (captured); its step-boundary eviction runs in replay
preparation, outside the graph.
"""

import torch

from sglang_wgkv.integration.backend.decode_layer import SCRATCH_SLOT, DecodeRows
from sglang_wgkv.integration.plugin.settings import BACKEND_NAME


class DecodeGraphs:
    """The CUDA-graph hooks of :class:`~sglang_wgkv.integration.backend.attn_backend.WGKVAttnBackend` (a mixin: the
    backend owns the pool ``dual``, the evictor, the launch shape and gates, and ``_draw_uniform``)."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if not self.use_kernels:
            raise ValueError(
                f"the {BACKEND_NAME} reference attention syncs with the host every layer and cannot "
                "run under CUDA graphs: pass --wgkv-attention kernels (CUDA, fp16/bf16) or "
                "--disable-decode-cuda-graph"
            )
        if self.dual.active[SCRATCH_SLOT]:
            raise RuntimeError(f"request slot {SCRATCH_SLOT} (CUDA-graph padding) is held by a request")
        i64 = dict(dtype=torch.int64, device=self.device)
        self._graph = DecodeRows(
            req=torch.full((max_bs,), SCRATCH_SLOT, **i64),
            pos=torch.zeros(max_bs, **i64),
            ring=torch.ones(max_bs, **i64),
            tau=torch.zeros(max_bs, 1, dtype=torch.float32, device=self.device),
            uniform=(
                torch.zeros(max_bs, self.dual.num_layers, self.dual.num_kv_heads, device=self.device)
                if self.config.random_admission is not None
                else None
            ),
        )

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Decode-graph capture (``in_capture``: every row is padding) or replay preparation: the real
        rows' step (:meth:`DualCachePool.begin_decode`, evictor boundary) into the static buffers,
        padded rows pointed at :data:`SCRATCH_SLOT`."""
        from sglang_wgkv.attention.decode_config import FoldedDecodeWorkspace, choose_num_splits

        if not forward_batch.forward_mode.is_decode():
            raise NotImplementedError(f"the {BACKEND_NAME} backend captures decode graphs only")
        g, bs = self._graph, forward_batch.batch_size
        raw = 0 if in_capture else bs - forward_batch.num_padding
        if raw:
            slots = self.batch_slots
            if slots is None or len(slots) != raw:
                raise RuntimeError(
                    f"CUDA-graph replay of {raw} requests, but the last ForwardBatch built "
                    f"recorded request slots {slots}"
                )
            if self.evictor is not None:
                self.evictor.maybe_evict()
            plan = self.dual.begin_decode(
                slots,
                (forward_batch.seq_lens_cpu[:raw] - 1).tolist(),
                req_slots_dev=forward_batch.req_pool_indices[:raw],
                seq_lens_dev=forward_batch.seq_lens[:raw] - 1,
            )
            g.req[:raw].copy_(plan.req)
            g.pos[:raw].copy_(plan.pos)
            g.ring[:raw].copy_(plan.ring_tokens)
            g.tau[:raw, 0].copy_(self.req_pool.slot_tau[plan.req])
        g.req[raw:bs].fill_(SCRATCH_SLOT)
        g.pos[raw:bs].zero_()
        g.ring[raw:bs].fill_(1)
        g.tau[raw:bs].zero_()
        uniform = None
        if g.uniform is not None:
            uniform = self._draw_uniform(bs, out=g.uniform[:bs]) if raw else g.uniform[:bs].zero_()
        if bs not in self._graph_launch:
            splits = choose_num_splits(
                bs,
                self.dual.num_kv_heads,
                self.dual.max_context_len,
                self.device,
                self.decode_launch.programs_per_sm,
            )
            self._graph_launch[bs] = (
                splits,
                FoldedDecodeWorkspace(
                    bs,
                    self.num_q_heads,
                    self.dual.head_dim,
                    splits,
                    self.device,
                    num_kv_heads=self.dual.num_kv_heads,
                ),
                self.decode_gate.num_splits(bs * self.dual.num_kv_heads, self._sms),
            )
        splits, workspace, gate_splits = self._graph_launch[bs]
        self._extend, self._mixed_split = None, None
        self._rows = DecodeRows(
            g.req[:bs], g.pos[:bs], g.ring[:bs], g.tau[:bs], uniform, splits, workspace, gate_splits
        )
