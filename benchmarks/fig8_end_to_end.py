"""The paper's Fig. 8 protocol (App. I): Llama-3.1-8B shape, random weights, batch 1, 75% rejection.

Two engines over the same :class:`fig8_model.RandomLlama`, measured in the same run:

* dense: FlashInfer FA3 causal prefill (``single_prefill_with_kv_cache(backend="fa3")``), a dense
  paged KV cache (16-token pages, allocated for the whole context), FlashInfer paged decode;
* WG-KV: the write gate runs on every token (its decision is replaced by a random 25% admission
  mask, App. I.3), Triton vertical-slash prefill, the core ``DualCachePool`` (ring + global pages,
  sized for the admitted tokens) filled by the Triton prefill write; per decode step the Triton lazy
  promotion (``triton_pool.decode_promote``), the Triton decode write and the decode attention:
  ``--decode triton`` (default): the plan-free Triton split-KV decode
  (``attention.triton_decode.folded_decode``); the whole step, promotion included, is one CUDA
  graph replay with no host sync but the token; ``--decode flashinfer``: FlashInfer folded-head
  decode, promotion by ``begin_decode`` before the replay, one host sync for the page counts and a
  FlashInfer plan per layer whose page counts changed.

Optional extra dense prefill baselines (``--extra-dense fa2 sdpa`` at ``--extra-dense-lengths``):
the same dense engine with FlashInfer FA2 or torch SDPA (flash backend) prefill attention; TTFT and
peak memory only (no decode).

TTFT = wall time of the prefill forward up to the first token on the host. TPOT = mean wall time of
100 decode steps after 5 warm-up steps (the first one captures the CUDA graph); every step syncs
once for its token. Peak memory = ``torch.cuda.max_memory_allocated`` over prefill + decode,
weights included. A length that does not fit records ``{"oom": ...}``.

Each length and mode is one entry of ``<out>/<name>.json``; ``--append`` merges a run into an
existing file (so a sweep can be split over several device calls); ``<name>.md`` is the markdown
table of everything in the file.

usage: python -m benchmarks.fig8_end_to_end --out DIR [--lengths 131072 ...] [--modes wgkv dense]
       [--decode triton|flashinfer] [--extra-dense fa2 sdpa --extra-dense-lengths 131072]
       [--name STEM --append] [--deadline S]
"""

import argparse
import gc
import json
import math
import os
import time

import torch

from benchmarks.common import Deadline, capture_graph, environment, write_json
from benchmarks.fig8_model import HKV, HQ, LAYERS, VOCAB, D, RandomLlama

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


def measure(engine, n, decode=True):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine.prefill(n)
    ttft = time.perf_counter() - t0
    res = {"ttft_s": ttft}
    if decode:
        for _ in range(WARMUP):
            engine.decode_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            engine.decode_step()
        res.update(tpot_ms=(time.perf_counter() - t0) / STEPS * 1e3, graph=engine.graph is not None)
    res["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    res.update(engine.kv_bytes())
    return res


def make_engine(model, n_max, key, workspace, use_graph, cfg):
    """key: "dense" | "dense_fa2" | "dense_sdpa" (prefill only) | "wgkv" | "wgkv_triton" | "wgkv_flashinfer"."""
    if key.startswith("dense"):
        return DenseEngine(model, n_max, workspace, use_graph, key[6:] or "fa3")
    return WGKVEngine(model, n_max, workspace, use_graph, cfg, key[5:])


def run_length(model, n, key, workspace, use_graph, cfg):
    """One measurement; ``{"oom": ...}`` when the engine or its run does not fit."""
    n_max = n + WARMUP + STEPS + 1
    res = None
    try:
        engine = make_engine(model, n_max, key, workspace, use_graph, cfg)
        res = {"engine": engine.name, **measure(engine, n, decode=key not in ("dense_fa2", "dense_sdpa"))}
    except torch.cuda.OutOfMemoryError as exc:
        res = {"oom": str(exc)[:300]}
    engine = None  # drop the engine (and, after an OOM, the traceback's references) before freeing
    gc.collect()
    torch.cuda.empty_cache()
    return res


def ratios(row) -> dict:
    """Speedups of WG-KV over the dense columns measured for one length (same run or merged runs)."""
    out = {}
    d = row.get("dense", {})
    for key in [k for k in row if k.startswith("wgkv")]:
        w, sfx = row[key], key[4:]
        if "ttft_s" not in w:
            continue
        if "ttft_s" in d:
            out["ttft_speedup" + sfx] = d["ttft_s"] / w["ttft_s"]
            out["peak_memory_ratio" + sfx] = w["peak_memory_bytes"] / d["peak_memory_bytes"]
            out["kv_bytes_ratio" + sfx] = w["kv_used_bytes"] / d["kv_used_bytes"]
        if "tpot_ms" in d and "tpot_ms" in w:
            out["tpot_speedup" + sfx] = d["tpot_ms"] / w["tpot_ms"]
        for base in ("dense_fa2", "dense_sdpa"):
            if "ttft_s" in row.get(base, {}):
                out[f"ttft_speedup{sfx}_vs_{base[6:]}"] = row[base]["ttft_s"] / w["ttft_s"]
    return out


def markdown(results) -> str:
    """The SUMMARY table of every length and column in ``results``."""
    lines = [
        "| N | column | TTFT s | TPOT ms | peak GB | KV used GB | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(results["lengths"], key=lambda r: r["n"]):
        for key, r in row.items():
            if key in ("n", "ratios"):
                continue
            note = r.get("oom") and "OOM" or r.get("skipped", "")
            cells = [
                f"{r['ttft_s']:.1f}" if "ttft_s" in r else "",
                f"{r['tpot_ms']:.2f}" if "tpot_ms" in r else "",
                f"{r['peak_memory_bytes'] / 1e9:.1f}" if "peak_memory_bytes" in r else "",
                f"{r['kv_used_bytes'] / 1e9:.1f}" if "kv_used_bytes" in r else "",
            ]
            lines.append(f"| {row['n']} | {key} | " + " | ".join(cells) + f" | {note} |")
        if row.get("ratios"):
            lines.append(
                f"| {row['n']} | ratios | "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
                + " |||||"
            )
    return "\n".join(lines) + "\n"


def plot(results, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["lengths"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label, scale in (
        (axes[0], "ttft_s", "TTFT (s)", 1),
        (axes[1], "tpot_ms", "TPOT (ms)", 1),
        (axes[2], "peak_memory_bytes", "peak memory (GB)", 1e-9),
    ):
        cols = sorted({k for r in rows for k in r if k not in ("n", "ratios")})
        for col in cols:
            pts = sorted((r["n"] / 1024, r[col][key] * scale) for r in rows if key in r.get(col, {}))
            if pts:
                ax.plot(*zip(*pts), "o-" if col.startswith("wgkv") else "s--", label=col)
        ax.set(xlabel="context (K tokens)", ylabel=label)
        ax.legend()
    fig.suptitle("Llama-3.1-8B shape, random weights, batch 1, 75% rejection, H200")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/paper_fig8")
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 409600, 512000])
    ap.add_argument("--deadline", type=float, default=3000.0)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--eager", action="store_true", help="no CUDA graph for decode")
    ap.add_argument("--modes", nargs="+", default=["wgkv", "dense"], choices=["wgkv", "dense"])
    ap.add_argument(
        "--decode",
        nargs="+",
        default=["triton"],
        choices=["triton", "flashinfer"],
        help="WG-KV decode attention; the first is column 'wgkv', others 'wgkv_<name>'",
    )
    ap.add_argument(
        "--extra-dense",
        nargs="*",
        default=[],
        choices=["fa2", "sdpa"],
        help="also measure dense TTFT with these prefill backends (columns 'dense_<name>')",
    )
    ap.add_argument(
        "--extra-dense-lengths",
        type=int,
        nargs="*",
        default=[],
        help="lengths (among --lengths) for --extra-dense",
    )
    ap.add_argument("--name", default="fig8_end_to_end", help="output file stem")
    ap.add_argument("--append", action="store_true", help="merge into an existing <name>.json")
    args = ap.parse_args()
    deadline = Deadline(args.deadline)
    path = os.path.join(args.out, args.name + ".json")
    cfg = None
    if os.path.exists("/tmp/wgkv_prefill_config.json"):
        from sglang_wgkv.attention.triton_prefill import PrefillConfig

        with open("/tmp/wgkv_prefill_config.json") as f:
            cfg = PrefillConfig(**json.load(f))
    columns = []  # (key, lengths)
    if "wgkv" in args.modes:
        columns += [("wgkv" if i == 0 else f"wgkv_{d}", args.lengths) for i, d in enumerate(args.decode)]
    if "dense" in args.modes:
        columns.append(("dense", args.lengths))
    columns += [
        (f"dense_{b}", [n for n in args.lengths if n in args.extra_dense_lengths]) for b in args.extra_dense
    ]
    engine_key = {"wgkv": "wgkv_" + args.decode[0]}
    torch.manual_seed(0)
    model = RandomLlama(max(args.lengths) + WARMUP + STEPS + 16, layers=args.layers)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
    protocol = {
        "layers": args.layers,
        "q_heads": HQ,
        "kv_heads": HKV,
        "head_dim": D,
        "dtype": "bfloat16",
        "batch": 1,
        "local_window": WINDOW,
        "admission": f"random {P_ADMIT} per (token, layer, head), gate MLP evaluated",
        "decode_steps": STEPS,
        "warmup_steps": WARMUP,
        "cuda_graph_decode": not args.eager,
        "prefill_config": cfg.__dict__ if cfg else "default",
    }
    run = {
        "env": environment(),
        "protocol": protocol,
        "columns": [c for c, _ in columns],
        "wgkv_decode": args.decode[0],
    }
    if args.append and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
        results.setdefault("runs", []).append(run)
    else:
        results = {**run, "weight_bytes": model.weight_bytes(), "lengths": [], "runs": [run]}
    for key, lengths in columns:  # warm-up pass: JIT builds, Triton compiles, graph machinery
        if lengths:
            run.setdefault("warmup", {})[key] = run_length(
                model, 8192, engine_key.get(key, key), workspace, not args.eager, cfg
            )
    write_json(path, results, "fig8")
    for n in args.lengths:
        row = next((r for r in results["lengths"] if r["n"] == n), None)
        if row is None:
            row = {"n": n}
            results["lengths"].append(row)
        for key, lengths in columns:
            if n not in lengths:
                continue
            done = [r for r in results["lengths"] if "ttft_s" in r.get(key, {})]
            est = 0.0
            if done:  # quadratic extrapolation from the longest measured length
                last = max(done, key=lambda r: r["n"])
                est = last[key]["ttft_s"] * (n / last["n"]) ** 2 + 15
            if deadline.left() < est:
                row[key] = {"skipped": f"deadline: ~{est:.0f} s needed, {deadline.left():.0f} s left"}
                continue
            row[key] = run_length(model, n, engine_key.get(key, key), workspace, not args.eager, cfg)
            print(n, key, json.dumps(row[key]), flush=True)
            row["ratios"] = ratios(row)
            write_json(path, results, "fig8")
        if row.get("ratios"):
            print(n, "ratios", json.dumps(row["ratios"]), flush=True)
    write_json(path, results, "fig8")
    table = markdown(results)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(table)
    print(table, flush=True)
    plot(results, os.path.join(args.out, args.name + ".png"))


if __name__ == "__main__":
    main()
