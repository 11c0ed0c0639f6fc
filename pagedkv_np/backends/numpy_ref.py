"""The NumPy reference backend: plain, readable and bit-exact.

Every fast backend is tested against this one bit for bit. Data moves as
unsigned integers of the element's width, so values are copied as bits:
NaN payloads and signed zeros survive, and float16/bfloat16 need no support
from the array library.
"""

from __future__ import annotations

import numpy as np

from ..layout import OutputLayout, StoreLayout, bits_view_dtype
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
        page_size = k_cache.shape[2] if layout is StoreLayout.NHD else k_cache.shape[3]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].astype(np.int64)
        page_ids, offsets = slots // page_size, slots % page_size
        for store, new in ((k_cache, k), (v_cache, v)):
            dst, src = _bits(store[layer]), _bits(np.ascontiguousarray(new))[keep]
            if layout is StoreLayout.NHD:
                dst[page_ids, offsets] = src
            else:  # [page, head, offset, dim]: the head axis stays a slice
                dst[page_ids, :, offsets] = src

    def _gather(self, k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out,
                layout, out_layout):
        page_size = k_cache.shape[2] if layout is StoreLayout.NHD else k_cache.shape[3]
        for store, out in ((k_cache, k_out), (v_cache, v_out)):
            src_layer, dst = _bits(store[layer]), _bits(out)
            dst[...] = 0
            for b in range(page_table.shape[0]):
                n = int(seq_lens[b])
                if n == 0:
                    continue
                num_used = -(-n // page_size)
                pages = src_layer[page_table[b, :num_used]]
                if layout is StoreLayout.HND:
                    pages = pages.transpose(0, 2, 1, 3)  # -> [page, offset, head, dim]
                tokens = pages.reshape(num_used * page_size, *pages.shape[2:])[:n]
                if out_layout is OutputLayout.BTHD:
                    dst[b, :n] = tokens
                else:
                    dst[b, :, :n] = tokens.transpose(1, 0, 2)

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
