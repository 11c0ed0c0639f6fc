"""The NumPy reference backend: plain, readable and bit-exact.

Every fast backend is tested against this one bit for bit. Data moves as
unsigned integers of the element's width, so values are copied as bits:
NaN payloads and signed zeros survive, and float16/bfloat16 need no support
from the array library.
"""

from __future__ import annotations

import numpy as np

from ..layout import bits_view_dtype
from ..quant import dequantize, quantize
from .base import Backend

__all__ = ["NumpyBackend"]


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(bits_view_dtype(x.dtype))


class NumpyBackend(Backend):
    """Reference implementation of :class:`~pagedkv_np.backends.base.Backend`."""

    name = "numpy"

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when usable, else the reason it is not."""
        return None

    def _write(self, k_cache, v_cache, layer, slot_mapping, k, v, layout):
        page_size = k_cache.shape[layout.offset_axis]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].astype(np.int64)
        page_ids, offsets = slots // page_size, slots % page_size
        for store, new in ((k_cache, k), (v_cache, v)):
            # a view of the layer as [page, offset, head, dim], whatever the layout
            # (swapaxes: the offset's axis is 1 or 2, and np.moveaxis costs microseconds)
            dst = _bits(store[layer]).swapaxes(1, layout.offset_axis - 1)
            dst[page_ids, offsets] = _bits(np.ascontiguousarray(new))[keep]

    def _gather(self, k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out,
                layout, out_layout):
        page_size = k_cache.shape[layout.offset_axis]
        for store, out in ((k_cache, k_out), (v_cache, v_out)):
            src_layer, dst = _bits(store[layer]), _bits(out)
            dst[...] = 0
            dst = dst.swapaxes(1, out_layout.t_axis)   # a view as [B, T, head, dim]
            for b in range(page_table.shape[0]):
                n = int(seq_lens[b])
                if n == 0:
                    continue
                num_used = -(-n // page_size)
                # -> [page, offset, head, dim]
                pages = src_layer[page_table[b, :num_used]].swapaxes(1, layout.offset_axis - 1)
                dst[b, :n] = pages.reshape(num_used * page_size, *pages.shape[2:])[:n]

    def _copy_pages(self, k_cache, v_cache, src_pages, dst_pages, layout):
        for store in (k_cache, v_cache):
            bits = _bits(store)
            bits[:, dst_pages] = bits[:, src_pages]

    def _write_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, slot_mapping, k, v,
                         layout):
        k_codes, k_scales = quantize(k)
        v_codes, v_scales = quantize(v)
        self._write(k_cache, v_cache, layer, slot_mapping, k_codes, v_codes, layout)
        self._write(k_scale, v_scale, layer, slot_mapping, k_scales, v_scales, layout)

    def _gather_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, page_table,
                          seq_lens, k_out, v_out, layout, out_layout):
        # codes and scales gathered as bits, as any store, then dequantized:
        # zero codes under zero scales past each length give +0.0
        codes = [np.empty(k_out.shape, k_cache.dtype) for _ in range(2)]
        scales = [np.empty((*k_out.shape[:3], k_scale.shape[4]), k_scale.dtype)
                  for _ in range(2)]
        self._gather(k_cache, v_cache, layer, page_table, seq_lens, *codes, layout, out_layout)
        self._gather(k_scale, v_scale, layer, page_table, seq_lens, *scales, layout, out_layout)
        for out, c, s in zip((k_out, v_out), codes, scales):
            out[...] = dequantize(c, s, out.dtype)
