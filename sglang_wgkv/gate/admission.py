"""From gate values to admission flags."""

import torch


class GateOutputError(ValueError):
    pass


def check_gate_output(g: torch.Tensor, layer_id: int | None = None) -> None:
    """Raise GateOutputError if ``g`` holds NaN or values outside [0, 1] (syncs: use off the decode path)."""
    bad = ~((g >= 0) & (g <= 1))  # NaN compares False
    if bool(bad.any()):
        where = f" in layer {layer_id}" if layer_id is not None else ""
        raise GateOutputError(f"write gate produced {int(bad.sum())} NaN/out-of-range values{where}; "
                              "the gate checkpoint or the model's keys are broken")


def admission_flags(g: torch.Tensor, tau: float, random_admission: float | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``g >= tau`` (bool, same shape), or Bernoulli(``random_admission``) flags for profiling runs
    (the paper's protocol: the gate is still computed, its decision replaced)."""
    if random_admission is None:
        return g >= tau
    return torch.rand(g.shape, device=g.device, generator=generator) < random_admission
