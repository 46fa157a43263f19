"""The Fig. 8 engines' shared step loop (:class:`Engine`) and the dense baseline (:class:`DenseEngine`):
FlashInfer FA3 (or FA2, torch SDPA) causal prefill over a dense paged KV cache (16-token pages,
allocated for the whole context), FlashInfer paged decode. The protocol constants are the paper's
App. I ones; ``benchmarks.fig8_end_to_end`` runs the engines.
"""

import torch

from benchmarks.common import capture_graph
from benchmarks.fig8_model import HKV, HQ, VOCAB, D

WINDOW, P_ADMIT, STEPS, WARMUP = 256, 0.25, 100, 5
DT = torch.bfloat16
DEVICE = "cuda"


class Engine:
    """prefill(n) -> first token; decode_step() -> next token; graph replay after the first step."""

    def __init__(self, model, use_graph: bool):
        self.model, self.use_graph = model, use_graph
        self.graph = None
        self.seq = 0
        self.pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
        self.tok = torch.zeros(1, dtype=torch.long, device=DEVICE)

    def prefill(self, n: int) -> int:
        tokens = torch.randint(VOCAB, (n,), device=DEVICE)
        pos = torch.arange(n, device=DEVICE)
        x = self.model.embed[tokens]
        self._begin(n)
        for layer in range(self.model.layers):
            q, k_pre, k, v = self.model.qkv(layer, x, pos)
            attn = self._prefill_attention(layer, q, k_pre, k, v, pos)
            del q, k_pre, k, v
            x = self.model.finish_layer(layer, x, attn)
            del attn
        self.tok.copy_(self.model.logits_last(x).argmax(-1))
        self.seq = n
        return int(self.tok.item())

    def decode_step(self) -> int:
        self.pos.fill_(self.seq)
        self._before_step()
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graph:
            self.graph = capture_graph(self._step_body)
        else:
            self._step_body()
        self.seq += 1
        return int(self.tok.item())

    def _step_prologue(self):
        """Device work at the start of a step, inside the graph (none for dense)."""

    def _step_body(self):
        self._step_prologue()
        x = self.model.embed[self.tok]
        for layer in range(self.model.layers):
            q, k_pre, k, v = self.model.qkv(layer, x, self.pos)
            attn = self._decode_attention(layer, q, k_pre, k, v)
            x = self.model.finish_layer(layer, x, attn)
        self.tok.copy_(self.model.logits_last(x).argmax(-1))


class DenseEngine(Engine):
    """``prefill``: "fa3" (the main dense column), "fa2" (FlashInfer FA2) or "sdpa" (torch SDPA, flash)."""

    def __init__(self, model, n_max: int, workspace, use_graph: bool, prefill: str = "fa3"):
        import flashinfer

        super().__init__(model, use_graph)
        self.prefill_backend = prefill
        self.name = {
            "fa3": "dense: FlashInfer FA3 prefill + FlashInfer paged decode",
            "fa2": "dense: FlashInfer FA2 prefill",
            "sdpa": "dense: torch SDPA (flash) prefill",
        }[prefill]
        self.pages = -(-n_max // 16)
        shape = (self.pages, 16, HKV, D)
        self.k_cache = [torch.empty(shape, dtype=DT, device=DEVICE) for _ in range(model.layers)]
        self.v_cache = [torch.empty(shape, dtype=DT, device=DEVICE) for _ in range(model.layers)]
        self.all_pages = torch.arange(self.pages, dtype=torch.int32, device=DEVICE)
        self.dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(2, dtype=torch.int32, device=DEVICE),
            paged_kv_indices_buffer=torch.zeros(self.pages, dtype=torch.int32, device=DEVICE),
            paged_kv_last_page_len_buffer=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        )

    def kv_bytes(self) -> dict:
        total = sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)
        return {
            "kv_allocated_bytes": total,
            "kv_used_bytes": total * min(1.0, (self.seq + 1) / (self.pages * 16)),
        }

    def _begin(self, n):
        pass

    def _prefill_attention(self, layer, q, k_pre, k, v, pos):
        import flashinfer

        n = q.shape[0]
        self.k_cache[layer].view(-1, HKV, D)[:n] = k
        self.v_cache[layer].view(-1, HKV, D)[:n] = v
        if self.prefill_backend == "sdpa":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    is_causal=True,
                    enable_gqa=True,
                )
            return out[0].transpose(0, 1)
        return flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, backend=self.prefill_backend)

    def _before_step(self):
        n = self.seq + 1
        pages = -(-n // 16)
        self.dec.plan(
            torch.tensor([0, pages], dtype=torch.int32),
            self.all_pages[:pages],
            torch.tensor([n - (pages - 1) * 16], dtype=torch.int32),
            HQ,
            HKV,
            D,
            16,
            q_data_type=DT,
            kv_data_type=DT,
        )

    def _decode_attention(self, layer, q, k_pre, k, v):
        page, off = self.pos // 16, self.pos % 16
        self.k_cache[layer][page, off] = k
        self.v_cache[layer][page, off] = v
        return self.dec.run(q, (self.k_cache[layer], self.v_cache[layer]))
