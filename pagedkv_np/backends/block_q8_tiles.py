"""int8-activation products with a weight packed in tiles of 16 outputs.

:func:`q8_tiled_matmul` computes ``x @ w`` as
:func:`~pagedkv_np.backends.block_q8.q8_matmul` does (each row's inputs
rounded to int8 per block of 32 first, by the same
:func:`~pagedkv_np.backends.block_q8.q8_quantize_row`, in input order), for
weights of 4 or 8 bits in blocks of 32 (8-bit codes all below 32, such as
Q5_0's, packed as 5 bits) or 8 bits in blocks of 16 (Q6_K's: rows rounded
per 16, the codes packed as for blocks of 32, each half of 16 inputs then a
block of its own below), from a copy of the weight packed so
that 16 outputs sit side by side (:func:`q8_tiles`, made once per weight
object): one vector holds the 16 outputs' sums, so no output ends in a
horizontal sum of lanes, and a group of 4 int8 inputs (one 32-bit word) is
multiplied with 16 outputs' codes by one instruction (``vpdpbusd``, see
:mod:`.block_q8_tiles_ir`). It is the decode step's product (M = 1) where a
weight packs; row ``m``'s outputs depend on ``x[m]`` only, bit for bit,
whatever ``M``, the thread count or the tile of rows it lands in.

The packing, per tile ``t`` of outputs ``16t .. 16t + 15`` (the last tile
padded with zero codes, scales and terms) and block ``b``:

* ``codes[t]``: per block, 4-bit codes as 4 groups ``g`` of 64 bytes, output
  ``j``'s 4 bytes at ``64g + 4j``, byte ``i`` holding the codes of inputs
  ``32b + 8g + i`` (low nibble) and ``32b + 8g + 4 + i`` (high); 8-bit codes
  as 8 groups of 64 bytes, byte ``i`` of output ``j`` the code of input
  ``32b + 4g + i``; 5-bit codes as the 4-bit groups of their low 4 bits, then
  8 masks of 64 bits, mask ``2g + h`` (little-endian) holding at bit ``4j +
  i`` the fifth bit of the code whose low bits are in nibble ``h`` (0 low, 1
  high) of byte ``64g + 4j + i``: 320 bytes a block;
* ``scales[t]``: per block, the 16 outputs' scales;
* ``terms[t]``: per block, the 16 outputs' ``c = offset - scale *
  float(zero)`` (without offsets ``c = -(scale * float(zero))``), rounded to
  float32 once at packing; none when every ``c`` is 0;
* scales and terms are kept as float16 bit patterns where float16 holds every
  value exactly (the GGUF types' ``d`` and ``m`` are float16), else float32.

The product, per output ``n`` and row ``m``, float32 with one rounding per
operation (no fused multiply-add), ``d``, ``dq`` the row's block scales and
scaled sums (:func:`~pagedkv_np.backends.block_q8.q8_quantize_row`):

* ``acc = 0``; per block ``b`` in order: ``P`` the exact integer sum of
  ``code * q`` over the block's 32 inputs (codes unsigned as stored), the
  block's value ``v = (scale_nb * d_mb) * float(P)``, with terms ``v = v +
  c_nb * dq_mb``, then ``acc = acc + v``; ``out = acc``. (The zero point and
  offset cancel most of a block's code sum, so adding them per block keeps
  the accumulator near the result: SmolLM2's body, against a separate sum of
  the terms added at the end, moved NLL within the noise of the float order,
  see README "Decode".)

As in :func:`~pagedkv_np.backends.block_q8.q8_matmul`, ``c * dq`` carries the
zero point and the offset: ``sum_i (code_i - zero) scale d q_i + offset
sum_i d q_i = scale d sum code q + (offset - scale zero) dq``; it differs from
that function's order by the rounding of ``c`` and of the sums, within its
error bound.

:func:`q8x2_tiled_matmul` rounds each row twice, for products that want
float32's accuracy at int8's speed (the engine's LM head): ``x`` to int8
per block as above (``q1``, ``d1``), then what that left, ``r = x - d1 *
float(q1)`` (float32, one rounding each), the same way; ``out = y(x) +
y(r)``, each ``y`` the product above, one float32 addition. Both rows share
one pass over the codes (two dot instructions per group of 64 bytes), so it
costs about what the int8 product costs where reading the weight bounds it,
while its error is that of rounding ``r`` (at most 1/254 of int8's): on
Gemma 3 270M's 262,144 x 640 Q8_0 head and a random row, the largest error
2.2e-5 of the largest logit, against 6.0e-3 for int8 and 1.2e-7 for exact
float32 (:func:`~pagedkv_np.backends.block_gemv.block_matmul`).

One thread, M = 1, SmolLM2-135M Q4_1 shapes and its Q8_0 head, against
:func:`~pagedkv_np.backends.block_q8.q8_matmul` in the same process: see
``scripts/bench_block_q8.py``.
"""

from __future__ import annotations

import dataclasses
import weakref

import numba
import numpy as np
from numba import prange

from .block_gemv import BlockWeight, product_operands
from .block_q8 import HAS_AVX2, q8_quantize
from .block_q8_tiles_ir import TILE, q8_tile_intrinsic
from .block_q8_tiles_loops import tile_portable
from .jit import jit_kernel

__all__ = ["TILED_CHUNKS", "Q8Tiles", "packs", "q8_tiles", "q8_tiled_matmul",
           "q8_tiled_product", "q8_tiled_gemm", "q8_tiled_gemm_portable",
           "q8x2_tiled_matmul", "q8x2_tiled_product"]

#: chunks of tiles per thread in a parallel product: 2, where 16 (as
#: :func:`~pagedkv_np.backends.block_q8.q8_matmul`) took SmolLM2's body 15%
#: longer on 2 threads (a chunk is a few microseconds of work here)
TILED_CHUNKS = 2
_NO_TERMS = np.zeros((0, 0), np.float32)


@dataclasses.dataclass(frozen=True)
class Q8Tiles:
    """A weight packed for :func:`q8_tiled_product` (see the module docstring).

    Attributes
    ----------
    bits : int
        4, 5 or 8: the packing (a weight of 8 bits whose codes are all below
        32 packs as 5).
    in_features, out_features : int
    codes : ndarray, shape [tiles, 2 * K * bits], uint8
    scales : ndarray, shape [tiles, K // block_size * 16], float32 or uint16
    terms : ndarray, shape [tiles, K // block_size * 16], float32 or uint16, or [0, 0]
    block_size : int
        32, or 16 (8 bits: a scale and term per half of each 32 inputs' codes)
    """

    bits: int
    in_features: int
    out_features: int
    codes: np.ndarray
    scales: np.ndarray
    terms: np.ndarray
    block_size: int = 32


# id(weight) -> its tiles; an entry leaves with its weight
_TILES_BY_ID: dict[int, Q8Tiles] = {}


def packs(w: BlockWeight) -> bool:
    """Whether ``w`` packs in tiles: 4 or 8 bits in blocks of 32, or 8 bits in
    blocks of 16 (Q6_K as imported) with inputs a multiple of 32."""
    return (w.block_size == 32 and w.bits in (4, 8)) or \
        (w.block_size == 16 and w.bits == 8 and w.in_features % 32 == 0)


def q8_tiles(w: BlockWeight) -> Q8Tiles:
    """``w`` packed in tiles, made once per weight object and remembered while
    it lives (do not change its arrays in place after the first use).

    Raises
    ------
    ValueError
        ``w`` does not pack (:func:`packs`).
    """
    found = _TILES_BY_ID.get(id(w))
    if found is not None:
        return found
    if not packs(w):
        raise ValueError(f"Invalid weight for tiles: needs 4 or 8 bits in blocks of 32 (or 8 "
                         f"in blocks of 16, inputs a multiple of 32), got {w.bits} bits in "
                         f"blocks of {w.block_size}")
    n, k = w.out_features, w.in_features
    blocks, tiles = k // 32, -(-n // TILE)
    if w.bits == 4:
        values = np.empty((n, k), np.uint8)
        values[:, 0::2] = w.codes & 15
        values[:, 1::2] = w.codes >> 4
    else:
        values = w.codes
    padded = np.zeros((tiles * TILE, blocks, 32), np.uint8)
    padded[:n] = values.reshape(n, blocks, 32)
    bits = 5 if w.bits == 8 and w.block_size == 32 and int(values.max(initial=0)) < 32 \
        else w.bits
    if bits == 8:
        codes = padded.reshape(tiles, TILE, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    else:
        groups = (padded & 15).reshape(tiles, TILE, blocks, 4, 2, 4)
        packed = groups[..., 0, :] | (groups[..., 1, :] << 4)   # [t, j, b, g, i]
        codes = packed.transpose(0, 2, 3, 1, 4)
    if bits == 5:
        fifth = (padded >> 4).reshape(tiles, TILE, blocks, 4, 2, 4)   # [t, j, b, g, h, i]
        masks = np.packbits(fifth.transpose(0, 2, 3, 4, 1, 5).reshape(tiles, blocks, 8, 64),
                            axis=-1, bitorder="little")
        codes = np.concatenate([codes.reshape(tiles, blocks, 256),
                                masks.reshape(tiles, blocks, 64)], axis=2)
    zero = w.zeros.astype(np.float32)
    product = w.scales * zero
    c = (w.offsets - product) if w.offsets is not None else -product
    tiled = Q8Tiles(bits, k, n, np.ascontiguousarray(codes).reshape(tiles, -1),
                    _lanes(w.scales, tiles), _lanes(c, tiles) if c.any() else _NO_TERMS,
                    w.block_size)
    key = id(w)
    _TILES_BY_ID[key] = tiled
    weakref.finalize(w, _TILES_BY_ID.pop, key, None)
    return tiled


def _lanes(a: np.ndarray, tiles: int) -> np.ndarray:
    """``[N, blocks]`` float32 as ``[tiles, blocks * 16]``, the 16 outputs of a
    tile side by side per block, as float16 bit patterns where exact."""
    n, blocks = a.shape
    padded = np.zeros((tiles * TILE, blocks), np.float32)
    padded[:n] = a
    out = np.ascontiguousarray(padded.reshape(tiles, TILE, blocks).transpose(0, 2, 1))
    with np.errstate(over="ignore"):
        half = out.astype(np.float16)
    if np.array_equal(half.astype(np.float32), out, equal_nan=True):
        return half.view(np.uint16).reshape(tiles, -1)
    return out.reshape(tiles, -1)


def q8_tiled_matmul(x: np.ndarray, weight: BlockWeight, out: np.ndarray | None = None
                    ) -> np.ndarray:
    """``x @ w`` with ``x`` rounded to int8 per block, from ``w``'s tiles (see
    the module docstring).

    Parameters
    ----------
    x : ndarray, shape [M, K], float32
    weight : BlockWeight
        4 or 8 bits in blocks of 32.
    out : ndarray, shape [M, N], float32, C-contiguous, optional

    Raises
    ------
    DTypeError, ShapeError
        As :func:`~pagedkv_np.backends.block_q8.q8_matmul`.
    ValueError
        The weight does not pack.
    """
    return _tiled_call(q8_tiled_product, x, weight, out)


def _tiled_call(product, x: np.ndarray, weight: BlockWeight, out: np.ndarray | None
                ) -> np.ndarray:
    """``product(x, tiles, threads, out)`` after the checks, on Numba's thread
    count, in chunks of one."""
    w, x, out = product_operands(x, weight, out)
    tiles = q8_tiles(w)
    if x.shape[0] == 0:
        return out
    before = numba.set_parallel_chunksize(1)
    try:
        product(x, tiles, numba.get_num_threads(), out)
    finally:
        numba.set_parallel_chunksize(before)
    return out


def q8_tiled_product(x: np.ndarray, tiles: Q8Tiles, threads: int, out: np.ndarray) -> None:
    """:func:`q8_tiled_matmul` without its checks: ``x`` C-contiguous float32
    ``[M, K]``, ``out`` C-contiguous float32 ``[M, N]``; ``threads`` 1 runs on
    the calling thread, more split the tiles into :data:`TILED_CHUNKS` chunks
    per thread (best under ``numba.set_parallel_chunksize(1)``). Same bits
    either way."""
    chunks = 0 if threads <= 1 else min(tiles.codes.shape[0], threads * TILED_CHUNKS)
    _matmul(x, tiles.codes, tiles.scales, tiles.terms, tiles.bits, chunks, out)


_KERNELS = {(bits, rows, terms): q8_tile_intrinsic(bits, rows, terms)
            for bits in (4, 5, 8) for rows in (1, 2, 4) for terms in (False, True)}
_KERNELS.update({(16, rows, terms): q8_tile_intrinsic(8, rows, terms, halves=True)
                 for rows in (1, 2, 4) for terms in (False, True)})
_k4_1, _k4_1t, _k4_2, _k4_2t, _k4_4, _k4_4t = (_KERNELS[4, r, t] for r in (1, 2, 4)
                                                for t in (False, True))
_k5_1, _k5_1t, _k5_2, _k5_2t, _k5_4, _k5_4t = (_KERNELS[5, r, t] for r in (1, 2, 4)
                                                for t in (False, True))
_k8_1, _k8_1t, _k8_2, _k8_2t, _k8_4, _k8_4t = (_KERNELS[8, r, t] for r in (1, 2, 4)
                                                for t in (False, True))
_kh_1, _kh_1t, _kh_2, _kh_2t, _kh_4, _kh_4t = (_KERNELS[16, r, t] for r in (1, 2, 4)
                                                for t in (False, True))


@jit_kernel
def _tile_ir(codes, scales, terms, q, d, dq, bits, t, m, rows, scratch):
    """The IR kernel of ``rows`` (1, 2 or 4) rows from ``m``, tile ``t``."""
    if d.shape[1] * 16 == q.shape[1]:          # blocks of 16: a sum per half
        if terms.shape[1] != 0:
            if rows == 4:
                return _kh_4t(codes, scales, terms, q, d, dq, t, m, scratch)
            if rows == 2:
                return _kh_2t(codes, scales, terms, q, d, dq, t, m, scratch)
            return _kh_1t(codes, scales, terms, q, d, dq, t, m, scratch)
        if rows == 4:
            return _kh_4(codes, scales, terms, q, d, dq, t, m, scratch)
        if rows == 2:
            return _kh_2(codes, scales, terms, q, d, dq, t, m, scratch)
        return _kh_1(codes, scales, terms, q, d, dq, t, m, scratch)
    if terms.shape[1] != 0:
        if bits == 4:
            if rows == 4:
                return _k4_4t(codes, scales, terms, q, d, dq, t, m, scratch)
            if rows == 2:
                return _k4_2t(codes, scales, terms, q, d, dq, t, m, scratch)
            return _k4_1t(codes, scales, terms, q, d, dq, t, m, scratch)
        if bits == 5:
            if rows == 4:
                return _k5_4t(codes, scales, terms, q, d, dq, t, m, scratch)
            if rows == 2:
                return _k5_2t(codes, scales, terms, q, d, dq, t, m, scratch)
            return _k5_1t(codes, scales, terms, q, d, dq, t, m, scratch)
        if rows == 4:
            return _k8_4t(codes, scales, terms, q, d, dq, t, m, scratch)
        if rows == 2:
            return _k8_2t(codes, scales, terms, q, d, dq, t, m, scratch)
        return _k8_1t(codes, scales, terms, q, d, dq, t, m, scratch)
    if bits == 4:
        if rows == 4:
            return _k4_4(codes, scales, terms, q, d, dq, t, m, scratch)
        if rows == 2:
            return _k4_2(codes, scales, terms, q, d, dq, t, m, scratch)
        return _k4_1(codes, scales, terms, q, d, dq, t, m, scratch)
    if bits == 5:
        if rows == 4:
            return _k5_4(codes, scales, terms, q, d, dq, t, m, scratch)
        if rows == 2:
            return _k5_2(codes, scales, terms, q, d, dq, t, m, scratch)
        return _k5_1(codes, scales, terms, q, d, dq, t, m, scratch)
    if rows == 4:
        return _k8_4(codes, scales, terms, q, d, dq, t, m, scratch)
    if rows == 2:
        return _k8_2(codes, scales, terms, q, d, dq, t, m, scratch)
    return _k8_1(codes, scales, terms, q, d, dq, t, m, scratch)


_tile = _tile_ir if HAS_AVX2 else tile_portable


@jit_kernel
def _chunk(codes, scales, terms, q, d, dq, bits, lo, hi, out, portable, pairs):
    """Tiles ``lo .. hi - 1`` of every row, rows in tiles of 4, 2, 1; ``pairs``
    (an even number of rows): rows ``2m`` and ``2m + 1`` summed into ``out[m]``
    (one float32 addition), as they land in the same tile of rows."""
    num_rows, n = q.shape[0], out.shape[1]
    scratch = np.empty((4, TILE), np.float32)
    for t in range(lo, hi):
        width = min(TILE, n - t * TILE)
        m = 0
        while m < num_rows:
            rows = 4 if num_rows - m >= 4 else (2 if num_rows - m >= 2 else 1)
            if portable:
                tile_portable(codes, scales, terms, q, d, dq, bits, t, m, rows, scratch)
            else:
                _tile(codes, scales, terms, q, d, dq, bits, t, m, rows, scratch)
            if pairs:
                for r in range(0, rows, 2):
                    for j in range(width):
                        out[(m + r) // 2, t * TILE + j] = scratch[r, j] + scratch[r + 1, j]
            else:
                for r in range(rows):
                    for j in range(width):
                        out[m + r, t * TILE + j] = scratch[r, j]
            m += rows


@jit_kernel(parallel=True)
def q8_tiled_gemm(q, d, dq, codes, scales, terms, bits, chunks, out):
    """Every output of the quantized rows (``q``, ``d``, ``dq`` from
    :func:`~pagedkv_np.backends.block_q8.q8_quantize` with 8 bits, block 32),
    tiles in ``chunks`` chunks; the IR kernel where the host has AVX2."""
    tiles = codes.shape[0]
    for c in prange(chunks):
        _chunk(codes, scales, terms, q, d, dq, bits, c * tiles // chunks,
               (c + 1) * tiles // chunks, out, False, False)


@jit_kernel(parallel=True)
def q8_tiled_gemm_portable(q, d, dq, codes, scales, terms, bits, chunks, out):
    """:func:`q8_tiled_gemm` in plain Numba loops: the same bits, on any CPU."""
    tiles = codes.shape[0]
    for c in prange(chunks):
        _chunk(codes, scales, terms, q, d, dq, bits, c * tiles // chunks,
               (c + 1) * tiles // chunks, out, True, False)


@jit_kernel
def _matmul(x, codes, scales, terms, bits, chunks, out):
    """The rows quantized into new buffers, then :func:`q8_tiled_gemm`, or the
    tiles on the calling thread when ``chunks`` is 0."""
    num_rows, k = x.shape
    block = k * TILE // scales.shape[1]          # the weight's: 32, or 16
    blocks = k // block
    q = np.empty((num_rows, k), np.int8)
    d = np.empty((num_rows, blocks), np.float32)
    dq = np.empty((num_rows, blocks), np.float32)
    sums = np.empty((num_rows, blocks), np.float32)
    q8_quantize(x, 8, block, q, d, dq, sums)
    if chunks == 0:
        _chunk(codes, scales, terms, q, d, dq, bits, 0, codes.shape[0], out, False, False)
    else:
        q8_tiled_gemm(q, d, dq, codes, scales, terms, bits, chunks, out)


def q8x2_tiled_matmul(x: np.ndarray, weight: BlockWeight, out: np.ndarray | None = None
                      ) -> np.ndarray:
    """``x @ w`` with each row rounded to int8 per block twice: ``x``, then
    its remainder (see the module docstring); arguments and errors as
    :func:`q8_tiled_matmul`."""
    return _tiled_call(q8x2_tiled_product, x, weight, out)


def q8x2_tiled_product(x: np.ndarray, tiles: Q8Tiles, threads: int, out: np.ndarray) -> None:
    """:func:`q8x2_tiled_matmul` without its checks, as :func:`q8_tiled_product`."""
    chunks = 0 if threads <= 1 else min(tiles.codes.shape[0], threads * TILED_CHUNKS)
    _matmul2(x, tiles.codes, tiles.scales, tiles.terms, tiles.bits, chunks, out)


@jit_kernel
def _matmul2(x, codes, scales, terms, bits, chunks, out):
    """Rows ``2m`` and ``2m + 1``: ``x[m]`` and its remainder, quantized; their
    products summed into ``out[m]``."""
    num_rows, k = x.shape
    block = k * TILE // scales.shape[1]          # the weight's: 32, or 16
    blocks = k // block
    both = np.empty((2 * num_rows, k), np.float32)
    q = np.empty((2 * num_rows, k), np.int8)
    d = np.empty((2 * num_rows, blocks), np.float32)
    dq = np.empty((2 * num_rows, blocks), np.float32)
    sums = np.empty((2 * num_rows, blocks), np.float32)
    for m in range(num_rows):
        both[2 * m] = x[m]
        q8_quantize(both[2 * m:2 * m + 1], 8, block, q[2 * m:2 * m + 1], d[2 * m:2 * m + 1],
                    dq[2 * m:2 * m + 1], sums[2 * m:2 * m + 1])
        for b in range(blocks):
            for i in range(block):
                both[2 * m + 1, block * b + i] = x[m, block * b + i] - d[2 * m, b] * np.float32(
                    q[2 * m, block * b + i])
        q8_quantize(both[2 * m + 1:2 * m + 2], 8, block, q[2 * m + 1:2 * m + 2],
                    d[2 * m + 1:2 * m + 2], dq[2 * m + 1:2 * m + 2], sums[2 * m + 1:2 * m + 2])
    if chunks == 0:
        _chunk(codes, scales, terms, q, d, dq, bits, 0, codes.shape[0], out, False, True)
    else:
        _pair_gemm(q, d, dq, codes, scales, terms, bits, chunks, out)


@jit_kernel(parallel=True)
def _pair_gemm(q, d, dq, codes, scales, terms, bits, chunks, out):
    """:func:`q8_tiled_gemm` with rows ``2m`` and ``2m + 1`` summed into
    ``out[m]`` as each tile is done (no buffer of both rows' outputs: the
    head's would be 2 MB a token)."""
    tiles = codes.shape[0]
    for c in prange(chunks):
        _chunk(codes, scales, terms, q, d, dq, bits, c * tiles // chunks,
               (c + 1) * tiles // chunks, out, False, True)
