"""Gate trainer: distil a frozen dense backbone into its write-gated self (paper §3.3, App. C).

One run trains one gate set per λ at once: the student batch holds the same sequence once per λ,
element b gated by ``gates[b]``, so the teacher pass and the backbone's weights are shared and the
λ sweep costs one run. AdamW is element-wise, so the sets do not interact.

Loss per λ: ``MSE(student final-norm hidden, teacher's) + λ · mean(g + g(1 - g))`` over the positions
some query sees beyond the local window.

Output directory::

    lam{λ}/gates.safetensors, lam{λ}/gates.json   the core's gate format (one per λ)
    trainer_state.pt                               optimizer, scheduler, step (for --resume)
    log.jsonl                                      one JSON line per logged step / validation
"""

import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from sglang_wgkv.config import DEFAULT_LOCAL_WINDOW, DEFAULT_TAU
from sglang_wgkv.gate import GateConfig, WriteGates, load_gates, save_gates
from sglang_wgkv.training.attention import (
    BACKENDS,
    HardGatedAttention,
    SoftGatedAttention,
    kv_fraction,
    sparsity_penalty,
)
from sglang_wgkv.training.backbone import Backbone, dense_attention, load_backbone
from sglang_wgkv.training.corpus import Corpus

STATE_FILE = "trainer_state.pt"
LOG_FILE = "log.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one (multi-λ) gate training run; defaults follow the paper's App. C."""

    model: str
    corpus: str
    out_dir: str
    lams: tuple[float, ...] = (0.01, 0.04, 0.16, 0.64)
    steps: int = 500
    seq_len: int = 4096
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    local_window: int = DEFAULT_LOCAL_WINDOW
    tau: float = DEFAULT_TAU
    eps: float = 1e-6
    hidden: int | None = (
        None  # the gate MLP's hidden width per head; None: GateConfig's default (4 * head_dim)
    )
    init_bias: float = 3.0
    val_every: int = 100
    val_rows: int = 4
    ckpt_every: int = 100
    log_every: int = 10
    backend: str = "auto"
    dtype: str = "bf16"
    device: str = "auto"
    seed: int = 0
    # None: off on CUDA, on elsewhere. On a GPU checkpointing costs far more step time than the memory
    # it saves is worth (benchmarks/results/accuracy/train_speed_h200.json); on a CPU box the
    # activations of 4 λ x 30 layers are what fills RAM.
    grad_checkpoint: bool | None = None
    model_id: str = ""
    time_budget_s: float = 0.0

    def __post_init__(self):
        if not self.lams or min(self.lams) < 0:
            raise ValueError(f"lams must be non-empty and non-negative, got {self.lams}")
        if len(set(self.lams)) != len(self.lams):
            raise ValueError(f"lams must be distinct, got {self.lams}")
        if self.steps <= 0 or self.seq_len <= self.local_window:
            raise ValueError("steps must be positive and seq_len larger than local_window")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.backend not in ("auto", *BACKENDS) or self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"bad backend {self.backend!r} or dtype {self.dtype!r}")


def lam_dir(out_dir: str | Path, lam: float) -> Path:
    return Path(out_dir) / f"lam{lam:g}"


def lr_lambda(warmup_steps: int, total_steps: int):
    """Linear warm-up to 1, then cosine decay to 0."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def choose_backend(
    backbone: Backbone, batch: int, seq_len: int, local_window: int, eps: float, iters: int = 3
) -> tuple[str, dict]:
    """The faster soft-gate backend for one layer's forward + backward at the training shape.

    On CPU: ``sdpa`` (FlexAttention has no CPU backward). On CUDA all of BACKENDS are timed:
    FlexAttention's gradient for the captured gate bias is an atomic scatter whose cost depends on the
    GPU, ``split`` runs SDPA's fused kernel over twice the keys (``flex_split``: FlexAttention, only the
    visible blocks), and the materialized-bias math path can still win for small models. A compile or
    kernel failure counts as a loss (its message is kept in the timings).
    """
    if backbone.device.type != "cuda":
        return "sdpa", {}
    s, dev, dt = backbone.shape, backbone.device, backbone.dtype
    q = torch.randn(batch, s.num_heads, seq_len, s.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(batch, s.num_kv_heads, seq_len, s.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    logit = torch.randn(batch, s.num_kv_heads, seq_len, device=dev, requires_grad=True)
    timings = {}
    for name in BACKENDS:
        att = SoftGatedAttention([], local_window, eps, name)

        def run():
            att.attend(q, k, v, torch.sigmoid(logit), s.head_dim**-0.5).float().square().mean().backward()

        try:
            run()  # compile / warm up
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - t) / iters
        except Exception as e:  # noqa: BLE001 -- any compile/runtime failure of the fused path means "use sdpa"
            timings[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    ok = {k: v for k, v in timings.items() if isinstance(v, float)}
    return min(ok, key=ok.get), timings


class GateTrainer:
    """Owns the backbone, the gate sets, the optimizer and the data order of one run."""

    def __init__(self, config: TrainConfig, backbone: Backbone | None = None, corpus: Corpus | None = None):
        device = (
            config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
        self.backbone = backbone or load_backbone(config.model, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.command = None  # the CLI line that made this run (kept in each gates.json by save)
        self.backend_timings = {}
        backend = config.backend
        if backend == "auto":
            backend, self.backend_timings = choose_backend(
                self.backbone, len(config.lams), config.seq_len, config.local_window, config.eps
            )
        grad_checkpoint = config.grad_checkpoint
        if grad_checkpoint is None:
            grad_checkpoint = self.device.type != "cuda"
        self.config = config = replace(
            config, device=device, backend=backend, grad_checkpoint=grad_checkpoint
        )
        self.corpus = corpus or Corpus(config.corpus)
        shape = self.backbone.shape
        torch.manual_seed(config.seed)
        self.gates = []
        for lam in config.lams:
            gc = GateConfig(
                num_layers=shape.num_layers,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                hidden=config.hidden,
                tau=config.tau,
                local_window=config.local_window,
                lam=lam,
                model_id=config.model_id or str(config.model),
                eps=config.eps,
            )
            gates = WriteGates(gc)
            for layer in gates.layers:
                torch.nn.init.constant_(layer.b2, config.init_bias)
            self.gates.append(gates.to(self.device))
        params = [p for g in self.gates for p in g.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = self._scheduler(config.steps)
        self.lams = torch.tensor(config.lams, device=self.device)
        self.student = SoftGatedAttention(self.gates, config.local_window, config.eps, backend)
        self.train_rows = self.corpus.rows("train", config.seq_len)
        self.order = np.random.default_rng(config.seed).permutation(len(self.train_rows))
        self.val_rows = self.corpus.rows("heldout", config.seq_len)[: config.val_rows]
        self.step = 0

    def _scheduler(self, total_steps: int, last_step: int = -1):
        warmup = max(1, int(self.config.warmup_frac * total_steps))
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup, total_steps), last_epoch=last_step
        )

    def fit_to_budget(self, seconds_per_step: float, seconds_left: float) -> int:
        """Shrink the run to the steps that fit in ``seconds_left`` (the schedule is re-planned); returns them."""
        c = self.config
        fit = self.step + int(seconds_left / seconds_per_step)
        if fit < c.steps:
            self.config = replace(c, steps=max(fit, self.step + 1))
            self.scheduler = self._scheduler(self.config.steps, last_step=self.step - 1)
        return self.config.steps

    # ---- one step -----------------------------------------------------------------------------
    def batch(self, step: int) -> torch.Tensor:
        row = self.train_rows[self.order[step % len(self.order)]]
        return torch.from_numpy(row)[None].to(self.device)

    def losses(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-λ ``mse``, ``sparsity`` and ``loss`` (each ``[n_lams]``) for one sequence ``ids [1, T]``."""
        with torch.no_grad():
            teacher, _ = self.backbone(ids, dense_attention)
        n = len(self.gates)
        student, gs = self.backbone(
            ids.expand(n, -1), self.student, grad_checkpoint=self.config.grad_checkpoint
        )
        mse = (student.float() - teacher.float()).pow(2).mean(dim=(1, 2))
        sparsity = torch.stack([sparsity_penalty(g, self.config.local_window) for g in gs]).mean(0)
        return {"mse": mse, "sparsity": sparsity, "loss": mse + self.lams * sparsity}

    def train_step(self) -> dict[str, list[float]]:
        out = self.losses(self.batch(self.step))
        self.optimizer.zero_grad(set_to_none=True)
        out["loss"].sum().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {k: v.detach().float().cpu().tolist() for k, v in out.items()}

    # ---- validation ---------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, list[float]]:
        """Held-out soft MSE, hard-threshold (τ) MSE and KV fractions, per λ, averaged over val rows."""
        c, n = self.config, len(self.gates)
        hard = HardGatedAttention(self.gates, c.local_window, c.tau)
        acc = {"soft_mse": 0.0, "hard_mse": 0.0, "kv_fraction": 0.0, "global_fraction": 0.0}
        for row in self.val_rows:
            ids = torch.from_numpy(row)[None].to(self.device)
            teacher, _ = self.backbone(ids, dense_attention)
            soft, _ = self.backbone(ids.expand(n, -1), self.student)
            hard_h, kept = self.backbone(ids.expand(n, -1), hard)
            T = ids.shape[1]
            fr = [kv_fraction(k, T, c.local_window) for k in kept]
            acc["soft_mse"] += (soft.float() - teacher.float()).pow(2).mean(dim=(1, 2))
            acc["hard_mse"] += (hard_h.float() - teacher.float()).pow(2).mean(dim=(1, 2))
            acc["kv_fraction"] += torch.stack([f[0] for f in fr]).mean(0)
            acc["global_fraction"] += torch.stack([f[1] for f in fr]).mean(0)
        return {k: (v / len(self.val_rows)).cpu().tolist() for k, v in acc.items()}

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self):
        out = Path(self.config.out_dir)
        c = self.config
        training = {
            "command": self.command,
            "step": self.step,
            "steps": c.steps,
            "lams": list(c.lams),
            "seq_len": c.seq_len,
            "lr": c.lr,
            "backend": c.backend,
            "model": c.model,
            "corpus": c.corpus,
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
        }
        for lam, gates in zip(c.lams, self.gates):
            save_gates(gates, lam_dir(out, lam), training=training)
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": asdict(self.config),
        }
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(out / STATE_FILE)

    def resume(self) -> bool:
        """Load the last checkpoint of ``out_dir`` if there is one; returns whether it did."""
        out = Path(self.config.out_dir)
        if not (out / STATE_FILE).is_file():
            return False
        state = torch.load(out / STATE_FILE, map_location=self.device, weights_only=True)
        saved = tuple(state["config"]["lams"])
        if saved != tuple(self.config.lams):
            raise ValueError(f"{out}: checkpoint was trained with lams {saved}, not {self.config.lams}")
        for lam, gates in zip(self.config.lams, self.gates):
            gates.load_state_dict(load_gates(lam_dir(out, lam)).state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        return True

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self, resume: bool = True, progress: bool = True) -> list[dict]:
        """Train to ``config.steps``; returns the validation records (also appended to log.jsonl)."""
        from tqdm import tqdm

        c = self.config
        out = Path(c.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            self.resume()
        log = open(out / LOG_FILE, "a")
        records = []
        bar = tqdm(total=c.steps, initial=self.step, desc="gates", disable=not progress)
        t0 = time.time()
        first, t_second = self.step, None
        if self.backend_timings:
            log.write(
                json.dumps(
                    {
                        "backend": c.backend,
                        "timings_s": self.backend_timings,
                        "grad_checkpoint": c.grad_checkpoint,
                    }
                )
                + "\n"
            )
        # SIGTERM (`timeout`, a machine's time limit) ends the loop after the step in flight, with a
        # checkpoint: the next run resumes there instead of at the last ckpt_every multiple
        stop = []
        in_main = threading.current_thread() is threading.main_thread()
        old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.append(1)) if in_main else None
        try:
            while self.step < self.config.steps:
                if stop:
                    self.save()
                    log.write(json.dumps({"stopped_by": "SIGTERM", "step": self.step}) + "\n")
                    break
                m = self.train_step()
                bar.update(1)
                if self.step == first + 1:
                    t_second = time.time()
                elif c.time_budget_s and self.step == first + 4:
                    # Steps 2-4 (compiled by then) set the pace; a tenth of the budget stays for validation.
                    per_step = (time.time() - t_second) / 3
                    bar.total = self.fit_to_budget(per_step, 0.9 * c.time_budget_s - (time.time() - t0))
                    c = self.config
                    log.write(json.dumps({"seconds_per_step": per_step, "planned_steps": c.steps}) + "\n")
                if self.step % c.log_every == 0 or self.step == c.steps:
                    rec = {
                        "step": self.step,
                        "lr": self.scheduler.get_last_lr()[0],
                        "lams": list(c.lams),
                        "elapsed_s": round(time.time() - t0, 2),
                        **m,
                    }
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    bar.set_postfix(mse=f"{max(m['mse']):.3g}", sp=f"{min(m['sparsity']):.3f}")
                if self.step % c.val_every == 0 or self.step == c.steps:
                    v = {"step": self.step, "lams": list(c.lams), "validation": self.validate()}
                    records.append(v)
                    log.write(json.dumps(v) + "\n")
                    log.flush()
                    bar.write(json.dumps(v))
                if self.step % c.ckpt_every == 0 or self.step == c.steps:
                    self.save()
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, old_handler)
            bar.close()
            log.close()
        return records
