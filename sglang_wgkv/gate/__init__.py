"""Write-Gate MLP and its checkpoint formats."""

from sglang_wgkv.gate.admission import GateOutputError, admission_flags, check_gate_output
from sglang_wgkv.gate.checkpoint import GateConfig, load_gates, load_official_pt, save_gates
from sglang_wgkv.gate.mlp import LayerGate, WriteGates

__all__ = [
    "GateOutputError",
    "admission_flags",
    "check_gate_output",
    "GateConfig",
    "LayerGate",
    "WriteGates",
    "load_gates",
    "load_official_pt",
    "save_gates",
]
