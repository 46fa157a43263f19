"""A device copy between tensors of one 16-bit (or 8-bit) dtype, moved as 8-byte words.

A key or value of a layer is a strided view of the fused QKV rows: torch copies such a view element by
element (its vectorized copy wants contiguous tensors), two bytes at a time. Viewed as int64 the same
copy moves a quarter as many elements (the pre-RoPE key's copy and the two staging copies each took
about 23 us a layer at 8,192 tokens, 1.4 TB/s: ``launch/results/served_speed/M1D_M1P_h100_knee4``).
"""

import torch


def as_words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as int64 (8-byte words), or None where it cannot be (its last dim not contiguous,
    or its bytes, the other strides' or the offset's not multiples of 8)."""
    if t.element_size() >= 8:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


def wide_copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` (same shape and dtype), as 8-byte words where both tensors allow it; ``dst``."""
    if dst.shape == src.shape and dst.dtype == src.dtype:
        wide_dst, wide_src = as_words(dst), as_words(src)
        if wide_dst is not None and wide_src is not None:
            wide_dst.copy_(wide_src)
            return dst
    return dst.copy_(src)


def wide_clone(src: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``src`` (:func:`wide_copy_`)."""
    return wide_copy_(torch.empty(src.shape, dtype=src.dtype, device=src.device), src)
