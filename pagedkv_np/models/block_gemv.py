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

* ``lanes[i] += scale_b * ((code - zero) * x)`` over the blocks ``b`` of the
  weight row in order, lane ``i`` taking input ``i`` of every block (for 4
  bits, byte ``i``: ``scale_b * ((lo - zero) * x_even + (hi - zero) * x_odd)``);
* the lanes summed as a fixed binary tree;
* plus ``sum_b blocksum_b(x) * offset_b`` in block order, ``blocksum_b`` the
  sequential sum of block ``b``'s inputs.

Work is split over outputs ``n`` only, and every ``m`` runs the same compiled
loop, so a row's result does not depend on how many rows come with it, on
the thread count or on the call (``tests/test_block_gemv.py`` checks rows
bitwise alone and in batches). The difference from a float64 product stays
within a few float32 roundings of ``sum |w| |x|`` per output.

Codes are prepared once per weight (:class:`BlockWeight`): 8-bit codes as
int8 ``code - zero`` (int16 when some do not fit), 4-bit codes left packed
two per byte as MatMulNBits packs them, the zero points unpacked.
Figures: ``scripts/bench_block_gemv.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import prange

from ..backends.jit import jit_kernel
from ..errors import ConfigError, DTypeError, ShapeError
from .gguf.blocks import NBits

__all__ = ["BlockWeight", "block_matmul"]

_CHUNKS_PER_THREAD = 8         # parallel chunks per thread, for a balanced split


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """A weight's blocks, laid out for :func:`block_matmul` (see the module docstring).

    Attributes
    ----------
    bits, block_size : int
        4 or 8; 16 or 32.
    in_features, out_features : int
        ``K`` and ``N`` of ``w`` ``[K, N]``.
    codes : ndarray
        8 bits: ``code - zero``, int8 (or int16) ``[N, K]``; 4 bits: the packed
        codes, uint8 ``[N, K // 2]``.
    zeros : ndarray, shape [N, K // block_size], uint8
        4-bit zero points (unused for 8 bits: folded into ``codes``).
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

    @classmethod
    def from_nbits(cls, parts: NBits) -> BlockWeight:
        """Lay out MatMulNBits parts (copies them; ``parts`` is left as it was)."""
        if not isinstance(parts, NBits):
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
        if bits == 8:
            signed = b.reshape(n, nb, block_size).astype(np.int16) - zero[..., None]
            small = signed.min() >= -128 and signed.max() <= 127
            codes = signed.astype(np.int8 if small else np.int16).reshape(n, k)
        else:
            codes = np.ascontiguousarray(b.reshape(n, k // 2))
        return cls(bits, block_size, k, n, codes, zero, scales, offsets)


def block_matmul(x: np.ndarray, weight: BlockWeight | NBits,
                 out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w`` for a weight in quantized blocks (see the module docstring).

    Parameters
    ----------
    x : ndarray, shape [M, K], float32
        Activations, one row per token (``M`` may be 0).
    weight : BlockWeight or NBits
        The weight; prepare an :class:`NBits` once with
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
    if m == 0:
        return out
    x = np.ascontiguousarray(x)
    chunks = min(n, _num_threads() * _CHUNKS_PER_THREAD)
    if w.offsets is None:
        sums, offsets = np.zeros((m, 0), np.float32), np.zeros((n, 0), np.float32)
    else:
        sums = np.empty((m, w.in_features // w.block_size), np.float32)
        _block_sums(x, w.block_size, sums)
        offsets = w.offsets
    if w.bits == 8:
        _gemm8(x, w.codes, w.scales, sums, offsets, chunks, out)
    else:
        even, odd = np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2])
        _gemm4(even, odd, w.codes, w.zeros, w.scales, sums, offsets, chunks, out)
    return out


def _num_threads() -> int:
    import numba
    return int(numba.get_num_threads())


@jit_kernel
def _block_sums(x, block_size, sums):
    """``sums[m, b]``: the inputs of block ``b`` of row ``m``, summed in order."""
    for m in range(x.shape[0]):
        for b in range(sums.shape[1]):
            t = np.float32(0.0)
            for i in range(block_size):
                t += x[m, b * block_size + i]
            sums[m, b] = t


@jit_kernel
def _finish(lanes, sums, offsets, m, n):
    """The lanes summed as a fixed tree, plus the block-sum term in block order."""
    width = lanes.shape[0] // 2
    while width:
        for i in range(width):
            lanes[i] += lanes[i + width]
        width //= 2
    total = lanes[0]
    for b in range(offsets.shape[1]):
        total += sums[m, b] * offsets[n, b]
    return total


# The lane loops run to a count known only at run time: Numba leaves LLVM's SLP
# vectorizer off, so a loop of a constant 16 or 32 is unrolled and stays scalar,
# while a loop of unknown count is vectorized (3-4x faster here).
@jit_kernel(parallel=True)
def _gemm8(x, codes, scales, sums, offsets, chunks, out):
    """8-bit codes ``codes[n, k] = code - zero``: one lane per input of a block."""
    num_rows, k = x.shape
    n_total, num_blocks = scales.shape
    block_size = k // num_blocks
    for c in prange(chunks):
        lanes = np.empty(block_size, np.float32)
        for n in range(c * n_total // chunks, (c + 1) * n_total // chunks):
            for m in range(num_rows):
                for i in range(block_size):
                    lanes[i] = np.float32(0.0)
                for b in range(num_blocks):
                    s = scales[n, b]
                    at = b * block_size
                    for i in range(block_size):
                        lanes[i] += s * (np.float32(codes[n, at + i]) * x[m, at + i])
                out[m, n] = _finish(lanes, sums, offsets, m, n)


@jit_kernel(parallel=True)
def _gemm4(even, odd, codes, zeros, scales, sums, offsets, chunks, out):
    """4-bit codes packed two per byte (even input low): one lane per byte of a
    block, adding the byte's two products."""
    num_rows, half = even.shape
    n_total, num_blocks = scales.shape
    width = half // num_blocks
    low = np.int32(15)
    for c in prange(chunks):
        lanes = np.empty(width, np.float32)
        for n in range(c * n_total // chunks, (c + 1) * n_total // chunks):
            for m in range(num_rows):
                for i in range(width):
                    lanes[i] = np.float32(0.0)
                for b in range(num_blocks):
                    s = scales[n, b]
                    z = np.int32(zeros[n, b])
                    at = b * width
                    for i in range(width):
                        q = np.int32(codes[n, at + i])
                        lanes[i] += s * (np.float32((q & low) - z) * even[m, at + i]
                                         + np.float32((q >> np.int32(4)) - z) * odd[m, at + i])
                out[m, n] = _finish(lanes, sums, offsets, m, n)
