"""One decode step's rows as every layer of the ``wgkv`` backend reads them, and the request slot that
pads CUDA-graph batches."""

from dataclasses import dataclass

import torch

# SGLang's request row 0 pads CUDA-graph batches and is never allocated to a request.
SCRATCH_SLOT = 0


@dataclass
class DecodeRows:
    """One decode step's rows, read by every layer (views of static buffers under CUDA graphs).

    req, pos : ``[B]`` int64 request slot and position of the token being decoded;
    ring : ``[B]`` int64 ring tokens after this step's write (``min(pos + 1, W)``);
    tau : ``[B, 1]`` float32 admission threshold; uniform : ``[B, L, H]`` random-admission draws or None;
    num_splits, workspace : :func:`folded_decode` launch parameters (kernels path);
    gate_splits : slices of the gate's hidden width per (row, head) (:class:`DecodeGate`, kernels path).
    """

    req: torch.Tensor
    pos: torch.Tensor
    ring: torch.Tensor
    tau: torch.Tensor
    uniform: torch.Tensor | None
    num_splits: int | None = None
    workspace: object = None
    gate_splits: int = 1
