"""Gate-trainer speed: seconds per optimizer step and tokens/s for each soft-gate backend, at the
shipped gates' training shape (SmolLM2-135M, 4 λ values in one batch, 4K tokens).

Weights do not change the speed, so the default model is a randomly initialised SmolLM2-135M-shaped
Llama (no file needed); ``--model`` takes an HF directory, a ``.gguf`` or ``embedded`` instead. Rows
are random token ids. Every (backend, gradient checkpointing) pair runs ``--warmup`` steps (compiles)
then ``--steps`` timed steps; a failure (compile, kernel, out of memory) is recorded, not fatal.

    python -m benchmarks.train_speed --out benchmarks/results/train_speed_h200.json

The issue's goal: >= 2,000 steps in about 15 minutes, i.e. <= 0.45 s per step.
"""

import argparse
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import environment, write_json
from sglang_wgkv.training.backbone import Backbone, load_backbone
from sglang_wgkv.training.trainer import GateTrainer, TrainConfig

GOAL_STEPS, GOAL_S = 2000, 15 * 60


class RandomRows:
    """Stands in for :class:`~sglang_wgkv.training.corpus.Corpus`: random token rows."""

    def __init__(self, vocab: int, rows: int = 64, seed: int = 0):
        self.vocab, self.n, self.rng = vocab, rows, np.random.default_rng(seed)

    def rows(self, split: str, length: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, (self.n, length), dtype=np.int64)


def smollm2_shaped(device, dtype) -> Backbone:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Backbone(LlamaForCausalLM(cfg).to(device=device, dtype=dtype))


def measure(
    backbone: Backbone, backend: str, grad_checkpoint: bool, lams, seq_len: int, warmup: int, steps: int
) -> dict:
    cfg = TrainConfig(
        model="-",
        corpus="-",
        out_dir=tempfile.mkdtemp(),
        lams=lams,
        steps=10**6,
        seq_len=seq_len,
        backend=backend,
        grad_checkpoint=grad_checkpoint,
        dtype="bf16" if backbone.dtype == torch.bfloat16 else "fp32",
        device=str(backbone.device),
    )
    trainer = GateTrainer(cfg, backbone=backbone, corpus=RandomRows(backbone.lm.config.vocab_size))
    sync = torch.cuda.synchronize if backbone.device.type == "cuda" else (lambda: None)
    if backbone.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        trainer.train_step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync()
    per_step = (time.perf_counter() - t) / steps
    return {
        "seconds_per_step": per_step,
        "tokens_per_s_per_lambda": seq_len / per_step,
        "tokens_per_s_all_lambdas": seq_len * len(lams) / per_step,
        "minutes_for_2000_steps": GOAL_STEPS * per_step / 60,
        "meets_goal": GOAL_STEPS * per_step <= GOAL_S,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if backbone.device.type == "cuda" else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="HF dir, .gguf or 'embedded' (default: random SmolLM2-135M shape)"
    )
    p.add_argument("--backends", default="sdpa,split,flex_split,flex")
    p.add_argument("--grad-checkpoint", default="on,off", help="which of on,off to run")
    p.add_argument("--lams", default="0.003,0.01,0.03,0.1")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="start no configuration after this many seconds (those left are recorded as skipped)",
    )
    a = p.parse_args(argv)
    start = time.perf_counter()
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backbone = (
        load_backbone(a.model, dtype=dtype, device=device) if a.model else smollm2_shaped(device, dtype)
    )
    lams = tuple(float(x) for x in a.lams.split(","))
    runs = []
    result = {
        "what": "gate trainer speed per soft-gate backend",
        "model": a.model or "random SmolLM2-135M shape",
        "seq_len": a.seq_len,
        "lams": lams,
        "warmup": a.warmup,
        "steps": a.steps,
        "runs": runs,
        "goal": f"{GOAL_STEPS} steps in {GOAL_S // 60} min",
        **environment(),
    }
    for backend in a.backends.split(","):
        for gc in a.grad_checkpoint.split(","):
            run = {"backend": backend, "grad_checkpoint": gc == "on"}
            elapsed = time.perf_counter() - start
            if a.time_budget_s is not None and elapsed > a.time_budget_s:
                run["skipped"] = f"time budget: {elapsed:.0f} s of {a.time_budget_s:.0f} s spent"
            else:
                try:
                    run.update(measure(backbone, backend, gc == "on", lams, a.seq_len, a.warmup, a.steps))
                except Exception as e:  # noqa: BLE001 -- recorded per configuration (compile, kernel, OOM)
                    run["failed"] = f"{type(e).__name__}: {str(e)[:400]}"
                run["wall_s"] = time.perf_counter() - start - elapsed
            if device == "cuda":
                torch.cuda.empty_cache()
            print(run, flush=True)
            runs.append(run)
            if (
                a.out
            ):  # after every configuration: a run cut by the caller's time limit keeps what it measured
                write_json(a.out, result, "train_speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
