"""sglang_wgkv: Write-Gated KV (learned KV-cache admission) inside SGLang.

Engine-agnostic core (no sglang import): ``gate`` (Write-Gate MLP, checkpoints), ``memory`` (page
allocator, dual-cache pool), ``attention`` (torch references, kernels). SGLang glue lives in
``integration`` and in the top-level ``radix_ext`` package only.
"""

from sglang_wgkv.config import WGKVConfig

__all__ = ["WGKVConfig"]
__version__ = "0.1.0"
