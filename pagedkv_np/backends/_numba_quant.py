"""Private Numba kernels of the int8 store: quantize on write, dequantize on gather.

They repeat :mod:`pagedkv_np.quant`'s reference step by step in float32
(one division, ``rint``, one multiplication each, never fused), so results
equal the NumPy reference bit for bit. Numba has no float16 or bfloat16, so
K/V data arrive as unsigned integer views of their bits (``uint32`` for
float32, ``uint16`` for the 16-bit types) with a ``kind`` that says how to
read them, and 16-bit outputs are rounded to nearest-even by integer
arithmetic (:func:`_f32_to_f16`, :func:`_f32_to_bf16`).

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

# As in _numba_kernels: chunks of at least this many bytes written, at most
# this many chunks, per parallel call.
_MAX_CHUNKS = 256
_MIN_CHUNK_BYTES = 256 << 10


# ------------------------------------------------------------ conversions
@jit_kernel
def _f16_to_f32(h):
    """float32 of float16 bits ``h`` (exact, subnormals and NaN included)."""
    h = np.uint32(h)
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        bits = sign | 0x7F800000 | (m << 13)
    elif e != 0:
        bits = sign | ((e + 112) << 23) | (m << 13)
    elif m == 0:
        bits = sign
    else:  # subnormal: normalise the significand
        e2 = np.uint32(113)
        while (m & 0x400) == 0:
            m <<= 1
            e2 -= 1
        bits = sign | (e2 << 23) | ((m & 0x3FF) << 13)
    return np.uint32(bits).view(np.float32)


@jit_kernel
def _to_f32(bits, kind):
    """float32 value of one input element given as bits."""
    if kind == KIND_F32:
        return np.uint32(bits).view(np.float32)
    if kind == KIND_BF16:
        return np.uint32(np.uint32(bits) << 16).view(np.float32)
    return _f16_to_f32(bits)


@jit_kernel
def _f32_to_f16(value):
    """float16 bits of float32 ``value``, rounded to nearest, ties to even."""
    b = np.uint32(np.float32(value).view(np.uint32))
    sign = np.uint32((b >> 16) & 0x8000)
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN (never made by a dequantization)
        return np.uint16(sign | 0x7E00)
    if a >= 0x477FF000:  # from 65520 up: infinity
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:  # a normal float16
        r = a - 0x38000000
        return np.uint16(sign | ((r + 0xFFF + ((r >> 13) & 1)) >> 13))
    if a < 0x33000000:  # below half the smallest subnormal
        return np.uint16(sign)
    shift = np.uint32(126 - (a >> 23))
    m = (a & 0x7FFFFF) | 0x800000
    r = m >> shift
    rest = m & ((np.uint32(1) << shift) - 1)
    half = np.uint32(1) << (shift - 1)
    if rest > half or (rest == half and (r & 1) != 0):
        r += 1
    return np.uint16(sign | r)


@jit_kernel
def _f32_to_bf16(value):
    """bfloat16 bits of a finite float32 ``value``, rounded to nearest, ties to even."""
    b = np.uint32(np.float32(value).view(np.uint32))
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


# -------------------------------------------------------------------- write
@jit_kernel(error_model="numpy")
def _quantize_group(x, i, h, d0, group, kind, vals):
    """Widen and clean one group of ``x[i, h, d0:d0 + group]`` into ``vals``;
    returns its scale (see :mod:`pagedkv_np.quant`)."""
    amax = ZERO
    for e in range(group):
        f = _to_f32(x[i, h, d0 + e], kind)
        mag = abs(f)
        if mag >= SCALE_MIN and mag <= F32_MAX:
            vals[e] = f
            if mag > amax:
                amax = mag
        elif mag > F32_MAX:  # an infinity: saturates, not counted
            vals[e] = f
        else:  # NaN or subnormal
            vals[e] = ZERO
    scale = amax / QMAX
    if scale > SCALE_MAX:
        scale = SCALE_MAX
    if scale < SCALE_MIN:
        scale = ZERO
    return scale


@jit_kernel(error_model="numpy")
def _write_q_tokens(codes, scales, x, kind, layer, slot_mapping, hnd, group, lo, hi):
    """Quantize tokens ``lo..hi-1`` of ``x`` [N, H, D] (bits, any strides)
    into their slots of ``codes``/``scales`` (flat views of the store)."""
    _, num_pages, a, b, head_dim = codes.shape
    page_size, num_heads = (b, a) if hnd else (a, b)
    num_groups = head_dim // group
    cflat = codes.reshape(-1)
    sflat = scales.reshape(-1)
    vals = np.empty(group, np.float32)
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
            for g in range(num_groups):
                scale = _quantize_group(x, i, h, g * group, group, kind, vals)
                sflat[row * num_groups + g] = scale
                c0 = row * head_dim + g * group
                if scale == ZERO:
                    for e in range(group):
                        cflat[c0 + e] = 0
                    continue
                for e in range(group):
                    q = np.rint(vals[e] / scale)
                    if q > QMAX:
                        q = QMAX
                    elif q < -QMAX:
                        q = -QMAX
                    cflat[c0 + e] = np.int8(q)


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
def _dequant_row(cflat, c0, sflat, s0, oflat, o0, head_dim, group, kind):
    """``head_dim`` values of codes from ``c0`` with scales from ``s0`` into
    the output from ``o0`` (float32 values, or the bits of a 16-bit type);
    one loop per output kind."""
    num_groups = head_dim // group
    for g in range(num_groups):
        scale = sflat[s0 + g]
        base = g * group
        if kind == KIND_F32:
            for e in range(group):
                oflat[o0 + base + e] = np.float32(cflat[c0 + base + e]) * scale
        elif kind == KIND_F16:
            for e in range(group):
                oflat[o0 + base + e] = _f32_to_f16(np.float32(cflat[c0 + base + e]) * scale)
        else:
            for e in range(group):
                oflat[o0 + base + e] = _f32_to_bf16(np.float32(cflat[c0 + base + e]) * scale)


@jit_kernel(error_model="numpy")
def _gather_q_blocks(codes, scales, out, kind, layer, page_table, seq_lens, hnd, bhtd, group,
                     lo, hi):
    """Fill blocks ``lo..hi-1`` of ``out`` (C-contiguous); block
    ``b * num_blocks + j`` is positions ``[j * page_size, (j + 1) * page_size)``
    of sequence ``b``, dequantized from page ``page_table[b, j]`` below
    ``seq_lens[b]`` and zero from there."""
    _, num_pages, a, b_, head_dim = codes.shape
    page_size, num_heads = (b_, a) if hnd else (a, b_)
    num_groups = head_dim // group
    num_positions = out.shape[2] if bhtd else out.shape[1]
    num_blocks = (num_positions + page_size - 1) // page_size
    cflat = codes.reshape(-1)
    sflat = scales.reshape(-1)
    oflat = out.reshape(-1)
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
                    o0 = ((seq * num_heads + h) * num_positions + t) * head_dim
                else:
                    o0 = ((seq * num_positions + t) * num_heads + h) * head_dim
                if t >= n:
                    for e in range(head_dim):
                        oflat[o0 + e] = 0
                    continue
                if hnd:
                    row = ((layer_page0 + page_id) * num_heads + h) * page_size + dt
                else:
                    row = ((layer_page0 + page_id) * page_size + dt) * num_heads + h
                _dequant_row(cflat, row * head_dim, sflat, row * num_groups, oflat, o0,
                             head_dim, group, kind)


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
