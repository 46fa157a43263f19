"""The write gates the ``wgkv`` backend serves: a checkpoint or fresh gates, checked against the model."""

import torch

from sglang_wgkv.gate import GateConfig, WriteGates, load_gates
from sglang_wgkv.gate.checkpoint import check_served_window
from sglang_wgkv.integration.settings import ServingSettings


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
