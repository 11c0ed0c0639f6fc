"""Private Numba kernels of the int8 store: quantize on write, dequantize on gather.

They repeat :mod:`pagedkv_np.quant`'s reference step by step in float32
(one division, ``rint``, one multiplication each, never fused), so results
equal the NumPy reference bit for bit. Numba has no float16 or bfloat16, so
K/V data arrive as ``uint16`` views of their bits with a ``kind`` that says how to
read them (float32 arrives as it is), and 16-bit outputs are rounded to
nearest-even by integer arithmetic (:func:`_f32_bits_to_f16`,
:func:`_f32_bits_to_bf16`).

Every function and constant the kernels use is defined in this file:
Numba's disk cache keys compiled code by its own source file, so a helper
imported from elsewhere could change without the cached kernels noticing.
The constants below equal those of :mod:`pagedkv_np.quant` (a test checks).

As in :mod:`pagedkv_np.backends._numba_kernels`, each operation has a serial
kernel and a ``parallel=True`` one (separate functions, since the disk cache
does not key code by that flag); neither validates anything.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .._jit import jit_kernel

KIND_F32, KIND_F16, KIND_BF16 = 0, 1, 2

QMAX = np.float32(127.0)
SCALE_MIN = np.float32(2.0 ** -126)                 # quant.SCALE_MIN
SCALE_MAX = np.uint32(0x7C010203).view(np.float32)  # quant.SCALE_MAX (a test checks)
F32_MAX = np.float32(np.finfo(np.float32).max)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
# Adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude below
# 2**22 to an integer, half to even: rint, in two operations that vectorize.
RNE_MAGIC = np.float32(12582912.0)
SUBNORMAL_F16 = np.float32(2.0 ** -24)  # the smallest float16 subnormal

# As in _numba_kernels: chunks of at least this many bytes written, at most
# this many chunks, per parallel call.
_MAX_CHUNKS = 256
_MIN_CHUNK_BYTES = 256 << 10


# ------------------------------------------------------------ conversions
# On bits (uint32 for float32): a scalar ``.view`` between float and integer
# stops a loop from vectorizing, so values change type only through two
# views of one scratch array.
@jit_kernel
def _widen_f16(xg, bits, vals):
    """float32 of the float16 bits ``xg`` into ``vals`` (exact, NaN and
    subnormals included), in two branch-free passes: bits for the normal,
    infinite and NaN ones, then values for the subnormal ones, each
    ``m * 2**-24`` in float32 arithmetic (exact)."""
    for e in range(xg.shape[0]):
        h = np.uint32(xg[e])
        sign = (h & 0x8000) << 16
        em = h & 0x7FFF
        normal = sign | ((em << 13) + 0x38000000)
        special = sign | 0x7F800000 | ((h & 0x3FF) << 13)
        bits[e] = special if em >= 0x7C00 else (normal if em >= 0x400 else sign)
    for e in range(xg.shape[0]):
        h = np.uint32(xg[e])
        em = h & 0x7FFF
        sub = np.float32(em) * SUBNORMAL_F16
        sub = -sub if (h & 0x8000) != 0 else sub
        vals[e] = sub if em < 0x400 else vals[e]


@jit_kernel
def _f32_bits_to_f16(b):
    """float16 bits of float32 bits ``b``, rounded to nearest, ties to even.
    Every case is computed and one selected, in int32 (1.6x faster than in
    int64: twice the lanes), so that loops over it vectorize."""
    i32 = np.int32
    b = i32(b)
    sign = (b >> 16) & i32(0x8000)
    a = b & i32(0x7FFFFFFF)
    r = a - i32(0x38000000)  # a normal float16: rebias, round on bit 13
    normal = (r + i32(0xFFF) + ((r >> 13) & i32(1))) >> 13
    # a subnormal float16 (or zero): the significand shifted down, rounded
    shift = min(max(i32(126) - (a >> 23), i32(1)), i32(31))
    m = (a & i32(0x7FFFFF)) | i32(0x800000)
    q = m >> shift
    rest = m & ((i32(1) << shift) - i32(1))
    half = i32(1) << (shift - i32(1))
    up = (rest > half) | ((rest == half) & ((q & i32(1)) != i32(0)))
    sub = q + i32(up)
    out = sub if a < i32(0x38800000) else normal
    out = i32(0x7C00) if a >= i32(0x477FF000) else out  # from 65520 up: infinity
    out = i32(0x7E00) if a > i32(0x7F800000) else out   # NaN (never made by a dequantization)
    return np.uint16(sign | out)


@jit_kernel
def _f32_bits_to_bf16(b):
    """bfloat16 bits of finite float32 bits ``b``, rounded to nearest, ties to even."""
    b = np.uint32(b)
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


# -------------------------------------------------------------------- write
# Rows are 1-D views (a token's head in the input, a slot's head in the
# store): loops over a view's own elements compile to vector code, where
# flat indices computed per element did not.
@jit_kernel(error_model="numpy")
def _quantize_row_f32(xr, cr, sr, group):
    """Quantize one head's float32 ``xr`` [head_dim] into codes ``cr`` and
    scales ``sr`` (see :mod:`pagedkv_np.quant`). No branch but the loops'
    own, selects only, and no call per group: both loops vectorize (a
    branch for zero scales, or a function per group, made this 2.5x slower)."""
    for g in range(sr.shape[0]):
        xg = xr[g * group:(g + 1) * group]
        cg = cr[g * group:(g + 1) * group]
        # the largest finite magnitude: NaN fails the comparison, infinity
        # is left out, and a subnormal largest one gives a zero scale below
        amax = ZERO
        for e in range(group):
            mag = abs(xg[e])
            mag = mag if mag <= F32_MAX else ZERO
            amax = mag if mag > amax else amax
        scale = amax / QMAX
        scale = SCALE_MAX if scale > SCALE_MAX else scale
        scale = ZERO if scale < SCALE_MIN else scale
        sr[g] = scale
        nonzero = scale > ZERO
        divisor = scale if nonzero else ONE  # a zero scale's codes are all 0
        for e in range(group):
            f = xg[e]
            f = f if abs(f) >= SCALE_MIN else ZERO  # NaN and subnormals count as 0
            q = (f / divisor + RNE_MAGIC) - RNE_MAGIC  # rint: |f / scale| <= 128 or inf
            q = q if q < QMAX else QMAX  # an infinity saturates
            q = q if q > -QMAX else -QMAX
            q = q if nonzero else ZERO
            cg[e] = np.int32(q)


@jit_kernel(error_model="numpy")
def _quantize_row_16(xr, cr, sr, group, kind, bits, vals):
    """:func:`_quantize_row_f32` for the bits of a 16-bit type, widened
    first into ``bits``/``vals`` (two views of one scratch row)."""
    if kind == KIND_BF16:
        for e in range(xr.shape[0]):
            bits[e] = np.uint32(xr[e]) << 16
    else:
        _widen_f16(xr, bits, vals)
    _quantize_row_f32(vals, cr, sr, group)


@jit_kernel(error_model="numpy")
def _write_q_tokens(codes, scales, x, kind, layer, slot_mapping, hnd, group, lo, hi):
    """Quantize tokens ``lo..hi-1`` of ``x`` [N, H, D] (bits, any strides)
    into their slots of ``codes``/``scales``."""
    _, num_pages, a, b, head_dim = codes.shape
    page_size, num_heads = (b, a) if hnd else (a, b)
    crows = codes.reshape(-1, head_dim)
    srows = scales.reshape(-1, scales.shape[4])
    bits = np.empty(head_dim, np.uint32)
    vals = bits.view(np.float32)
    layer_page0 = layer * num_pages
    for i in range(lo, hi):
        slot = slot_mapping[i]
        if slot < 0:
            continue
        page_id = slot // page_size
        offset = slot - page_id * page_size
        for h in range(num_heads):
            if hnd:
                row = ((layer_page0 + page_id) * num_heads + h) * page_size + offset
            else:
                row = ((layer_page0 + page_id) * page_size + offset) * num_heads + h
            if kind == KIND_F32:
                _quantize_row_f32(x[i, h], crows[row], srows[row], group)
            else:
                _quantize_row_16(x[i, h], crows[row], srows[row], group, kind, bits, vals)


@jit_kernel(error_model="numpy")
def write_q_serial(k_codes, v_codes, k_scales, v_scales, layer, slot_mapping, k, v, kind,
                   hnd, group):
    """Quantize ``k``/``v`` [N, H, D] into the slots of ``slot_mapping`` [N] (-1 skips)."""
    n = slot_mapping.shape[0]
    _write_q_tokens(k_codes, k_scales, k, kind, layer, slot_mapping, hnd, group, 0, n)
    _write_q_tokens(v_codes, v_scales, v, kind, layer, slot_mapping, hnd, group, 0, n)


@jit_kernel(parallel=True, error_model="numpy")
def write_q_parallel(k_codes, v_codes, k_scales, v_scales, layer, slot_mapping, k, v, kind,
                     hnd, group):
    """:func:`write_q_serial` split into token chunks across threads."""
    n = slot_mapping.shape[0]
    nbytes = 2 * n * k.shape[1] * k.shape[2] * k.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    for c in prange(num_chunks):
        lo, hi = c * n // num_chunks, (c + 1) * n // num_chunks
        _write_q_tokens(k_codes, k_scales, k, kind, layer, slot_mapping, hnd, group, lo, hi)
        _write_q_tokens(v_codes, v_scales, v, kind, layer, slot_mapping, hnd, group, lo, hi)


# ------------------------------------------------------------------- gather
@jit_kernel(error_model="numpy")
def _dequant_row_f32(cr, sr, orow, group):
    """One head's codes ``cr`` [head_dim] with scales ``sr`` into float32 ``orow``.
    (A function of its own: with the 16-bit loops beside it, this loop ran
    at half the speed.)"""
    for g in range(sr.shape[0]):
        scale = sr[g]
        cg = cr[g * group:(g + 1) * group]
        og = orow[g * group:(g + 1) * group]
        for e in range(group):
            og[e] = np.float32(cg[e]) * scale


@jit_kernel(error_model="numpy")
def _dequant_row_f16(cr, sr, orow, group, bits, vals):
    """:func:`_dequant_row_f32` into float16 bits, through ``bits``/``vals``
    (int32 and float32 views of one scratch array of ``group``)."""
    for g in range(sr.shape[0]):
        scale = sr[g]
        cg = cr[g * group:(g + 1) * group]
        og = orow[g * group:(g + 1) * group]
        for e in range(group):
            vals[e] = np.float32(cg[e]) * scale
        for e in range(group):
            og[e] = _f32_bits_to_f16(bits[e])


@jit_kernel(error_model="numpy")
def _dequant_row_bf16(cr, sr, orow, group, bits, vals):
    """:func:`_dequant_row_f16` into bfloat16 bits (a function of its own:
    each loop beside the other ran slower)."""
    for g in range(sr.shape[0]):
        scale = sr[g]
        cg = cr[g * group:(g + 1) * group]
        og = orow[g * group:(g + 1) * group]
        for e in range(group):
            vals[e] = np.float32(cg[e]) * scale
        for e in range(group):
            og[e] = _f32_bits_to_bf16(bits[e])


@jit_kernel(error_model="numpy")
def _gather_q_blocks(codes, scales, out, kind, layer, page_table, seq_lens, hnd, bhtd, group,
                     lo, hi):
    """Fill blocks ``lo..hi-1`` of ``out`` (C-contiguous); block
    ``b * num_blocks + j`` is positions ``[j * page_size, (j + 1) * page_size)``
    of sequence ``b``, dequantized from page ``page_table[b, j]`` below
    ``seq_lens[b]`` and zero from there."""
    _, num_pages, a, b_, head_dim = codes.shape
    page_size, num_heads = (b_, a) if hnd else (a, b_)
    num_positions = out.shape[2] if bhtd else out.shape[1]
    num_blocks = (num_positions + page_size - 1) // page_size
    crows = codes.reshape(-1, head_dim)
    srows = scales.reshape(-1, scales.shape[4])
    orows = out.reshape(-1, head_dim)
    bits = np.empty(group, np.int32)  # int32: the float16 rounding vectorizes on it
    vals = bits.view(np.float32)
    layer_page0 = layer * num_pages
    for item in range(lo, hi):
        seq = item // num_blocks
        j = item - seq * num_blocks
        t0 = j * page_size
        t1 = min(t0 + page_size, num_positions)
        n = seq_lens[seq]
        page_id = page_table[seq, j] if t0 < n else 0
        # heads outside, positions inside for BHTD, so that writes run in order
        for outer in range(num_heads if bhtd else t1 - t0):
            for inner in range(t1 - t0 if bhtd else num_heads):
                h, dt = (outer, inner) if bhtd else (inner, outer)
                t = t0 + dt
                if bhtd:
                    orow = orows[(seq * num_heads + h) * num_positions + t]
                else:
                    orow = orows[(seq * num_positions + t) * num_heads + h]
                if t >= n:
                    orow[:] = 0
                    continue
                if hnd:
                    row = ((layer_page0 + page_id) * num_heads + h) * page_size + dt
                else:
                    row = ((layer_page0 + page_id) * page_size + dt) * num_heads + h
                if kind == KIND_F32:
                    _dequant_row_f32(crows[row], srows[row], orow, group)
                elif kind == KIND_F16:
                    _dequant_row_f16(crows[row], srows[row], orow, group, bits, vals)
                else:
                    _dequant_row_bf16(crows[row], srows[row], orow, group, bits, vals)


@jit_kernel
def _num_blocks(codes, out, hnd, bhtd):
    page_size = codes.shape[3] if hnd else codes.shape[2]
    num_positions = out.shape[2] if bhtd else out.shape[1]
    return out.shape[0] * ((num_positions + page_size - 1) // page_size)


@jit_kernel(error_model="numpy")
def gather_q_serial(k_codes, v_codes, k_scales, v_scales, layer, page_table, seq_lens, k_out,
                    v_out, kind, hnd, bhtd, group):
    """Dequantize sequences [B] of ``page_table`` [B, max_pages] into ``k_out``/``v_out``."""
    n = _num_blocks(k_codes, k_out, hnd, bhtd)
    _gather_q_blocks(k_codes, k_scales, k_out, kind, layer, page_table, seq_lens, hnd, bhtd,
                     group, 0, n)
    _gather_q_blocks(v_codes, v_scales, v_out, kind, layer, page_table, seq_lens, hnd, bhtd,
                     group, 0, n)


@jit_kernel(parallel=True, error_model="numpy")
def gather_q_parallel(k_codes, v_codes, k_scales, v_scales, layer, page_table, seq_lens,
                      k_out, v_out, kind, hnd, bhtd, group):
    """:func:`gather_q_serial` split into chunks of blocks across threads."""
    n = _num_blocks(k_codes, k_out, hnd, bhtd)
    nbytes = 2 * k_out.size * k_out.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    for c in prange(num_chunks):
        lo, hi = c * n // num_chunks, (c + 1) * n // num_chunks
        _gather_q_blocks(k_codes, k_scales, k_out, kind, layer, page_table, seq_lens, hnd,
                         bhtd, group, lo, hi)
        _gather_q_blocks(v_codes, v_scales, v_out, kind, layer, page_table, seq_lens, hnd,
                         bhtd, group, lo, hi)
