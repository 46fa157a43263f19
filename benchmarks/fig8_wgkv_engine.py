"""The Fig. 8 WG-KV engine: the write gate on every token (its decision replaced by a random 25%
admission mask, App. I.3), Triton vertical-slash prefill, the core ``DualCachePool`` filled by the
Triton prefill write; per decode step Triton promotion, decode write and decode attention (Triton
split-KV inside one CUDA graph, or FlashInfer folded-head decode).
"""

import math

import torch

from benchmarks.fig8_engines import DEVICE, DT, P_ADMIT, STEPS, WARMUP, WINDOW, Engine
from benchmarks.fig8_model import HKV, HQ, D


class WGKVEngine(Engine):
    def __init__(self, model, n_max: int, workspace, use_graph: bool, prefill_config=None, decode="triton"):
        from sglang_wgkv.config import WGKVConfig
        from sglang_wgkv.gate.mlp import LayerGate
        from sglang_wgkv.memory import DualCachePool

        super().__init__(model, use_graph)
        L = model.layers
        self.decode = decode
        self.name = (
            "WG-KV: gate + Triton vertical-slash prefill + dual-cache pool (Triton promotion) + "
            + {"triton": "Triton split-KV decode", "flashinfer": "FlashInfer folded decode"}[decode]
        )
        # Pages per (layer, head): the admitted tokens with a 6-sigma margin, decode growth, the ring.
        mean, sd = P_ADMIT * n_max, math.sqrt(n_max * P_ADMIT * (1 - P_ADMIT))
        per_stream = -(-int(mean + 6 * sd + STEPS + WARMUP) // 16) + 2 + WINDOW // 16
        self.pool = DualCachePool(
            L,
            HKV,
            D,
            num_pages=L * HKV * per_stream,
            max_requests=1,
            max_context_len=n_max + 16,
            config=WGKVConfig(local_window=WINDOW, random_admission=P_ADMIT),
            dtype=DT,
            device=DEVICE,
        )
        self.gates = [LayerGate(HKV, D).to(DEVICE) for _ in range(L)]
        self.req = torch.zeros(1, dtype=torch.long, device=DEVICE)
        self.admit = None
        self.prefill_config = prefill_config
        if decode == "triton":
            from sglang_wgkv.attention.decode_config import FoldedDecodeWorkspace, choose_num_splits

            cols = self.pool.page_table.shape[-1]
            self.num_splits = choose_num_splits(1, HKV, cols * 16, DEVICE)
            self.ws = FoldedDecodeWorkspace(1, HQ, D, self.num_splits, DEVICE, num_kv_heads=HKV)
            self.attn_out = torch.empty(1, HQ, D, dtype=DT, device=DEVICE)
            # The step's decode plan (ring page / offset / ring tokens), written by the promotion launch.
            self.plan = (
                torch.empty(1, L, HKV, dtype=torch.long, device=DEVICE),
                torch.empty(1, 1, dtype=torch.long, device=DEVICE),
                torch.empty(1, dtype=torch.long, device=DEVICE),
            )
        else:
            from sglang_wgkv.attention.flashinfer_decode import FoldedPagedDecode

            cols = self.pool.page_table.shape[-1]
            self.decs = [
                FoldedPagedDecode(HQ, HKV, D, 1, HKV * cols + 1, DEVICE, DT, float_workspace=workspace)
                for _ in range(L)
            ]
            self.prev_pages = None

    def kv_bytes(self) -> dict:
        st = self.pool.stats()
        used = self.pool.allocator.num_pages - self.pool.num_free_pages()
        return {
            "kv_allocated_bytes": (self.pool.k_pages.numel() + self.pool.v_pages.numel()) * 2,
            "kv_used_bytes": used * 2 * 16 * D * 2,
            "global_tokens": st.get("global_tokens"),
            "admitted_fraction": st.get("admitted_fraction"),
        }

    def _begin(self, n):
        from sglang_wgkv.memory.triton_pool import begin_prefill

        self.pool.alloc_request(0)
        begin_prefill(self.pool, 0, n)
        self.ind = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)

    def _gate(self, layer, k_pre, k, chunk=65536):
        g = torch.empty(k.shape[:2], dtype=torch.float32, device=DEVICE)
        for s in range(0, k.shape[0], chunk):
            g[s : s + chunk] = self.gates[layer](k_pre[s : s + chunk], k[s : s + chunk])
        return g

    def _prefill_attention(self, layer, q, k_pre, k, v, pos):
        from sglang_wgkv.attention.triton_prefill import vertical_slash_attention
        from sglang_wgkv.memory.triton_pool import prefill_write

        self._gate(layer, k_pre, k)  # evaluated as in serving; the profiling mask replaces its decision
        admit = torch.rand(k.shape[:2], device=DEVICE) < P_ADMIT
        pos32 = pos.to(torch.int32)
        attn = vertical_slash_attention(
            q, k, v, admit, self.ind, self.ind, pos32, pos32, WINDOW, config=self.prefill_config
        )
        prefill_write(self.pool, 0, layer, k, v, admit)
        return attn

    def _before_step(self):
        pool, LH = self.pool, self.model.layers * HKV
        if self.decode == "flashinfer":
            pool.begin_decode([0], [self.seq], self.req, self.pos)
            glen = pool.global_len[0].long()
            pages = (WINDOW // 16 + (glen + 15) // 16).to(torch.int32).cpu()  # [L, H], one sync
            for layer, dec in enumerate(self.decs):
                if self.prev_pages is None or not torch.equal(pages[layer], self.prev_pages[layer]):
                    indptr = torch.zeros(HKV + 1, dtype=torch.int32)
                    indptr[1:] = torch.cumsum(pages[layer], 0)
                    dec.plan(indptr, None, None)
            self.prev_pages = pages
            return
        # Triton decode: the promotion runs inside the step's graph (_step_prologue); here is the host
        # bookkeeping begin_decode does for a promoting step (the ring is full: no ring page to allocate).
        if self.seq < WINDOW or pool.cached_len[0] != self.seq:
            raise RuntimeError(f"decode at {self.seq}: expected a full ring and cached length {self.seq}")
        pool.allocator.ensure(LH)  # syncs only when the free-page floor runs out
        pool.allocator.free_floor -= LH
        pool.cached_len[0] = self.seq + 1

    def _step_prologue(self):
        # One launch for every layer's profiling mask (the gate still runs per layer).
        self.admit = torch.rand(self.model.layers, 1, HKV, device=DEVICE) < P_ADMIT
        if self.decode == "triton":
            from sglang_wgkv.memory.triton_pool import decode_promote

            decode_promote(self.pool, self.req, self.pos, plan_out=self.plan, lower_floor=False)

    def _decode_attention(self, layer, q, k_pre, k, v):
        from sglang_wgkv.memory.triton_pool import decode_write

        self.gates[layer](k_pre, k)
        decode_write(self.pool, layer, self.req, self.pos, k, v, self.admit[layer])
        if self.decode == "triton":
            from sglang_wgkv.attention.triton_decode import folded_decode

            return folded_decode(
                q,
                self.pool.k_pages,
                self.pool.v_pages,
                self.pool.page_table,
                self.pool.global_len,
                self.req,
                self.plan[2],
                layer,
                num_splits=self.num_splits,
                workspace=self.ws,
                out=self.attn_out,
            )
        from sglang_wgkv.attention.folded_index import build_folded_indices

        glen = self.pool.global_len[0, layer].long()
        gpages = (glen + 15) // 16
        last = torch.where(gpages > 0, glen - (gpages - 1) * 16, 16)
        dec = self.decs[layer]
        _, _, last32 = build_folded_indices(
            self.pool.page_table[0, layer][None],
            (WINDOW // 16 + gpages)[None],
            last[None],
            out_indices=dec.indices_buffer,
        )
        dec.last_page_len.copy_(last32)
        return dec.run(q, self.pool.k_pages, self.pool.v_pages)
