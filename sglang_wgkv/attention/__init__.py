"""Attention for WG-KV: torch references (test oracle and CPU path), GPU kernels, index builders."""
