"""The tile products of :mod:`pagedkv_np.backends.block_q8_tiles` in plain Numba loops.

:func:`tile_portable` computes what the IR kernel of
:mod:`.block_q8_tiles_ir` computes for one tile, in the order
:mod:`.block_q8_tiles` documents, on any CPU: the product where the host
lacks AVX2, and the second opinion its tests compare the IR kernel with.
"""

from __future__ import annotations

import numpy as np

from .block_q8 import float32_of
from .block_q8_tiles_ir import TILE
from .jit import jit_kernel

__all__ = ["tile_portable"]


@jit_kernel
def tile_portable(codes, scales, terms, q, d, dq, bits, t, m, rows, scratch):
    """Writes ``scratch[r, :16]``, the outputs of tile ``t`` for the quantized
    row ``m + r``, ``r < rows``, as the IR kernel does (the same bits)."""
    half = d.shape[1] * 16 == q.shape[1]        # blocks of 16: each half a block
    num_blocks = d.shape[1] // 2 if half else d.shape[1]
    for r in range(rows):
        for j in range(TILE):
            acc = np.float32(0.0)
            for b in range(num_blocks):
                if half:
                    acc = acc + _unit(codes, scales, terms, q, d, dq, bits, t, m + r, j, b, 0,
                                      16, 2 * b)
                    acc = acc + _unit(codes, scales, terms, q, d, dq, bits, t, m + r, j, b, 16,
                                      32, 2 * b + 1)
                else:
                    acc = acc + _unit(codes, scales, terms, q, d, dq, bits, t, m + r, j, b, 0,
                                      32, b)
            scratch[r, j] = acc


@jit_kernel
def _unit(codes, scales, terms, q, d, dq, bits, t, row, j, b, lo, hi, unit):
    """The value of inputs ``lo .. hi - 1`` of the 32 whose codes are block
    ``b`` of tile ``t``, output ``j``, row ``row``, with the scale, term and
    row scales of block ``unit`` (``b``, or a half's ``2b + h``)."""
    group = 64 * bits
    p = 0
    for i in range(lo, hi):
        if bits != 8:
            g, within = i // 8, i % 8
            byte = np.int64(codes[t, b * group + 64 * g + 4 * j + within % 4])
            code = byte >> 4 if within >= 4 else byte & 15
            if bits == 5:
                bit = 4 * j + within % 4
                mask = codes[t, b * group + 256 + 8 * (2 * g + within // 4) + bit // 8]
                code += 16 * ((np.int64(mask) >> (bit % 8)) & 1)
        else:
            code = np.int64(codes[t, b * group + 64 * (i // 4) + 4 * j + i % 4])
        p += code * np.int64(q[row, 32 * b + i])
    at = unit * TILE + j
    v = (float32_of(scales[t, at]) * d[row, unit]) * np.float32(p)
    if terms.shape[1] != 0:
        v = v + float32_of(terms[t, at]) * dq[row, unit]
    return v
