"""The FP8 scales of :class:`~sglang_wgkv.memory.dual_pool.DualCachePool`: set once, read by every
dequantizing read (:mod:`~sglang_wgkv.memory.kv_quant` for the rounding rules).

A part of the pool (a base class of ``DualCachePool``): it reads and writes only the pool's own state,
``k_scale`` / ``v_scale`` ``[L]`` float32 device tensors declared in :mod:`~sglang_wgkv.memory.dual_pool`.
"""

import torch

from sglang_wgkv.memory.kv_quant import check_scales, dequantize


class KVScales:
    """``set_kv_scales`` once, before any page is written; ``read_keys`` / ``read_values`` turn stored
    keys and values back into values."""

    def set_kv_scales(self, k_scale, v_scale) -> None:
        """The per-layer scales (``[L]`` floats, SGLang's layer ``k_scale`` / ``v_scale``) of an FP8
        pool; only while it holds no page (stored bytes are relative to the scales they were written
        with)."""
        if not self.quantized:
            raise ValueError(f"a {self.dtype} pool applies no KV scales")
        k = check_scales(k_scale, self.num_layers, "k_scale")
        v = check_scales(v_scale, self.num_layers, "v_scale")
        if self.num_free_pages() != self.allocator.num_pages:
            raise RuntimeError("KV scales can only be set while the pool holds no page")
        self.k_scale.copy_(torch.tensor(k, dtype=torch.float32))
        self.v_scale.copy_(torch.tensor(v, dtype=torch.float32))

    def read_keys(self, stored: torch.Tensor, layer, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Keys gathered from :attr:`k_pages` (``[..., D]``) as values in ``dtype`` (default
        :attr:`compute_dtype`); ``layer``: an int, or an ``[S]`` tensor of the layer of each leading
        row."""
        return dequantize(
            stored, self._layer_scale(self.k_scale, layer, stored.dim()), dtype or self.compute_dtype
        )

    def read_values(self, stored: torch.Tensor, layer, dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`read_keys` for values (:attr:`v_pages`, ``v_scale``)."""
        return dequantize(
            stored, self._layer_scale(self.v_scale, layer, stored.dim()), dtype or self.compute_dtype
        )

    @staticmethod
    def _layer_scale(scales: torch.Tensor, layer, ndim: int) -> torch.Tensor:
        if isinstance(layer, torch.Tensor):
            return scales[layer].view(-1, *([1] * (ndim - 1)))
        return scales[layer]
