"""Products of float32 activations with a weight in quantized blocks, on the CPU.

:func:`block_matmul` computes ``x @ w`` for ``x`` float32 ``[M, K]`` and a
weight ``w`` ``[K, N]`` held as onnxruntime MatMulNBits parts
(:class:`~pagedkv_np.models.gguf.blocks.NBits`: codes, a scale per block of
``block_size`` inputs, integer zero points and an optional block-sum term),
without dequantizing it: ``w[k, n] = (code - zero) * scale + offset``. It
exists because onnxruntime's 8-bit MatMulNBits is fast only with int8
activations (``accuracy_level=4``), which changes the answers, so an exact
8-bit LM head otherwise runs as a float32 Gemm over four times the bytes.

The arithmetic is float32 with one fixed order per output ``(m, n)``:

* the weights of block ``b``, ``w = scale_b * float(code - zero)`` (one
  rounding: the float32 dequantized weight without its offset);
* two accumulators of 8 lanes; the block's inputs taken in groups of 8 (8
  bits: inputs ``8g .. 8g + 7``; 4 bits: for bytes ``8v .. 8v + 7``, their low
  nibbles with the even inputs, then their high nibbles with the odd ones),
  group ``g`` going to accumulator ``g % 2`` as ``acc = fma(w, x, acc)``, one
  rounding per input, blocks in order;
* the two accumulators added, then their 8 lanes summed as a fixed binary tree
  (``lane[i] += lane[i + width]``, width 4, 2, 1);
* plus ``sum_b blocksum_b(x) * offset_b`` in block order, ``blocksum_b`` the
  sequential sum of block ``b``'s inputs.

Work is split over outputs ``n`` only; rows go in tiles of 4 (then 2, then
1) that share each group's conversion of codes to weights, the part that
costs most, but each row's arithmetic is the same in every tile, so its
result does not depend on how many rows come with it, on the thread count or
on the call (``tests/test_block_gemv.py`` checks rows
bitwise alone and in batches). The difference from a float64 product stays
within a few float32 roundings of ``sum |w| |x|`` per output.

It lives with the backends, not beside the GGUF import, because it is a
Numba kernel under this package's cache policy (:mod:`.jit`) and the models
import nothing of the backends; it reads the parts by their attributes.

Codes are prepared once per weight (:class:`BlockWeight`): left as MatMulNBits
packs them (8 bits one per byte, 4 bits two per byte), the zero points unpacked.
Figures (``scripts/bench_block_gemv.py --rounds 7``, 2 threads, this 2-core
AVX2 machine at load average 5.1-5.4 from other jobs, 2026-12-02; SmolLM2's
Q8_0 head, 576 x 49152; median / best ms of one call)::

    M     ort float32     numpy float32   block           ort nbits4
    1     21.0 / 15.2     16.4 / 11.3     20.9 / 13.5     12.3 /  8.0
    4     16.8 / 14.5     57.0 / 37.9     21.7 / 18.6     16.0 / 10.8
    8     27.5 / 18.8     47.9 / 42.5     44.0 / 32.5     34.7 / 26.3
    16    45.6 / 34.2     76.8 / 59.9     70.6 / 61.9     48.6 / 33.1
    64    97.5 / 83.9    121.4 / 110.4   216.1 / 172.6   142.7 / 124.8

Before the row tiles, in the same conditions (load 4.2), block against ort
float32 was M = 4 38.6 / 26.9, M = 8 54.5 / 35.7, M = 16 110.6 / 41.5, M = 64
356.1 / 87.7 ms. On one thread, 576 x 49152 (``block`` best against NumPy's,
same process), the kernel runs 12-18 GMAC/s from M = 4 on, 1.6x NumPy's rate at
M = 8, 0.9-1.0x at 16, 0.7x at 64: on two threads at this load it is still
slower than onnxruntime's float32 Gemm from M = 4 on (1.3x at 4, 1.5x at 8 and
16, 2.2x at 64), so prefill should stay float32. The first call compiles the
kernels for every bits x block size x tile (about 15 s here at load 4, then
1.5 s from Numba's disk cache; 5.5 s cold before the tiles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import prange

from .block_gemv_ir import block_dot_intrinsic, buffer_dot_intrinsic, store_intrinsic
from .jit import jit_kernel
from ..errors import ConfigError, DTypeError, ShapeError

__all__ = ["BlockWeight", "block_matmul", "block_product", "product_operands"]

# Outputs are split into 16 chunks per thread, handed out one at a time
# (numba.set_parallel_chunksize(1)): on a busy machine a thread that loses its
# core then holds back one small chunk, not a static share. 2 threads on this
# 2-core machine at load 5, Q8 576 x 49152, M = 1: median 8 ms against 15
# with static shares (one thread: 6-8 ms; its load, not the split, decides).
_CHUNKS_PER_THREAD = 16


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """A weight's blocks, laid out for :func:`block_matmul` (see the module docstring).

    Attributes
    ----------
    bits, block_size : int
        4 or 8; 16 or 32.
    in_features, out_features : int
        ``K`` and ``N`` of ``w`` ``[K, N]``.
    codes : ndarray, shape [N, K * bits // 8], uint8
        The codes as MatMulNBits packs them (4 bits: even input in the low nibble).
    zeros : ndarray, shape [N, K // block_size], uint8
        The zero points, unpacked.
    scales : ndarray, shape [N, K // block_size], float32
    offsets : ndarray, shape [N, K // block_size], float32, or None
    """

    bits: int
    block_size: int
    in_features: int
    out_features: int
    codes: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None

    def __post_init__(self) -> None:
        # the kernels read these by raw row pointers: check what they rely on
        n, k, nb = self.out_features, self.in_features, self.in_features // self.block_size
        want = [("codes", self.codes, np.uint8, (n, k * self.bits // 8)),
                ("zeros", self.zeros, np.uint8, (n, nb)),
                ("scales", self.scales, np.float32, (n, nb))]
        if self.offsets is not None:
            want.append(("offsets", self.offsets, np.float32, (n, nb)))
        if self.bits not in (4, 8) or self.block_size not in (16, 32) or k % self.block_size:
            raise ConfigError(f"Invalid BlockWeight: bits {self.bits}, block_size "
                              f"{self.block_size}, in_features {k}")
        for name, a, dtype, shape in want:
            if not isinstance(a, np.ndarray) or a.dtype != dtype:
                raise DTypeError(f"Invalid BlockWeight.{name}: expected {np.dtype(dtype)}, "
                                 f"got {getattr(a, 'dtype', type(a).__name__)}")
            if a.shape != shape or not a.flags.c_contiguous:
                raise ShapeError(f"Invalid BlockWeight.{name}: expected a C-contiguous "
                                 f"{shape} array, got {a.shape}")

    @classmethod
    def from_nbits(cls, parts: Any) -> BlockWeight:
        """Lay out MatMulNBits parts, an :class:`~pagedkv_np.models.gguf.blocks.NBits`
        (read by its attributes: this package's backends import nothing of the
        models; ``codes`` may share ``parts.B``'s memory)."""
        names = ("bits", "block_size", "B", "scales", "zero_points", "offsets")
        if not all(hasattr(parts, name) for name in names):
            raise DTypeError(f"Invalid parts: expected an NBits, got {type(parts).__name__}")
        bits, block_size = parts.bits, parts.block_size
        if bits not in (4, 8) or block_size not in (16, 32):
            raise ConfigError(f"Invalid parts: bits {bits} and block_size {block_size} are "
                              f"not supported (bits 4 or 8, block_size 16 or 32)")
        b = parts.B
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 3 \
                or b.shape[2] != block_size * bits // 8 or 0 in b.shape:
            raise ShapeError(f"Invalid parts.B: expected uint8 [N, blocks, "
                             f"{block_size * bits // 8}], got {getattr(b, 'shape', b)!r:.80}")
        n, nb = b.shape[:2]
        k = nb * block_size
        scales = np.asarray(parts.scales)
        if scales.dtype != np.float32 or scales.size != n * nb:
            raise ShapeError(f"Invalid parts.scales: expected {n * nb} float32, got "
                             f"{scales.size} {scales.dtype}")
        scales = np.ascontiguousarray(scales.reshape(n, nb))
        zero = np.full((n, nb), 1 << (bits - 1), np.uint8)
        if parts.zero_points is not None:
            zp = np.asarray(parts.zero_points)
            per_row = (nb * bits + 7) // 8
            if zp.dtype != np.uint8 or zp.size != n * per_row:
                raise ShapeError(f"Invalid parts.zero_points: expected {n * per_row} uint8, "
                                 f"got {zp.size} {zp.dtype}")
            zp = zp.reshape(n, per_row)
            if bits == 4:
                zp = np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)
            zero = np.ascontiguousarray(zp[:, :nb])
        offsets = None
        if parts.offsets is not None:
            off = np.asarray(parts.offsets)
            if off.dtype != np.float32 or off.shape != (nb, n):
                raise ShapeError(f"Invalid parts.offsets: expected float32 {(nb, n)}, got "
                                 f"{off.dtype} {off.shape}")
            offsets = np.ascontiguousarray(off.T)
        codes = np.ascontiguousarray(b.reshape(n, k * bits // 8))
        return cls(bits, block_size, k, n, codes, zero, scales, offsets)


def block_matmul(x: np.ndarray, weight: Any,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w`` for a weight in quantized blocks (see the module docstring).

    Parameters
    ----------
    x : ndarray, shape [M, K], float32
        Activations, one row per token (``M`` may be 0).
    weight : BlockWeight or NBits
        The weight (an :class:`~pagedkv_np.models.gguf.blocks.NBits`, or anything
        with its attributes); prepare it once with
        :meth:`BlockWeight.from_nbits` when it is used more than once.
    out : ndarray, shape [M, N], float32, C-contiguous, optional
        Where to write the product.

    Returns
    -------
    ndarray, shape [M, N], float32
        ``out`` when given. Row ``m`` depends on ``x[m]`` only, bit for bit.

    Raises
    ------
    DTypeError
        ``x`` or ``out`` is not float32.
    ShapeError
        ``x`` is not 2-D with ``K`` columns, or ``out`` is not C-contiguous ``[M, N]``.
    """
    w, x, out = product_operands(x, weight, out)
    m, n = out.shape
    if m == 0:
        return out
    chunks = min(n, numba.get_num_threads() * _CHUNKS_PER_THREAD)
    before = numba.set_parallel_chunksize(1)
    try:
        block_product(x, w, chunks, out)
    finally:
        numba.set_parallel_chunksize(before)
    return out


# a weight without offsets: the kernels read offsets only when shape[1] != 0
_NO_OFFSETS = np.zeros((0, 0), np.float32)


def block_product(x: np.ndarray, w: BlockWeight, chunks: int, out: np.ndarray) -> None:
    """:func:`block_matmul`'s product without its checks, for a caller that
    checked the shapes once and owns the buffers: ``x`` a C-contiguous float32
    ``[M, K]`` with ``M`` >= 1, ``out`` a C-contiguous float32 ``[M, N]``, the
    outputs in ``chunks`` >= 1 chunks (best under
    ``numba.set_parallel_chunksize(1)``). Same bits for any ``chunks``."""
    offsets = _NO_OFFSETS if w.offsets is None else w.offsets
    _product(x, w.codes, w.zeros, w.scales, offsets, w.bits, w.block_size, chunks, out)


@jit_kernel
def _product(x, codes, zeros, scales, offsets, bits, block_size, chunks, out):
    """:func:`block_product` in one jitted call: the block sums (with offsets)
    and the even/odd columns (4 bits), then :func:`_gemm`."""
    m = x.shape[0]
    if offsets.shape[1] == 0:
        sums = np.zeros((m, 0), np.float32)
    else:
        sums = np.empty((m, x.shape[1] // block_size), np.float32)
        _block_sums(x, block_size, sums)
    if bits == 8:
        _gemm(x, x, codes, zeros, scales, sums, offsets, bits, block_size, chunks, out)
    else:
        even = np.ascontiguousarray(x[:, 0::2])
        odd = np.ascontiguousarray(x[:, 1::2])
        _gemm(even, odd, codes, zeros, scales, sums, offsets, bits, block_size, chunks, out)


def product_operands(x: np.ndarray, weight: Any,
                     out: np.ndarray | None = None) -> tuple[BlockWeight, np.ndarray, np.ndarray]:
    """The checked operands of a block product (:func:`block_matmul`, and
    :func:`~pagedkv_np.backends.block_q8.q8_matmul`): the weight laid out,
    ``x`` C-contiguous, and ``out`` (allocated when None).

    Raises
    ------
    DTypeError
        ``x`` or ``out`` is not float32.
    ShapeError
        ``x`` is not 2-D with ``K`` columns, or ``out`` is not a writeable
        C-contiguous ``[M, N]`` array.
    """
    w = weight if isinstance(weight, BlockWeight) else BlockWeight.from_nbits(weight)
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise DTypeError(f"Invalid x: expected a float32 array, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ShapeError(f"Invalid x: expected shape [M, {w.in_features}], got {x.shape}")
    m, n = x.shape[0], w.out_features
    if out is None:
        out = np.empty((m, n), np.float32)
    elif not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise DTypeError(f"Invalid out: expected a float32 array, got "
                         f"{getattr(out, 'dtype', type(out).__name__)}")
    elif out.shape != (m, n) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ShapeError(f"Invalid out: expected a writeable C-contiguous ({m}, {n}) array, "
                         f"got {out.shape}")
    x = np.ascontiguousarray(x)
    return w, x, out


@jit_kernel
def _block_sums(x, block_size, sums):
    """``sums[m, b]``: the inputs of block ``b`` of row ``m``, summed in order."""
    for m in range(x.shape[0]):
        for b in range(sums.shape[1]):
            t = np.float32(0.0)
            for i in range(block_size):
                t += x[m, b * block_size + i]
            sums[m, b] = t



_store8_16, _store8_32 = store_intrinsic(8, 16), store_intrinsic(8, 32)
_store4_16, _store4_32 = store_intrinsic(4, 16), store_intrinsic(4, 32)
_buf8 = [buffer_dot_intrinsic(8, r) for r in (1, 2, 4)]
_buf4 = [buffer_dot_intrinsic(4, r) for r in (1, 2, 4)]
_buf_one8, _buf_two8, _buf_four8 = _buf8
_buf_one4, _buf_two4, _buf_four4 = _buf4


# rows in tiles of 4, then 2 and 1 for the rest: a tile's 8 accumulators, its
# block's weights, scale and zero fit AVX2's 16 vector registers
_dot8_16 = [block_dot_intrinsic(8, 16, r) for r in (1, 2, 4)]
_dot8_32 = [block_dot_intrinsic(8, 32, r) for r in (1, 2, 4)]
_dot4_16 = [block_dot_intrinsic(4, 16, r) for r in (1, 2, 4)]
_dot4_32 = [block_dot_intrinsic(4, 32, r) for r in (1, 2, 4)]
_one8_16, _two8_16, _four8_16 = _dot8_16
_one8_32, _two8_32, _four8_32 = _dot8_32
_one4_16, _two4_16, _four4_16 = _dot4_16
_one4_32, _two4_32, _four4_32 = _dot4_32


@jit_kernel
def _finish(total, sums, offsets, m, n, out):
    for b in range(offsets.shape[1]):
        total += sums[m, b] * offsets[n, b]
    out[m, n] = total


@jit_kernel
def _four(codes, zeros, scales, even, odd, n, m, bits, block_size):
    if bits == 8 and block_size == 32:
        return _four8_32(codes, zeros, scales, even, odd, n, m)
    if bits == 8:
        return _four8_16(codes, zeros, scales, even, odd, n, m)
    if block_size == 32:
        return _four4_32(codes, zeros, scales, even, odd, n, m)
    return _four4_16(codes, zeros, scales, even, odd, n, m)


@jit_kernel
def _two(codes, zeros, scales, even, odd, n, m, bits, block_size):
    if bits == 8 and block_size == 32:
        return _two8_32(codes, zeros, scales, even, odd, n, m)
    if bits == 8:
        return _two8_16(codes, zeros, scales, even, odd, n, m)
    if block_size == 32:
        return _two4_32(codes, zeros, scales, even, odd, n, m)
    return _two4_16(codes, zeros, scales, even, odd, n, m)


@jit_kernel
def _one(codes, zeros, scales, even, odd, n, m, bits, block_size):
    if bits == 8 and block_size == 32:
        return _one8_32(codes, zeros, scales, even, odd, n, m)
    if bits == 8:
        return _one8_16(codes, zeros, scales, even, odd, n, m)
    if block_size == 32:
        return _one4_32(codes, zeros, scales, even, odd, n, m)
    return _one4_16(codes, zeros, scales, even, odd, n, m)


@jit_kernel
def _store(codes, zeros, scales, weights, n, bits, block_size):
    if bits == 8 and block_size == 32:
        return _store8_32(codes, zeros, scales, weights, n)
    if bits == 8:
        return _store8_16(codes, zeros, scales, weights, n)
    if block_size == 32:
        return _store4_32(codes, zeros, scales, weights, n)
    return _store4_16(codes, zeros, scales, weights, n)


# outputs whose weights are converted together, then read by each tile of 4
# rows in turn: their weights and the tile's inputs stay in L1 (K = 576: 9 KB
# each), where the rows' inputs alone (M = 16: 37 KB) would not
_OUTPUTS_PER_GROUP = 4


@jit_kernel
def _buffered(even, odd, codes, zeros, scales, sums, offsets, bits, block_size, lo, hi,
              out):
    """Outputs ``lo .. hi - 1`` of more than 4 rows: :func:`_gemm`'s result,
    the weights of a group of outputs converted once into a buffer."""
    num_rows = even.shape[0]
    fours, twos = num_rows // 4 * 4, num_rows // 2 * 2
    weights = np.empty((_OUTPUTS_PER_GROUP, codes.shape[1] * 8 // bits), np.float32)
    for start in range(lo, hi, _OUTPUTS_PER_GROUP):
        stop = min(start + _OUTPUTS_PER_GROUP, hi)
        for n in range(start, stop):
            _store(codes, zeros, scales, weights[n - start], n, bits, block_size)
        for m in range(0, fours, 4):
            for n in range(start, stop):
                if bits == 8:
                    t0, t1, t2, t3 = _buf_four8(weights[n - start], even, odd, m)
                else:
                    t0, t1, t2, t3 = _buf_four4(weights[n - start], even, odd, m)
                _finish(t0, sums, offsets, m, n, out)
                _finish(t1, sums, offsets, m + 1, n, out)
                _finish(t2, sums, offsets, m + 2, n, out)
                _finish(t3, sums, offsets, m + 3, n, out)
        for n in range(start, stop):
            if twos > fours:
                if bits == 8:
                    t0, t1 = _buf_two8(weights[n - start], even, odd, fours)
                else:
                    t0, t1 = _buf_two4(weights[n - start], even, odd, fours)
                _finish(t0, sums, offsets, fours, n, out)
                _finish(t1, sums, offsets, fours + 1, n, out)
            if num_rows > twos:
                if bits == 8:
                    u = _buf_one8(weights[n - start], even, odd, twos)
                else:
                    u = _buf_one4(weights[n - start], even, odd, twos)
                _finish(u[0], sums, offsets, twos, n, out)


@jit_kernel(parallel=True)
def _gemm(even, odd, codes, zeros, scales, sums, offsets, bits, block_size, chunks, out):
    """Every output ``(m, n)``: its block dot (rows four at a time, then two,
    then one), then the block-sum term in block order. Up to 4 rows convert
    the codes as they go; more go through :func:`_buffered`, which converts
    each output's weights once for all tiles (the same values: the same bits)."""
    num_rows = even.shape[0]
    n_total = codes.shape[0]
    fours, twos = num_rows // 4 * 4, num_rows // 2 * 2
    for c in prange(chunks):
        lo, hi = c * n_total // chunks, (c + 1) * n_total // chunks
        if num_rows > 4:
            _buffered(even, odd, codes, zeros, scales, sums, offsets, bits, block_size,
                      lo, hi, out)
            continue
        for n in range(lo, hi):
            if fours:
                t0, t1, t2, t3 = _four(codes, zeros, scales, even, odd, n, 0, bits,
                                       block_size)
                _finish(t0, sums, offsets, 0, n, out)
                _finish(t1, sums, offsets, 1, n, out)
                _finish(t2, sums, offsets, 2, n, out)
                _finish(t3, sums, offsets, 3, n, out)
            if twos > fours:
                t0, t1 = _two(codes, zeros, scales, even, odd, n, 0, bits, block_size)
                _finish(t0, sums, offsets, 0, n, out)
                _finish(t1, sums, offsets, 1, n, out)
            if num_rows > twos:
                t = _one(codes, zeros, scales, even, odd, n, twos, bits, block_size)
                _finish(t[0], sums, offsets, twos, n, out)
