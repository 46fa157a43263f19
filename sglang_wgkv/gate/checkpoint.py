"""Gate checkpoints: our format (safetensors + JSON config) and the authors' released ``.pt`` files.

Our format is a directory holding ``gates.safetensors`` (keys ``layers.{i}.{param}``) and
``gates.json`` (a :class:`GateConfig`). Files written before the hidden width was stored carry
``"expand": E`` instead of ``"hidden"``; they are read as ``hidden = E * head_dim``.

The authors' released files come in two layouts that differ only in the hidden width I: the Llama
gates use I = 4 * head_dim, the Qwen3 gates I = 1.5 * head_dim (192 for head_dim 128). I is therefore
stored as a width, never as an integer multiple of head_dim.
"""

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from sglang_wgkv.config import DEFAULT_LOCAL_WINDOW, DEFAULT_TAU

WEIGHTS_FILE = "gates.safetensors"
CONFIG_FILE = "gates.json"
_OFFICIAL_PREFIX = "model.layers.{i}.self_attn.g_predictors."
# Hidden width of a gate built without one, as a multiple of head_dim (the Llama layout's).
DEFAULT_EXPAND = 4


@dataclass(frozen=True)
class GateConfig:
    """Shape and training metadata of a set of gates (one :class:`LayerGate` per layer).

    ``hidden``: the MLP's hidden width I per head (``None``: the default ``4 * head_dim``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden: int | None = None
    tau: float = DEFAULT_TAU
    local_window: int = DEFAULT_LOCAL_WINDOW
    lam: float = 0.0
    model_id: str = ""
    eps: float = 1e-6

    def __post_init__(self):
        if self.hidden is None:
            object.__setattr__(self, "hidden", DEFAULT_EXPAND * self.head_dim)
        for name in ("num_layers", "num_kv_heads", "head_dim", "hidden", "local_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GateConfig.{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "GateConfig":
        """From a ``gates.json`` dict; an older file's ``expand`` becomes ``hidden = expand * head_dim``."""
        known = {f.name for f in fields(cls)}
        missing = {"num_layers", "num_kv_heads", "head_dim"} - d.keys()
        if missing:
            raise ValueError(f"gate config is missing {sorted(missing)}")
        d = dict(d)
        if "expand" in d:
            expand = d.pop("expand")
            if not isinstance(expand, int) or isinstance(expand, bool) or not isinstance(d["head_dim"], int):
                raise ValueError(f"gate config: expand must be an integer, got {expand!r}")
            hidden = expand * d["head_dim"]
            if d.setdefault("hidden", hidden) != hidden:
                raise ValueError(
                    f"gate config: hidden {d['hidden']} contradicts expand {expand} x "
                    f"head_dim {d['head_dim']}"
                )
        return cls(**{k: v for k, v in d.items() if k in known})


def save_gates(
    gates, path: str | Path, dtype: torch.dtype = torch.float32, training: dict | None = None
) -> Path:
    """Write ``gates`` (a WriteGates) to directory ``path``; returns the directory.

    ``dtype`` is the storage type (float16 halves shipped files); loading always returns float32.
    ``training`` (the command and settings that made them) is kept in ``gates.json`` under "training";
    loading ignores it.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"layers.{i}.{n}": p.detach().to(dtype).cpu().contiguous()
        for i, layer in enumerate(gates.layers)
        for n, p in layer.named_parameters()
    }
    save_file(tensors, str(path / WEIGHTS_FILE))
    meta = asdict(gates.config) | ({"training": training} if training else {})
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def load_gates(path: str | Path, device="cpu"):
    """Load gates from our directory format or from an official ``.pt`` file.

    Raises ValueError (with the file and the reason) on a missing, corrupt or inconsistent file.
    """
    from sglang_wgkv.gate.mlp import WriteGates

    path = Path(path)
    if path.is_file() and path.suffix in (".pt", ".pth", ".bin"):
        return load_official_pt(path, device=device)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"{path}: not a gate checkpoint (need {WEIGHTS_FILE} and {CONFIG_FILE}, or a .pt file)"
        )
    try:
        config = GateConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path / CONFIG_FILE}: corrupt gate config ({e})") from e
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path / WEIGHTS_FILE}: corrupt gate weights ({e})") from e
    gates = WriteGates(config)
    _load_state(gates, tensors, str(path))
    return gates.to(device)


def _load_state(gates, tensors: dict, source: str) -> None:
    expected = gates.state_dict()
    extra = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if extra or missing:
        raise ValueError(
            f"{source}: gate tensors do not match the config: missing {missing[:4]}, unexpected {extra[:4]}"
        )
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(ref.shape)}"
            )
        if not torch.isfinite(tensors[name]).all():
            raise ValueError(f"{source}: {name} holds non-finite values")
    gates.load_state_dict({k: v.float() for k, v in tensors.items()})


def check_served_window(path: str | Path, config: GateConfig, local_window: int) -> None:
    """Raise ValueError, naming both numbers, when gates of our format trained with one W_local would
    be served with another (the gate learned which tokens to keep once they leave *that* window).
    The authors' ``.pt`` files record no window, so they are not checked."""
    if Path(path).is_dir() and config.local_window != local_window:
        raise ValueError(
            f"{path}: gates trained with W_local = {config.local_window} cannot be served with "
            f"W_local = {local_window} (--wgkv-local-window {local_window}); serve them with "
            f"--wgkv-local-window {config.local_window} or use gates trained for {local_window}"
        )


def load_official_pt(
    path: str | Path,
    device="cpu",
    tau: float = DEFAULT_TAU,
    local_window: int = DEFAULT_LOCAL_WINDOW,
    model_id: str = "",
):
    """Load the authors' released gate file (grouped 1x1 convs per layer) into WriteGates.

    Layer i holds ``pre_key_norm.weight [D]``, ``post_key_norm.weight [D]``,
    ``conv1.weight [H*I, 2D, 1]``, ``conv1.bias [H*I]``, ``conv2.weight [H, I, 1]``, ``conv2.bias [H]``;
    head h reads input channels ``h*2D .. (h+1)*2D-1`` (pre-RoPE key first) and owns hidden channels
    ``h*I .. (h+1)*I-1``. I is read from ``conv2.weight``: 4*D in the Llama files, 1.5*D in the Qwen3 ones.
    """
    from sglang_wgkv.gate.mlp import WriteGates

    path = Path(path)
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a truncated/corrupt zip or pickle
        raise ValueError(f"{path}: cannot read gate file ({type(e).__name__}: {e})") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, found {type(state).__name__}")
    num_layers = 0
    while (_OFFICIAL_PREFIX.format(i=num_layers) + "conv2.bias") in state:
        num_layers += 1
    if num_layers == 0:
        raise ValueError(f"{path}: no '{_OFFICIAL_PREFIX.format(i=0)}*' keys found")
    p0 = _OFFICIAL_PREFIX.format(i=0)
    head_dim = state[p0 + "pre_key_norm.weight"].shape[0]
    num_heads, inner = state[p0 + "conv2.weight"].shape[:2]
    config = GateConfig(
        num_layers=num_layers,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        hidden=int(inner),
        tau=tau,
        local_window=local_window,
        model_id=model_id,
    )
    tensors = {}
    for i in range(num_layers):
        p = _OFFICIAL_PREFIX.format(i=i)
        try:
            c1w, c1b = state[p + "conv1.weight"], state[p + "conv1.bias"]
            c2w, c2b = state[p + "conv2.weight"], state[p + "conv2.bias"]
            pre, post = state[p + "pre_key_norm.weight"], state[p + "post_key_norm.weight"]
        except KeyError as e:
            raise ValueError(f"{path}: layer {i} lacks {e.args[0]}") from e
        want = {
            "conv1.weight": (num_heads * inner, 2 * head_dim, 1),
            "conv1.bias": (num_heads * inner,),
            "conv2.weight": (num_heads, inner, 1),
            "conv2.bias": (num_heads,),
        }
        for name, t in (
            ("conv1.weight", c1w),
            ("conv1.bias", c1b),
            ("conv2.weight", c2w),
            ("conv2.bias", c2b),
        ):
            if tuple(t.shape) != want[name]:
                raise ValueError(
                    f"{path}: layer {i} {name} has shape {tuple(t.shape)}, expected {want[name]}"
                )
        tensors[f"layers.{i}.pre_norm"] = pre
        tensors[f"layers.{i}.post_norm"] = post
        tensors[f"layers.{i}.w1"] = c1w[..., 0].reshape(num_heads, inner, 2 * head_dim).transpose(1, 2)
        tensors[f"layers.{i}.b1"] = c1b.reshape(num_heads, inner)
        tensors[f"layers.{i}.w2"] = c2w[..., 0]
        tensors[f"layers.{i}.b2"] = c2b
    gates = WriteGates(config)
    _load_state(gates, {k: v.contiguous() for k, v in tensors.items()}, str(path))
    return gates.to(device)


def gate_bias_init(prob: float) -> float:
    """Logit of ``prob``: an output bias that makes a fresh gate admit with that probability."""
    return math.log(prob / (1 - prob))
