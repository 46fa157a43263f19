"""The write gate in the ``wgkv`` backend: the gates it serves (:func:`build_gates`: a checkpoint or
fresh gates, checked against the model) and their first input, the pre-RoPE key
(:class:`PreRopeKeyCapture`).

In SGLang's Llama and Qwen3 attention the pre-RoPE key exists only as a local of
``forward_prepare_native``: ``q, k, v = qkv.split(...)`` (Qwen3: then ``apply_qk_norm``), then
``q, k = self.rotary_emb(positions, q, k)``, which on CUDA rotates ``k`` in place. A dotted-path hook
(HookRegistry) cannot reach that local, so a forward pre-hook on each attention module's
``rotary_emb`` copies ``k`` just before the rotation; the next ``wgkv`` attention call (same layer:
RadixAttention runs right after the rotation) takes it. SGLang caches rotary modules, so several
layers may share one module; one hook per distinct module suffices since layers run in order.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_wgkv.gate import GateConfig, WriteGates, load_gates
from sglang_wgkv.gate.checkpoint import check_served_window
from sglang_wgkv.integration.plugin.settings import ServingSettings
from sglang_wgkv.memory.wide_copy import wide_clone


def build_gates(
    settings: ServingSettings,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    device,
    heads: list[int] | None = None,
) -> WriteGates:
    """The checkpoint at ``settings.gates_path`` or fresh (admit-all) gates; checked against the model
    (``num_kv_heads``: all of its KV heads) and the served W_local, then cut to ``heads`` (a
    tensor-parallel rank's) if given.

    Raises ValueError naming the file and the mismatch.
    """
    config = settings.config
    if settings.gates_path is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            gates = WriteGates(
                GateConfig(
                    num_layers=num_layers,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    tau=config.tau,
                    local_window=config.local_window,
                )
            )
    else:
        gates = load_gates(settings.gates_path)
        check_served_window(settings.gates_path, gates.config, config.local_window)
        try:
            gates.check_model(num_layers, num_kv_heads, head_dim)
        except ValueError as e:
            raise ValueError(f"{settings.gates_path}: {e}") from e
    if heads is not None and list(heads) != list(range(num_kv_heads)):
        gates = gates.select_heads(heads)
    return gates.to(device).eval().requires_grad_(False)


class PreRopeKeyCapture:
    """Holds the pre-RoPE key of the layer being executed.

    Usage: :meth:`install` once after the model is loaded; the attention backend calls
    :meth:`take` once per layer forward.
    """

    def __init__(self):
        self._key: torch.Tensor | None = None
        self._handles = []

    @classmethod
    def install(cls, model: nn.Module) -> PreRopeKeyCapture:
        """Hook every ``rotary_emb`` owned by a module that also owns an ``attn`` (RadixAttention).

        Raises ValueError if the model has no such attention module (unsupported architecture).
        """
        capture = cls()
        seen = set()
        for module in model.modules():
            rope = getattr(module, "rotary_emb", None)
            if isinstance(rope, nn.Module) and hasattr(module, "attn") and id(rope) not in seen:
                seen.add(id(rope))
                capture._handles.append(rope.register_forward_pre_hook(capture._on_rope, with_kwargs=True))
        if not capture._handles:
            raise ValueError(
                f"{type(model).__name__}: no attention module with a `rotary_emb` submodule; the wgkv "
                "backend supports Llama- and Qwen3-style attention"
            )
        return capture

    def _on_rope(self, module, args, kwargs):
        key = args[2] if len(args) > 2 else kwargs["key"]
        self._key = wide_clone(key)

    def take(self, k_post: torch.Tensor) -> torch.Tensor:
        """The captured pre-RoPE key, shaped like ``k_post`` (``[T, H*D]``); clears the slot."""
        key, self._key = self._key, None
        if key is None:
            raise RuntimeError("no pre-RoPE key captured before this attention call")
        if key.numel() != k_post.numel():
            raise RuntimeError(
                f"captured pre-RoPE key has {key.numel()} elements, attention got {k_post.numel()}"
            )
        return key.view_as(k_post)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
