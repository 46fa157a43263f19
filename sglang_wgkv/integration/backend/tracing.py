"""Named spans of a forward's host work in a torch-profiler trace."""

import contextlib

import torch


def traced(name: str):
    """A named span in a torch-profiler trace (``/start_profile``) and nothing otherwise: the host
    time of each part of a forward reads from the trace (``benchmarks/trace_summary.py``)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
