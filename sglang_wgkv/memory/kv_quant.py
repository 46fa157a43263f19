"""FP8 storage of the dual pool's keys and values: per-tensor scales, quantize once, dequantize on read.

SGLang's semantics (``MHATokenToKVPool.set_kv_buffer``, ``BaseKVCacheMethod``): each attention layer
has one ``k_scale`` and one ``v_scale`` (from the checkpoint or ``--quantization-param-path``, 1.0
otherwise); a cached value is ``fp8(x / scale)`` and reads back as ``float(stored) * scale``.

=================  ====================================  ==========================================
where              what happens to a K/V value           precision
=================  ====================================  ==========================================
ring write         :func:`quantize` (once)               rounded to FP8 (rel. error <= 2^-(m+1))
promotion, snap-   bytes copied (:func:`byte_view`)      unchanged: no second rounding
shot, compaction
attention, scores  :func:`dequantize` (float32 math)     exact (an FP8 value times a float32 scale)
new rows of an     not read from the pool: the step's    the model's dtype, as upstream's extend
extend             own K/V
=================  ====================================  ==========================================

Quantization saturates at the format's largest finite value (a value past it would become NaN in
e4m3fn): the Triton kernels' conversions saturate too, so both paths store the same bytes.
"""

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def mantissa_bits(dtype: torch.dtype) -> int:
    """Explicit mantissa bits of a floating dtype (e4m3: 3, e5m2: 2, bf16: 7, fp16: 10, fp32: 23)."""
    return {
        torch.float8_e4m3fn: 3,
        torch.float8_e5m2: 2,
        torch.bfloat16: 7,
        torch.float16: 10,
        torch.float32: 23,
    }[dtype]


def quantize(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a pool of ``dtype``: ``fp8(x / scale)`` (saturated) for FP8, a cast
    otherwise (SGLang applies no scale to an unquantized cache). ``scale``: a float or a float32
    tensor broadcastable to ``x``."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """Values read from the pool in ``dtype``: ``float(stored) * scale`` for FP8, a cast otherwise."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def byte_view(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` as raw bytes when FP8 (index and copy kernels of every device handle uint8; some
    lack float8 variants), as they are otherwise: moves through it never round."""
    return pages.view(torch.uint8) if is_fp8(pages.dtype) else pages


def gather(pages: torch.Tensor, *index) -> torch.Tensor:
    """``pages[index]`` with the pages' dtype, gathered through :func:`byte_view`; one index tensor
    through ``index_select`` (whole rows copied at once: 2.5x faster than indexing on the CPU)."""
    if len(index) == 1 and isinstance(index[0], torch.Tensor) and index[0].dtype != torch.bool:
        (idx,) = index
        flat = byte_view(pages).index_select(0, idx.reshape(-1))
        return flat.view(*idx.shape, *pages.shape[1:]).view(pages.dtype)
    return byte_view(pages)[index].view(pages.dtype)


def check_scales(scales, num_layers: int, name: str) -> list[float]:
    """``scales`` as ``num_layers`` positive finite floats; ValueError naming ``name`` otherwise."""
    values = [float(s) for s in scales]
    if len(values) != num_layers:
        raise ValueError(f"{name}: {len(values)} scales for {num_layers} layers")
    bad = [(i, s) for i, s in enumerate(values) if not (0.0 < s < float("inf"))]
    if bad:
        raise ValueError(f"{name}: scales must be positive and finite, got (layer, scale) {bad[:4]}")
    return values
