"""Which ``--kv-cache-dtype`` the dual pool serves, and on which attention path.

=====================  ==========================  =============================================
--kv-cache-dtype       pool pages                  attention paths
=====================  ==========================  =============================================
auto / bf16 / fp16 /   the model's dtype (or the   every path
bfloat16 / float32     one named)
fp8_e4m3 / fp8_e5m2    float8_e4m3fn / float8_e5m2  every path: the torch reference (any device),
                       (per-layer k/v scales,      the kernels path's decode, prefill and opt-in
                       :mod:`..memory.kv_quant`)   Triton extend launches (dequantized in registers)
=====================  ==========================  =============================================

Everything else SGLang offers (``mxfp8``, ``nvfp4``, ...) is refused: the pool has no block-scaled
layout.
"""

from __future__ import annotations

# (names only: the launcher and SGLang's plugin hooks read this module before torch is needed; the
# dtypes are memory.kv_quant's)
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "float16", "float32")
SERVED_KV_CACHE_DTYPES = UNQUANTIZED_KV_CACHE_DTYPES + tuple(FP8_KV_CACHE_DTYPES)


def kv_cache_dtype_problem(kv_cache_dtype: str | None) -> str | None:
    """Why ``--kv-cache-dtype kv_cache_dtype`` cannot be served, or None."""
    if kv_cache_dtype is None or kv_cache_dtype in UNQUANTIZED_KV_CACHE_DTYPES:
        return None
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        return f"--kv-cache-dtype {kv_cache_dtype} (the dual pool stores {', '.join(SERVED_KV_CACHE_DTYPES)})"
    return None


def layer_scale(layer, name: str) -> float:
    """SGLang's per-tensor ``k`` / ``v`` scale of one ``RadixAttention`` layer: ``{name}_scale_float``
    once a quantization method processed the checkpoint's scale, else ``{name}_scale`` (a float set
    by ``--quantization-param-path``, or a tensor still at its unset -1.0), 1.0 where none is set."""
    value = getattr(layer, f"{name}_scale_float", None)
    if value is None:
        value = getattr(layer, f"{name}_scale", None)
    value = 1.0 if value is None else float(value)
    return value if value > 0 else 1.0


def model_kv_scales(model, num_layers: int) -> tuple[list[float], list[float]]:
    """``(k_scale, v_scale)`` per layer id of ``model``'s ``RadixAttention`` layers (1.0 where a layer
    has none)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    k, v = [1.0] * num_layers, [1.0] * num_layers
    for module in model.modules():
        if isinstance(module, RadixAttention) and 0 <= module.layer_id < num_layers:
            k[module.layer_id] = layer_scale(module, "k")
            v[module.layer_id] = layer_scale(module, "v")
    return k, v
