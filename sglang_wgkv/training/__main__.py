"""``python -m sglang_wgkv.training {corpus,train}`` -- build the offline corpus, train gates."""

import argparse
import json
import sys
from dataclasses import fields

from sglang_wgkv.training.corpus import BINS, CorpusSpec, build_corpus
from sglang_wgkv.training.trainer import GateTrainer, TrainConfig


def load_tokenizer(name: str):
    """An HF tokenizer from a directory, a ``.gguf`` file, or ``"embedded"`` (the SmolLM2 GGUF)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if name == "embedded":
        from sglang_wgkv.training.backbone import embedded_gguf_path

        name = str(embedded_gguf_path())
    path = Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_wgkv.training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("corpus", help="tokenize local text into a length-binned corpus")
    c.add_argument("--out", required=True, help="output directory (corpus.npz + manifest.json)")
    c.add_argument("--tokenizer", default="embedded", help="HF tokenizer dir, .gguf file, or 'embedded'")
    c.add_argument("--bins", type=_ints, default=BINS)
    c.add_argument("--train-rows", type=_ints, default=CorpusSpec.train_rows)
    c.add_argument("--heldout-rows", type=_ints, default=CorpusSpec.heldout_rows)
    c.add_argument("--heldout-percent", type=int, default=CorpusSpec.heldout_percent)
    c.add_argument("--source", action="append", help="'kind:glob' (repeatable; default: this machine's docs)")
    c.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("train", help="train write gates (one set per λ) against the dense model")
    t.add_argument(
        "--model", default="embedded", help="HF model dir, .gguf file, or 'embedded' (SmolLM2-135M)"
    )
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True, dest="out_dir")
    t.add_argument("--lams", type=_floats, default=TrainConfig.lams, help="comma-separated λ values")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for name in (
        "steps",
        "seq_len",
        "lr",
        "weight_decay",
        "warmup_frac",
        "local_window",
        "tau",
        "eps",
        "init_bias",
        "val_every",
        "val_rows",
        "ckpt_every",
        "log_every",
        "backend",
        "dtype",
        "device",
        "seed",
        "model_id",
        "time_budget_s",
    ):
        t.add_argument("--" + name.replace("_", "-"), type=type(defaults[name]), default=defaults[name])
    t.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="gate MLP hidden width per head (default 4 * head_dim; the authors' Qwen3 gates: 1.5 * head_dim)",
    )
    t.add_argument(
        "--grad-checkpoint",
        choices=("auto", "on", "off"),
        default="auto",
        help="per-layer gradient checkpointing (auto: off on CUDA, on elsewhere)",
    )

    args = parser.parse_args(argv)
    if args.command == "corpus":
        kw = {} if not args.source else {"sources": tuple(args.source)}
        spec = CorpusSpec(
            bins=args.bins,
            train_rows=args.train_rows,
            heldout_rows=args.heldout_rows,
            heldout_percent=args.heldout_percent,
            seed=args.seed,
            **kw,
        )
        manifest = build_corpus(load_tokenizer(args.tokenizer), spec, args.out)
        print(
            json.dumps(
                {
                    "rows": manifest["rows"],
                    "short_bins": manifest["short_bins"],
                    "documents": len(manifest["documents"]),
                },
                indent=1,
            )
        )
        return 0
    kw = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    kw["grad_checkpoint"] = {"auto": None, "on": True, "off": False}[args.grad_checkpoint]
    trainer = GateTrainer(TrainConfig(**kw))
    trainer.command = "python -m sglang_wgkv.training " + " ".join(argv if argv is not None else sys.argv[1:])
    records = trainer.fit(resume=not args.no_resume)
    if records:
        print(json.dumps(records[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
