"""The embedded model cut to its first layers: a cheap real model for the server tests whose property
does not depend on what the model answers (integrity, equal outputs of two paths, scheduling, memory).

The cut keeps the embedding, the first ``num_layers`` decoder layers, the final norm and the tied
head of the embedded SmolLM2-135M-Instruct, so its keys in those layers are the full model's, its
logits are far from uniform (greedy choices are not decided by rounding), and every capacity plan
in tokens is the full model's (pages, slots and budgets scale with the layer count on both sides).
A forward costs a fraction of the full model's on CPU.

=====================  ======================================================================
what                   where
=====================  ======================================================================
the model              ``<cache>/SmolLM2-135M-Instruct-<N>layers/`` beside the embedded model,
                       built once (atomic rename) from its converted directory
its gates              :class:`~sglang_wgkv.testing.server_pool.HeadGates` or
                       :class:`~sglang_wgkv.testing.server_pool.ShippedGates` with
                       ``num_layers=N`` (the shipped gates' first N layers)
=====================  ======================================================================
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sglang_wgkv.embedded_model import MODEL_NAME, cache_root, ensure_embedded_model

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHORT_LAYERS = 2  # the serving tests' cut: a forward about 5x cheaper than the full model's on CPU


@dataclass(frozen=True)
class ShortModel:
    """``--model-path`` of the embedded model's first ``num_layers`` layers (a pool server argument)."""

    num_layers: int = SHORT_LAYERS

    def __post_init__(self):
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {self.num_layers!r}")

    def as_arg(self, folder: Path) -> str:
        return str(short_model_dir(self.num_layers))


def short_model_dir(num_layers: int, cache_dir: Path | None = None) -> Path:
    """The directory of the embedded model's first ``num_layers`` layers, built on first use."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"{MODEL_NAME}-{num_layers}layers"
    if (target / "model.safetensors").is_file():
        return target
    full = ensure_embedded_model(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _cut(full, tmp, num_layers)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _cut(full: Path, out: Path, num_layers: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((full / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise ValueError(f"num_layers {num_layers} outside 1..{config['num_hidden_layers'] - 1}")
    kept = {}
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                continue
            kept[name] = f.get_tensor(name)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "num_hidden_layers": num_layers, "_model_name_or_path": f"{full.name} (first layers)"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (full / name).is_file():
            shutil.copy(full / name, out / name)
