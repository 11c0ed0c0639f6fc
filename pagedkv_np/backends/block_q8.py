"""Products of int8-quantized activations with a weight in quantized blocks.

:func:`q8_matmul` computes ``x @ w`` like
:func:`~pagedkv_np.backends.block_gemv.block_matmul` (``x`` float32 ``[M, K]``,
``w`` a :class:`~pagedkv_np.backends.block_gemv.BlockWeight`: codes, zero
points, scales, optional offsets, ``w[k, n] = (code - zero) * scale +
offset``), but first rounds each row's inputs to int8 per weight block, so the
block dot is an exact integer dot (AVX2 ``maddubs``/``pmaddwd``, or VNNI's
``vpdpbusd`` where the CPU has it, as llama.cpp does for q8 activations x q4
weights). It is for decoding (M = 1): on one
thread 2.8-3.1x the float32 kernel's rate on SmolLM2's body shapes and about
onnxruntime's MatMulNBits with int8 activations (``accuracy_level=4``; 1.0x
to 1.8x its rate), and unlike the latter deterministic: row ``m``'s outputs
depend on ``x[m]`` only, bit for bit, whatever ``M``, the thread count or the
tile the row lands in. (The engine's decode step and int8 head take
:mod:`.block_q8_tiles` instead for 4 or 8 bits in blocks of 32: the same
rounded rows against a copy of the weight packed by 16 outputs, faster,
another float order; this kernel keeps the rest, blocks of 16.)

Activation quantization (:func:`q8_quantize_row`), per row and per block ``b``
of ``block_size`` inputs (the weight's), all float32:

* ``d_b = amax_b / 127`` with ``amax_b = max |x_i|`` over the block;
* ``q_i = rint(x_i / d_b)`` (IEEE division, then round half to even: NumPy's
  ``np.rint(x / d)``), as int8 in -127..127; a block with ``d_b == 0`` (all
  zeros) or a non-finite ``d_b`` or quotient gets ``q_i = 0`` (non-finite
  input gives non-finite outputs: ``d_b`` carries it);
* ``dq_b = d_b * float(sum_i q_i)`` (one rounding), for the zero points;
* ``s_b = dq_b``, the sum the offsets multiply: the block's rounded inputs,
  as the codes see them. (The exact sum of the float32 inputs, tried first,
  leaves the rounding error of the codes' side uncancelled: a Q4_1 block's
  offset is about ``-8 scale``, so ``w - offset`` is all of one sign and the
  errors add up. SmolLM2 Q4_1 on 8 windows of the license texts of
  ``scripts/bench_accuracy.py``: NLL +0.495% against float32 activations, KL
  0.0128 per token, with the exact sum; +0.118%, KL 0.0028, with ``dq_b``.
  llama.cpp's q4_1 x q8_1 dot takes ``d * sum q`` as well.) It is its own
  operand of the kernels, equal to ``dq_b``;
* the quantized row is laid out for the codes' nibbles: 8 bits, as the
  inputs come; 4 bits, block 16 and a last block 32 left alone, the block's
  even inputs then its odd ones; 4 bits, blocks 32 in pairs ``2p, 2p + 1``
  (64 bytes from ``64p``), the evens of ``2p``, the evens of ``2p + 1``, the
  odds of ``2p``, the odds of ``2p + 1`` (the low nibbles of the pair's 32
  code bytes meet its evens, the high nibbles its odds).

The product, per output ``(m, n)``, float32 with one rounding per operation
(no fused multiply-add). The zero point leaves the inner loop, as llama.cpp's
q4_1 x q8_1 dot keeps the block minimum out with the q8 block's ``d * sum
q``: ``sum_i (code_i - zero) * scale * d * q_i = scale * d * sum_i code_i q_i
- (scale * zero) * dq``, so the loop over codes is a plain unsigned-by-signed
integer dot:

* the block terms ``e_b = offset_nb * s_mb - (scale_nb * float(zero_nb)) *
  dq_mb`` (without offsets ``e_b = -((scale_nb * float(zero_nb)) * dq_mb)``):
  blocks ``8g + j`` of the whole groups of 8 go to lane ``j`` of ``terms``,
  ``terms[j] = terms[j] + e_b``, ``g`` in order; the last ``blocks % 8`` to a
  scalar ``tail = tail + e_b`` in order;
* the block dots, per block ``b`` in order: ``P[l]``, the exact integer sum of
  ``code * q`` over the inputs ``i`` of lane ``l`` (8 bits, block 16: ``2l,
  2l + 1``; block 32: those and ``16 + 2l, 17 + 2l``; 4 bits, block 16: with
  ``pos = (i % 2) * 8 + i // 2``, ``pos // 2 == l``; a last block 32 left
  alone: ``pos = (i % 2) * 16 + i // 2``, ``pos // 4 == l``), then ``sd =
  scale_nb * d_mb`` and, for each of 8 lanes, ``acc[l] = acc[l] + sd *
  float(P[l])``; 4 bits, blocks 32 in pairs: block ``b`` gives 4 lanes,
  inputs ``8l' .. 8l' + 7`` to lane ``4 (b % 2) + l'``, and only those
  change, ``acc[l] = acc[l] + sd * float(P[l])``;
* ``out = (tree(acc) + tree(terms)) + tail``, ``tree`` the 8 lanes summed as
  a fixed tree (``lane[i] += lane[i + width]``, width 4, 2, 1).

Signed 8-bit codes: a weight with 8 bits, block 32 and every ``code - zero``
in -128..127 (Q8_0, Q5_0, Q5_1 and Q5_K as imported; not Q6_K, block 16)
keeps the zero point in the codes instead, so that the dot runs on bytes (``maddubs`` of
``|w|`` and ``q`` signed as ``w``; a pair at most ``2 * 128 * 127``, no
saturation) rather than on 16-bit words. :func:`q8_matmul` checks this once
per weight object (one pass over the codes, remembered while the object
lives: do not change a weight's codes or zeros in place after its first use)
and otherwise takes the order above. The order differs in three places:

* ``P[l]`` is the exact sum of ``(code - zero) * q`` over inputs ``4l .. 4l +
  3`` of the block;
* the block terms are ``e_b = offset_nb * s_mb`` (same lanes, tail and tree);
* without offsets there are none: ``out = tree(acc)``.

The difference from the float64 product of ``x`` and the dequantized weight
is the rounding of ``x`` (at most about ``d_b / 2`` per input, so at most
``sum_b (d_b / 2) sum_i |scale_b (code_i - zero_b)|`` per output) plus a few
float32 roundings of ``sum |w| |x|`` and of the two sides of the zero point,
``sum_b scale_b d_b (sum_i code_i |q_i| + zero_b |sum_i q_i|)``.

Numba-callable pieces, for a jitted caller (plain arrays and ints; they
validate nothing, :func:`q8_matmul` does)::

    q8_quantize_row(x, bits, block_size, q, d, dq, sums)
        x     float32 [K], C-contiguous        (K a multiple of block_size)
        q     int8    [K]                      written, in the layout above
        d     float32 [K // block_size]        written
        dq    float32 [K // block_size]        written
        sums  float32 [K // block_size]        written
    q8_quantize(x, bits, block_size, q, d, dq, sums)
        the same for every row: x float32 [M, K], q int8 [M, K],
        d, dq and sums float32 [M, K // block_size]
    q8_gemm(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size,
            signed, chunks, out)               parallel over outputs
        q, d, dq, sums     from q8_quantize (C-contiguous)
        codes, zeros, scales               a BlockWeight's arrays (or the
                       compact form below: scales uint16, zeros one row
                       repeated)
        offsets        float32 or uint16 [N, K // block_size], or a float32
                       2-D array of shape [*, 0] for a weight without offsets
        signed         bool: the signed 8-bit order (only for 8 bits,
                       block 32, every code - zero in -128..127)
        chunks         int in 1 .. N: outputs split into this many chunks
                       (q8_matmul: 16 per thread, with
                       numba.set_parallel_chunksize(1) around the call)
        out            float32 [M, N], C-contiguous, written
    q8_gemm_portable(...)   the same arguments and bits, plain Numba loops

Compact form (:func:`_compact`, made once per weight object and remembered
while it lives, as the signed check): zero points that are one constant are
read as one row repeated (row stride 0); 8-bit codes whose scales and offsets
float16 holds exactly (Q8_0, Q5_0, Q5_1 as imported: the file's ``d`` and
``m`` are float16) read float16 copies (uint16 bit patterns, widened exactly
by ``vcvtph2ps`` or :func:`_half_bits`): 1.0625 bytes per weight for Q8_0, as
llama.cpp reads, not 1.16. Same values, same bits. The copies sit beside the
float32 arrays (other code reads those): 1/16 of the codes' size more memory
for Q8_0. One thread, M = 1, interleaved against the float32 form
(``scripts/bench_block_q8.py --threads 1 --m 1 --ways q8 q8f32``, load
0.8-3.3): SmolLM2's Q8_0 head 1.03-1.11x; float16 scales on the 4-bit shapes
(576 x 960 .. 576 x 3072, Q4_1) were 0.93-0.96x (not bound by memory at one
thread: 9-15 GMAC/s whether the weight is in L2 or not), so 4 bits keep
float32; the repeated zero row there 0.94-1.07x. A whole decode
(``scripts/bench_decode.py --rounds 5 --threads 1 --q8-forms``, load 3.3)
moved within the noise: 48.4 against 48.9 tokens/s (rounds vary by 1.5x).

``q8_gemm`` runs the AVX2 kernel (:mod:`.block_q8_ir`) when the host has
AVX2 (:data:`HAS_AVX2`), else ``q8_gemm_portable``: the integer part is
exact, the float part the same operations, so both give the same bits.
Rows go in tiles of 4, then 2, then 1, sharing each block's unpacked codes;
each row's arithmetic is the same in every tile.

Figures (``scripts/bench_block_q8.py --threads 1 --rounds 5``, this 2-core
AMD EPYC VM (AVX2) at load average 3.6-4.7 from other jobs, 2026-12-02;
SmolLM2-135M-Instruct Q4_1, layer 10, and the same codes and scales as Q4_0,
then ``--gguf`` Gemma-3-270M Q4_K_M, layer 10, ``--no-head``; median µs of
one call, ``block/q8`` and ``ort4/q8`` the median ratios of interleaved
rounds; ``err`` max |y - float64| / max |float64| at M = 4, onnxruntime's
``accuracy_level=4`` the same to two digits, block_matmul's and
``accuracy_level=0``'s 1e-7 to 2e-6; Q5_0 and Q8_0 run the signed 8-bit
path, Q6_K the 16-bit one)::

    weight          K x N     M    q8   block    ort0   ort4   block/q8 ort4/q8  err
    qkv q4_1        576 x 960    1     81     235     325    115     2.88    1.44
    qkv q4_1        576 x 960    4    228     493     702    246     1.97    1.06   1.4e-02
    qkv q4_0        576 x 960    1     88     219     371    136     2.79    1.10
    qkv q4_0        576 x 960    4    189     298     513    190     1.54    0.95   6.0e-03
    o q4_1          576 x 576    1     65     185     284    117     2.78    1.77
    o q4_1          576 x 576    4    132     276     392    165     2.10    1.14   1.2e-02
    o q4_0          576 x 576    1     62     175     216     84     2.76    1.24
    o q4_0          576 x 576    4    187     285     432    176     1.52    0.78   6.2e-03
    gate/up q4_1    576 x 3072   1    318     877    1301    382     2.76    1.23
    gate/up q4_1    576 x 3072   4    524    1154    2484    548     2.20    1.20   1.2e-02
    gate/up q4_0    576 x 3072   1    235     700     934    224     2.92    1.03
    gate/up q4_0    576 x 3072   4    521     862    1905    493     1.61    0.93   5.4e-03
    down q4_1      1536 x 576    1     96     299     527    160     3.08    1.69
    down q4_1      1536 x 576    4    247     562     930    272     2.21    0.99   7.3e-03
    down q4_0      1536 x 576    1    102     212     460    130     2.78    1.46
    down q4_0      1536 x 576    4    346     446     883    252     1.55    0.92   1.7e-02
    head q8_0       576 x 49152  1   7228   10526  600782   8590     1.29    1.29
    head q8_0       576 x 49152  4   9891   13277  587679  13221     1.24    1.34   5.3e-03
    q q5_0          640 x 1024   1     70     151    3748     72     2.25    1.03
    q q5_0          640 x 1024   4    142     225    4752    175     1.56    1.18   4.8e-03
    k q5_0          640 x 256    1     23      49     494     38     2.53    1.32
    k q5_0          640 x 256    4     35      50     369     41     1.45    1.15   4.9e-03
    v q8_0          640 x 256    1     24      62     455     41     2.54    1.74
    v q8_0          640 x 256    4     53      83     478     65     1.55    1.13   5.7e-03
    o q4_k         1024 x 640    1     56     179     305     99     3.13    1.74
    o q4_k         1024 x 640    4    150     314     474    154     2.01    1.08   6.7e-03
    gate/up q5_0    640 x 4096   1    194     467   28420    189     2.20    0.92
    gate/up q5_0    640 x 4096   4    499     611   20591    536     1.26    0.99   5.7e-03
    down q6_k      2048 x 640    1    131     209   12805    109     1.59    0.83
    down q6_k      2048 x 640    4    369     336   14841    306     0.91    0.86   4.0e-03

At this load absolute times are long and vary by 1.5x between runs (Gemma's
q at M = 1: 70 µs here, 126 µs in a run minutes earlier), ratios less so. On
one thread at M = 1 the kernel alone runs 13-18 GMAC/s on the 4-bit shapes
(CPU time; 576 x 960 fits the 512 KiB L2, 576 x 3072 does not). The Q8_0
head at M = 1 reads 33 MB a call and is bound by memory: 4.3-5.0 ms of CPU
time (6.6-7.7 GB/s) in the runs below, about what a plain loop reading one
byte per cache line of its 28 MB of codes achieves here (6.3-6.5 GB/s).

The signed 8-bit path against the 16-bit one it replaced, same process,
interleaved rounds (``q8_gemm``'s ``signed`` flag), median ratio of CPU
time (old / new), ``M = 1; M = 4``: one thread, two runs at load 1.7 and
4.5: SmolLM2's Q8_0 head 0.98-1.05; 1.15-1.16, Gemma's Q5_0 640 x 4096
1.17-1.19; 1.26-1.27 and 640 x 1024 1.13-1.18; 1.17-1.22 (14-17 GMAC/s at M
= 1, 20-22 at M = 4); two threads, load 3.3: head 1.01; 1.06, 640 x 4096
1.15; 1.15, 640 x 1024 1.07; 1.16. Results of these weights moved by at
most 6.4e-7 of the output's largest magnitude.

Steps (one thread, same process, against the step before): the output loop
in the IR (one call per span of outputs) took 576 x 960 Q4_1's kernel from
101 to 54 µs (wall); the zero point out of the inner loop, to 39 µs; blocks
of 32 in pairs, 1.09-1.18x at M = 1 (1.09-1.45x at M = 4, CPU time); the
buffers allocated in the jitted call, 1.09-1.18x on the 576-wide shapes at
M = 1 (CPU time); 8-bit codes on bytes with the zero point folded in, above.
Tried without a gain: blocks of 16 (Q6_K) on that path too, two blocks per
32 bytes as for 4 bits (0.89-0.91x at M = 1, 1.02-1.03x at M = 4);
``scale * d`` from a per-call buffer, two outputs interleaved per loop,
prefetching the codes of outputs 4 ahead, the last ``blocks % 8`` block
terms as lanes of one vector over the last 8 blocks (1-3%, within the noise;
the block terms take 13-27% of the time with offsets, 3-15% without,
measured by leaving them out).

On 2 threads the parallel region is what costs. At load 4.2-5.8 with
libgomp's default spin count, every Numba parallel region (q8_matmul's and
block_matmul's alike) took 4-15 ms a call for shapes that need 0.1-0.4 ms on
one thread, while onnxruntime's own pool stayed at 0.04-1 ms. With this
package's ``GOMP_SPINCOUNT`` bound (:mod:`pagedkv_np.threads`), at load
3.5-5.1, q8 on 2 threads took 155-430 µs at M = 1 (``--threads 2 --rounds
5 --no-head``: 1.45-2.2x block_matmul's rate, 0.27-0.79x onnxruntime
``accuracy_level=4``'s on 2 threads), no faster than one thread had been
(67-383 µs, at load 5.8-6.6): for products this small, call with ``numba.set_num_threads(1)`` (then
:func:`q8_matmul` starts no parallel region) unless the machine is idle.

The module is about 730 lines, 215 of them this docstring: the order it
documents, the quantization that feeds it and the portable loops that must
give its bits belong together (the IR is apart, in :mod:`.block_q8_ir`).
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from numba import prange, types
from numba.extending import overload

from .block_gemv import BlockWeight, product_operands
from .block_q8_ir import q8_span_intrinsic
from .jit import jit_kernel

__all__ = ["HAS_AVX2", "q8_matmul", "q8_operands", "q8_product", "q8_quantize_row",
           "q8_quantize", "q8_gemm", "q8_gemm_portable"]

#: whether the host CPU has AVX2 (then :func:`q8_gemm` runs the LLVM IR kernel)
HAS_AVX2 = llvm_binding.get_host_cpu_features().get("avx2", False)

# a weight without offsets: the kernels read offsets only when shape[1] != 0
_NO_OFFSETS = np.zeros((0, 0), np.float32)

# as block_matmul: 16 chunks per thread, handed out one at a time, so that a
# thread that loses its core on a busy machine holds back one small chunk
_CHUNKS_PER_THREAD = 16


def q8_matmul(x: np.ndarray, weight: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w`` with ``x`` rounded to int8 per weight block (see the module docstring).

    Parameters
    ----------
    x : ndarray, shape [M, K], float32
        Activations, one row per token (``M`` may be 0).
    weight : BlockWeight or NBits
        The weight; prepare it once with :meth:`BlockWeight.from_nbits` when
        it is used more than once.
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
        ``x`` is not 2-D with ``K`` columns, or ``out`` is not a writeable
        C-contiguous ``[M, N]`` array.
    """
    w, x, out = product_operands(x, weight, out)
    m, n = out.shape
    if m == 0:
        return out
    # numba.get_num_threads() costs 2-6 µs but in jitted code would keep
    # _matmul out of the disk cache
    threads = numba.get_num_threads()
    if threads == 1:                     # no parallel region to start
        q8_product(x, q8_operands(w), 0, out)
        return out
    before = numba.set_parallel_chunksize(1)
    try:
        q8_product(x, q8_operands(w), min(n, threads * _CHUNKS_PER_THREAD), out)
    finally:
        numba.set_parallel_chunksize(before)
    return out


def q8_operands(w: BlockWeight) -> tuple:
    """What :func:`q8_product` reads of ``w``: its codes, zero points, scales,
    offsets (the compact form where it has one), bits, block size and whether
    it takes the signed path; worked out once per weight object."""
    compact = _compact(w) if _USE_COMPACT else None
    if compact is not None:
        zeros, scales, offsets = compact
    else:
        zeros, scales = w.zeros, w.scales
        offsets = w.offsets if w.offsets is not None else _NO_OFFSETS
    return (w.codes, zeros, scales, offsets, w.bits, w.block_size, _signed(w))


def q8_product(x: np.ndarray, operands: tuple, chunks: int, out: np.ndarray) -> None:
    """:func:`q8_matmul`'s product without its checks, for a caller that checked
    the shapes once and owns the buffers: ``x`` a C-contiguous float32 ``[M,
    K]``, ``out`` a C-contiguous float32 ``[M, N]``, ``operands`` from
    :func:`q8_operands` of a ``[K, N]`` weight. ``chunks`` 0 runs on the calling
    thread; otherwise the outputs split into ``chunks`` chunks (best under
    ``numba.set_parallel_chunksize(1)``). Same bits either way."""
    # one jitted call that allocates, quantizes and multiplies (the five NumPy
    # allocations took 5.4 µs a call at load 4.4)
    _matmul(x, *operands, chunks, out)


# id(weight) -> whether its codes go signed; an entry leaves with its weight
_SIGNED_BY_ID: dict[int, bool] = {}


def _signed(w: BlockWeight) -> bool:
    """Whether ``w`` takes the signed 8-bit path (every ``code - zero`` fits
    int8), checked once per weight object (a pass over the codes: 30 ms for
    SmolLM2's head) and remembered while the object lives."""
    if w.bits != 8 or w.block_size != 32:
        return False
    key = id(w)
    found = _SIGNED_BY_ID.get(key)
    if found is None:
        found = bool(_fits_int8(w.codes, w.zeros, w.block_size))
        _SIGNED_BY_ID[key] = found
        weakref.finalize(w, _SIGNED_BY_ID.pop, key, None)
    return found


# whether q8_matmul reads a weight's compact form where it has one (False: the
# float32 arrays, as before; for measuring the difference)
_USE_COMPACT = True

# id(weight) -> its compact (zeros, scales, offsets) or None; leaves with its weight
_COMPACT_BY_ID: dict[int, tuple | None] = {}


def _compact(w: BlockWeight) -> tuple | None:
    """``w``'s zero points, scales and offsets in fewer bytes, or None: the zero
    points as one row repeated (row stride 0) where they are one constant; for
    8-bit codes, the scales and offsets as float16 bit patterns (uint16 ``[N,
    nb]``) where float16 holds every value exactly. Made once per weight object
    and remembered while it lives (as :func:`_signed`)."""
    key = id(w)
    if key in _COMPACT_BY_ID:
        return _COMPACT_BY_ID[key]
    zeros, scales = w.zeros, w.scales
    offsets = w.offsets if w.offsets is not None else _NO_OFFSETS
    constant = bool(zeros.size) and bool((zeros == zeros.flat[0]).all())
    if constant:
        zeros = np.lib.stride_tricks.as_strided(zeros[:1].copy(), zeros.shape, (0, 1),
                                                writeable=False)
    halves = [_as_halves(a) for a in (w.scales, w.offsets) if a is not None]
    narrow = w.bits == 8 and all(h is not None for h in halves)
    if narrow:
        scales = cast(np.ndarray, halves[0])
        offsets = cast(np.ndarray, halves[1]) if len(halves) > 1 else _NO_OFFSETS
    found = (zeros, scales, offsets) if constant or narrow else None
    _COMPACT_BY_ID[key] = found
    weakref.finalize(w, _COMPACT_BY_ID.pop, key, None)
    return found


def _as_halves(a: np.ndarray) -> np.ndarray | None:
    """``a`` (float32) as float16 bit patterns (uint16, C-contiguous) if float16
    holds every value exactly, else None."""
    with np.errstate(over="ignore"):
        half = a.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), a):
        return None
    return np.ascontiguousarray(half).view(np.uint16)


def float32_of(value):
    """``value`` as float32: a float32 as it is, a uint16 as the float16 whose
    bits it holds (exactly)."""
    if isinstance(value, np.uint16):
        return np.float32(np.array(value, np.uint16).view(np.float16))
    return np.float32(value)


@overload(float32_of)
def _float32_of_jit(value):
    if isinstance(value, types.Float):
        return lambda value: np.float32(value)
    if value == types.uint16:
        return lambda value: _half_bits(value)
    return None


@jit_kernel
def _half_bits(bits):
    """The float32 value of the float16 with bit pattern ``bits`` (exact)."""
    h = np.int64(bits)
    exponent = (h >> 10) & 31
    fraction = h & 1023
    if exponent == 31:
        value = np.inf if fraction == 0 else np.nan
    elif exponent == 0:
        value = fraction * 2.0 ** -24
    else:
        value = (1024 + fraction) * 2.0 ** (exponent - 25)
    return np.float32(-value if h & 0x8000 else value)


@jit_kernel
def _fits_int8(codes, zeros, block_size):
    """Whether every ``code - zero`` of 8-bit ``codes`` lies in -128..127."""
    for n in range(codes.shape[0]):
        for b in range(zeros.shape[1]):
            zero = np.int64(zeros[n, b])
            for i in range(b * block_size, (b + 1) * block_size):
                if not -128 <= np.int64(codes[n, i]) - zero <= 127:
                    return False
    return True


@jit_kernel
def _q_index(bits, block_size, num_blocks, b, i):
    """Where input ``i`` of block ``b`` goes in the quantized row (see the module
    docstring)."""
    if bits == 8:
        return b * block_size + i
    half = block_size // 2
    if block_size == 32 and b < num_blocks // 2 * 2:
        return b // 2 * 64 + i % 2 * 32 + b % 2 * 16 + i // 2
    return b * block_size + i % 2 * half + i // 2


@jit_kernel(error_model="numpy")
def q8_quantize_row(x, bits, block_size, q, d, dq, sums):
    """One row's int8 values, scales, scaled sums and block sums (see the module
    docstring)."""
    num_blocks = x.shape[0] // block_size
    for b in range(num_blocks):
        base = b * block_size
        amax = np.float32(0.0)
        for i in range(block_size):
            v = x[base + i]
            a = abs(v)
            if amax == amax and not a <= amax:    # a NaN stays, and reaches d
                amax = a
        db = amax / np.float32(127.0)
        d[b] = db
        usable = db > 0 and db < np.inf
        qsum = 0
        for i in range(block_size):
            value = 0
            if usable:
                r = np.rint(x[base + i] / db)
                if r >= -127 and r <= 127:
                    value = int(r)
            q[_q_index(bits, block_size, num_blocks, b, i)] = value
            qsum += value
        dq[b] = db * np.float32(qsum)
        sums[b] = dq[b]


@jit_kernel
def q8_quantize(x, bits, block_size, q, d, dq, sums):
    """:func:`q8_quantize_row` for every row of ``x``."""
    for m in range(x.shape[0]):
        q8_quantize_row(x[m], bits, block_size, q[m], d[m], dq[m], sums[m])


def _variants(num_rows):
    return [q8_span_intrinsic(bits, bs, num_rows, off)
            for bits in (4, 8) for bs in (16, 32) for off in (False, True)]




# (bits, block_size, offsets) in the order _variants makes them
_f4_16, _f4_16o, _f4_32, _f4_32o, _f8_16, _f8_16o, _f8_32, _f8_32o = _variants(4)
_t4_16, _t4_16o, _t4_32, _t4_32o, _t8_16, _t8_16o, _t8_32, _t8_32o = _variants(2)
_o4_16, _o4_16o, _o4_32, _o4_32o, _o8_16, _o8_16o, _o8_32, _o8_32o = _variants(1)


@jit_kernel
def _four(c, z, s, o, q, d, v, u, lo, hi, m, out, bits, block_size):
    """Outputs ``lo .. hi - 1`` of 4 rows from ``m`` on (``c, z, s, o``: the
    weight's codes, zeros, scales, offsets; ``q, d, v, u``: the rows' values,
    scales, scaled sums, block sums)."""
    if o.shape[1] != 0:
        if bits == 4 and block_size == 32:
            return _f4_32o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if bits == 4:
            return _f4_16o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if block_size == 32:
            return _f8_32o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        return _f8_16o(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if bits == 4 and block_size == 32:
        return _f4_32(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if bits == 4:
        return _f4_16(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if block_size == 32:
        return _f8_32(c, z, s, o, q, d, v, u, lo, hi, m, out)
    return _f8_16(c, z, s, o, q, d, v, u, lo, hi, m, out)


@jit_kernel
def _two(c, z, s, o, q, d, v, u, lo, hi, m, out, bits, block_size):
    """Outputs ``lo .. hi - 1`` of 2 rows from ``m`` on (``c, z, s, o``: the
    weight's codes, zeros, scales, offsets; ``q, d, v, u``: the rows' values,
    scales, scaled sums, block sums)."""
    if o.shape[1] != 0:
        if bits == 4 and block_size == 32:
            return _t4_32o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if bits == 4:
            return _t4_16o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if block_size == 32:
            return _t8_32o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        return _t8_16o(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if bits == 4 and block_size == 32:
        return _t4_32(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if bits == 4:
        return _t4_16(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if block_size == 32:
        return _t8_32(c, z, s, o, q, d, v, u, lo, hi, m, out)
    return _t8_16(c, z, s, o, q, d, v, u, lo, hi, m, out)


@jit_kernel
def _one(c, z, s, o, q, d, v, u, lo, hi, m, out, bits, block_size):
    """Outputs ``lo .. hi - 1`` of 1 row from ``m`` on (``c, z, s, o``: the
    weight's codes, zeros, scales, offsets; ``q, d, v, u``: the rows' values,
    scales, scaled sums, block sums)."""
    if o.shape[1] != 0:
        if bits == 4 and block_size == 32:
            return _o4_32o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if bits == 4:
            return _o4_16o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if block_size == 32:
            return _o8_32o(c, z, s, o, q, d, v, u, lo, hi, m, out)
        return _o8_16o(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if bits == 4 and block_size == 32:
        return _o4_32(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if bits == 4:
        return _o4_16(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if block_size == 32:
        return _o8_32(c, z, s, o, q, d, v, u, lo, hi, m, out)
    return _o8_16(c, z, s, o, q, d, v, u, lo, hi, m, out)


# 8 bits, block 32, signed, without and with offsets
_fs, _fso = (q8_span_intrinsic(8, 32, 4, off, signed=True) for off in (False, True))
_ts, _tso = (q8_span_intrinsic(8, 32, 2, off, signed=True) for off in (False, True))
_os, _oso = (q8_span_intrinsic(8, 32, 1, off, signed=True) for off in (False, True))


@jit_kernel
def _signed_span(c, z, s, o, q, d, v, u, lo, hi, m, out, num_rows):
    """:func:`_four`, :func:`_two` or :func:`_one` (``num_rows``) for 8-bit codes,
    block 32, with the zero point folded in."""
    if o.shape[1] != 0:
        if num_rows == 4:
            return _fso(c, z, s, o, q, d, v, u, lo, hi, m, out)
        if num_rows == 2:
            return _tso(c, z, s, o, q, d, v, u, lo, hi, m, out)
        return _oso(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if num_rows == 4:
        return _fs(c, z, s, o, q, d, v, u, lo, hi, m, out)
    if num_rows == 2:
        return _ts(c, z, s, o, q, d, v, u, lo, hi, m, out)
    return _os(c, z, s, o, q, d, v, u, lo, hi, m, out)


@jit_kernel
def _chunk_avx2(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed, lo, hi,
                out):
    """Outputs ``lo .. hi - 1`` of every row, rows in tiles of 4, 2, 1."""
    if lo >= hi:
        return
    num_rows = q.shape[0]
    fours, twos = num_rows // 4 * 4, num_rows // 2 * 2
    if signed:
        for m in range(0, fours, 4):
            _signed_span(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, m, out, 4)
        if twos > fours:
            _signed_span(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, fours, out, 2)
        if num_rows > twos:
            _signed_span(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, twos, out, 1)
        return
    for m in range(0, fours, 4):
        _four(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, m, out, bits, block_size)
    if twos > fours:
        _two(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, fours, out, bits, block_size)
    if num_rows > twos:
        _one(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, twos, out, bits, block_size)


@jit_kernel
def _lane(bits, block_size, paired, signed, i):
    """The accumulator lane of input ``i`` of a block (see the module docstring)."""
    if bits == 8:
        if signed:
            return i // 4
        return i // 2 if block_size == 16 else i // 2 % 8
    pos = i % 2 * (block_size // 2) + i // 2
    if block_size == 16:
        return pos // 2
    return i // 8 if paired else pos // 4


@jit_kernel
def _block_term(zeros, scales, offsets, dq, sums, signed, n, m, b):
    """``offset * s - (scale * zero) * dq`` of block ``b``, ``offset * s`` when
    ``signed`` (see the module docstring)."""
    if signed:
        return float32_of(offsets[n, b]) * sums[m, b]
    minus = (float32_of(scales[n, b]) * np.float32(zeros[n, b])) * dq[m, b]
    if offsets.shape[1] != 0:
        return float32_of(offsets[n, b]) * sums[m, b] - minus
    return -minus


@jit_kernel
def _chunk_portable(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed,
                    lo, hi, out):
    """:func:`_chunk_avx2`'s outputs, the same operations in plain loops."""
    num_blocks = scales.shape[1]
    groups = num_blocks // 8
    half = block_size // 2
    lanes = np.empty(8, np.int64)
    acc = np.empty(8, np.float32)
    terms = np.empty(8, np.float32)
    for n in range(lo, hi):
        for m in range(q.shape[0]):
            terms[:] = 0
            for g in range(groups):
                for j in range(8):
                    terms[j] = terms[j] + _block_term(zeros, scales, offsets, dq, sums,
                                                      signed, n, m, 8 * g + j)
            tail = np.float32(0.0)
            for b in range(8 * groups, num_blocks):
                tail = tail + _block_term(zeros, scales, offsets, dq, sums, signed, n, m, b)
            acc[:] = 0
            for b in range(num_blocks):
                paired = bits == 4 and block_size == 32 and b < num_blocks // 2 * 2
                lanes[:] = 0
                for i in range(block_size):
                    if bits == 4:
                        byte = np.int64(codes[n, b * half + i // 2])
                        code = byte >> 4 if i % 2 else byte & 15
                    else:
                        code = np.int64(codes[n, b * block_size + i])
                        if signed:
                            code -= np.int64(zeros[n, b])
                    lanes[_lane(bits, block_size, paired, signed, i)] += code * np.int64(
                        q[m, _q_index(bits, block_size, num_blocks, b, i)])
                sd = float32_of(scales[n, b]) * d[m, b]
                if paired:               # lanes 4 (b % 2) .. 4 (b % 2) + 3
                    for lane in range(4):
                        at = 4 * (b % 2) + lane
                        acc[at] = acc[at] + sd * np.float32(lanes[lane])
                else:
                    for lane in range(8):
                        acc[lane] = acc[lane] + sd * np.float32(lanes[lane])
            _tree(acc)
            if signed and offsets.shape[1] == 0:
                out[m, n] = acc[0]
            else:
                _tree(terms)
                out[m, n] = (acc[0] + terms[0]) + tail


@jit_kernel
def _tree(lanes):
    """``lanes[0]``: the 8 lanes summed as a fixed tree (width 4, 2, 1)."""
    width = 4
    while width:
        for i in range(width):
            lanes[i] = lanes[i] + lanes[i + width]
        width //= 2


# chosen here, not by a branch in jitted code: a host without AVX2 never
# compiles the AVX2 intrinsics (its code generator could not select them)
_chunk = _chunk_avx2 if HAS_AVX2 else _chunk_portable


@jit_kernel(parallel=True)
def q8_gemm(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed, chunks,
            out):
    """Every output of the quantized rows (see the module docstring); the AVX2
    kernel where the host has it."""
    n_total = codes.shape[0]
    for c in prange(chunks):
        lo, hi = c * n_total // chunks, (c + 1) * n_total // chunks
        _chunk(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed, lo, hi,
               out)


@jit_kernel
def _matmul(x, codes, zeros, scales, offsets, bits, block_size, signed, chunks, out):
    """:func:`q8_quantize` into new buffers, then :func:`q8_gemm` in ``chunks``
    chunks, or on the calling thread when ``chunks`` is 0."""
    num_rows, k = x.shape
    num_blocks = k // block_size
    q = np.empty((num_rows, k), np.int8)
    d = np.empty((num_rows, num_blocks), np.float32)
    dq = np.empty((num_rows, num_blocks), np.float32)
    sums = np.empty((num_rows, num_blocks), np.float32)
    q8_quantize(x, bits, block_size, q, d, dq, sums)
    if chunks == 0:
        _chunk(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed, 0,
               codes.shape[0], out)
    else:
        q8_gemm(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed, chunks,
                out)


@jit_kernel(parallel=True)
def q8_gemm_portable(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed,
                     chunks, out):
    """:func:`q8_gemm` in plain Numba loops: the same bits, on any CPU."""
    n_total = codes.shape[0]
    for c in prange(chunks):
        lo, hi = c * n_total // chunks, (c + 1) * n_total // chunks
        _chunk_portable(q, d, dq, sums, codes, zeros, scales, offsets, bits, block_size, signed,
                        lo, hi, out)
