"""Private Numba kernels of the int8 store: quantize on write, dequantize on gather.

They repeat :mod:`pagedkv_np.quant`'s reference step by step in float32
(one division, ``rint``, one multiplication each, never fused), so results
equal the NumPy reference bit for bit. Numba has no float16 or bfloat16, so
K/V data arrive as ``uint16`` views of their bits with a ``kind`` that says
how to read them (float32 arrives as it is).

The arithmetic is written as LLVM IR, a group of 32 values (the format's
group) in one vector per step, so that it compiles to straight vector code
whatever LLVM's loop vectorizer makes of a loop (the Numba loops this
replaced wrote at 0.1-0.3 of the speed of a copy of their input, and
gathered into 16-bit types at 0.2 of a copy of their output):

* 16-bit types convert by integer arithmetic on the bits, every case
  computed and one selected (:func:`_f16_bits`, :func:`_bf16_bits`,
  :func:`_widen_f16_bits`); the results equal NumPy's and ml_dtypes'
  ``astype`` for every input, NaN included (NumPy truncates a NaN's payload
  to float16 without quieting it, ml_dtypes makes every NaN ``0x7FC0``).
  Where the target CPU has them, a gather rounds with its conversion
  instructions instead (F16C's ``vcvtps2ph``, AVX512-BF16's
  ``vcvtneps2bf16``, through LLVM's ``half`` and ``bfloat``): on the
  products of a code and a scale the format stores (normal or zero), never
  NaN nor subnormal, they round exactly as NumPy and ml_dtypes do (in the
  gather of 32 x 2048 x 8 x 128, 15 against 24 ms for float16 on one
  thread); writes widen float16 with F16C's ``vcvtph2ps`` (exact; the
  NaNs it quiets count as 0 anyway). Without them LLVM would call runtime
  functions that a JIT may not find, so the integer code stays for other
  CPUs. Numba's disk cache keys code by the target CPU and its features,
  so code built for one CPU is never loaded on another.
* a large gather writes its output with non-temporal (streaming) stores,
  which skip reading each destination line first: its output does not fit
  in the cache, and those reads cost a third of the memory traffic. Writes
  stream the codes, whose destinations are new positions. Each page a
  gather reads (in the table's order, anywhere in the store) is fetched
  while the page before it is dequantized.
* a ``head_dim`` that 32 does not divide (one group per head of another
  size) or a strided ``head_dim`` axis takes a scalar loop of the same
  arithmetic.

Every function and constant the kernels use is defined in this file:
Numba's disk cache keys compiled code by its own source file, so a helper
imported from elsewhere could change without the cached kernels noticing
(which is also why this file runs past the usual length). The constants
below equal those of :mod:`pagedkv_np.quant` (a test checks).

With ``NUMBA_BOUNDSCHECK=1`` every run of values is checked against its
arrays' extents; a run outside is skipped and counted, and the kernel raises
IndexError at its end (exceptions raised inside a ``prange`` body are lost).
As in :mod:`pagedkv_np.backends._numba_kernels`, each operation has a
serial kernel and a ``parallel=True`` one (separate functions, since the
disk cache does not key code by that flag); neither validates anything.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import jit_kernel

KIND_F32, KIND_F16, KIND_BF16 = 0, 1, 2

QMAX = np.float32(127.0)
SCALE_MIN = np.float32(2.0 ** -126)                 # quant.SCALE_MIN
SCALE_MAX = np.uint32(0x7C010203).view(np.float32)  # quant.SCALE_MAX (a test checks)
F32_MAX = np.float32(np.finfo(np.float32).max)

# As in _numba_kernels: chunks of at least this many bytes written, at most
# this many chunks, per parallel call.
_MAX_CHUNKS = 256
_MIN_CHUNK_BYTES = 256 << 10
# prange turns of a parallel kernel, at least as many as threads: each turn
# takes the next chunk until none is left, so that a thread the system has
# set aside leaves its share to the others instead of making them wait (a
# static split of the chunks took up to twice as long on a busy machine).
# A constant, since a kernel that asks Numba for its thread count cannot be
# cached on disk.
_TURNS = 64

_OUT_OF_BOUNDS = "pagedkv_np kernel: a run of values falls outside its array"

_LANES = 32  # values per vector: one group of the format (quant.GROUP_SIZE)
_STORE_BYTES = 16  # streaming stores of one SSE register: every x86-64 CPU has them
_I1, _I8, _I16, _I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_I8P = _I8.as_pointer()
_ITEMSIZE = {KIND_F32: 4, KIND_F16: 2, KIND_BF16: 2}


# ------------------------------------------------------ IR building blocks
# Each helper works lane by lane on a scalar or a vector of any width, so
# the vector code and the scalar loops share one definition of the arithmetic.
def _lanes(elem, like):
    """``elem`` with as many lanes as the type ``like``."""
    return ir.VectorType(elem, like.count) if isinstance(like, ir.VectorType) else elem


def _const(ty, value):
    """``value`` in every lane of ``ty`` (integers as 32-bit two's complement)."""
    elem = ty.element if isinstance(ty, ir.VectorType) else ty
    if isinstance(elem, ir.IntType) and value >= 1 << (elem.width - 1):
        value -= 1 << elem.width
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _splat(b, value, n):
    vt = ir.VectorType(value.type, n)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return b.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _rint_i32(b, x):
    """``llvm.lrint`` of float32 lanes into i32 lanes: one conversion that
    rounds to nearest, ties to even (the CPU's mode, as NumPy's ``rint``)."""
    i32 = _lanes(_I32, x.type)
    n = x.type.count if isinstance(x.type, ir.VectorType) else 0
    suffix = f"v{n}i32.v{n}f32" if n else "i32.f32"
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(i32, [x.type]),
                                        f"llvm.lrint.{suffix}")
    return b.call(fn, [x])


def _widen_f16_bits(b, h):
    """float32 bits (i32 lanes) of float16 bits ``h`` (i32 lanes), exactly:
    subnormals as ``m * 2**-24`` in float32 (exact), infinities and NaN with
    their payload, as NumPy widens."""
    c = lambda v: _const(h.type, v)  # noqa: E731
    sign = b.shl(b.and_(h, c(0x8000)), c(16))
    em = b.and_(h, c(0x7FFF))
    normal = b.add(b.shl(em, c(13)), c(0x38000000))
    special = b.or_(b.shl(b.and_(h, c(0x3FF)), c(13)), c(0x7F800000))
    ft = _lanes(_F32, h.type)
    sub = b.bitcast(b.fmul(b.uitofp(em, ft), _const(ft, 2.0 ** -24)), h.type)
    out = b.select(b.icmp_unsigned("<", em, c(0x400)), sub, normal)
    out = b.select(b.icmp_unsigned(">=", em, c(0x7C00)), special, out)
    return b.or_(out, sign)


def _f16_bits(b, x):
    """float16 bits (i16 lanes) of float32 bits ``x`` (i32 lanes), rounded to
    nearest, ties to even, as NumPy's ``astype(np.float16)``."""
    c = lambda v: _const(x.type, v)  # noqa: E731
    sign = b.and_(b.lshr(x, c(16)), c(0x8000))
    a = b.and_(x, c(0x7FFFFFFF))
    # a normal float16: rebias the exponent, round on bit 13
    odd = b.and_(b.lshr(a, c(13)), c(1))
    normal = b.lshr(b.add(b.add(a, c(0xFFF - 0x38000000 + (1 << 32))), odd), c(13))
    # below 2**-14, a subnormal float16 or zero: adding 0.5 leaves |x| * 2**24
    # rounded to an integer, half to even, in the low bits (one exact float
    # addition; float32 subnormals give 0, as NumPy does)
    ft = _lanes(_F32, x.type)
    sub = b.sub(b.bitcast(b.fadd(b.bitcast(a, ft), _const(ft, 0.5)), x.type), c(0x3F000000))
    # NaN: the payload's top 10 bits, kept a NaN (not an infinity) if all zero
    payload = b.and_(b.lshr(a, c(13)), c(0x3FF))
    nan = b.or_(b.or_(payload, b.zext(b.icmp_unsigned("==", payload, c(0)), x.type)),
                c(0x7C00))
    out = b.select(b.icmp_unsigned("<", a, c(0x38800000)), sub, normal)
    out = b.select(b.icmp_unsigned(">=", a, c(0x477FF000)), c(0x7C00), out)  # 65520 up: inf
    out = b.select(b.icmp_unsigned(">", a, c(0x7F800000)), nan, out)
    return b.trunc(b.or_(out, sign), _lanes(_I16, x.type))


def _bf16_bits(b, x, nan=True):
    """bfloat16 bits (i16 lanes) of float32 bits ``x`` (i32 lanes), rounded
    to nearest, ties to even; every NaN becomes ``0x7FC0`` with its sign, as
    ml_dtypes makes it (``nan=False``: ``x`` is never NaN)."""
    c = lambda v: _const(x.type, v)  # noqa: E731
    high = b.lshr(x, c(16))
    rounded = b.lshr(b.add(b.add(x, c(0x7FFF)), b.and_(high, c(1))), c(16))
    if not nan:
        return b.trunc(rounded, _lanes(_I16, x.type))
    nan = b.or_(b.and_(high, c(0x8000)), c(0x7FC0))
    out = b.select(b.icmp_unsigned(">", b.and_(x, c(0x7FFFFFFF)), c(0x7F800000)), nan, rounded)
    return b.trunc(out, _lanes(_I16, x.type))


def _load(b, ptr, ty):
    return b.load(b.bitcast(ptr, ty.as_pointer()), align=1)


def _read_bits(b, ptr, kind, n, f16c=False):
    """float32 bits (i32 lanes) of ``n`` values of ``kind`` at ``ptr``;
    ``f16c``: float16 widened by the CPU's instruction (exact, but NaNs come
    out quiet)."""
    i32 = ir.VectorType(_I32, n) if n > 1 else _I32
    if kind == KIND_F32:
        return _load(b, ptr, i32)
    if kind == KIND_F16 and f16c:
        wide = b.fpext(_load(b, ptr, _lanes(ir.HalfType(), i32)), _lanes(_F32, i32))
        return b.bitcast(wide, i32)
    h = b.zext(_load(b, ptr, _lanes(_I16, i32)), i32)
    return b.shl(h, _const(i32, 16)) if kind == KIND_BF16 else _widen_f16_bits(b, h)


def _write_value(b, ptr, value, stream):
    """Store ``value`` at ``ptr``; with ``stream`` (``ptr`` 16-byte aligned) in
    non-temporal 16-byte pieces, which x86 CPUs store without reading the
    destination line first."""
    if not stream:
        b.store(value, b.bitcast(ptr, value.type.as_pointer()), align=1)
        return
    elem = value.type.element
    per = _STORE_BYTES * 8 // (32 if isinstance(elem, ir.FloatType) else elem.width)
    piece_ty = ir.VectorType(value.type.element, per)
    base = b.bitcast(ptr, piece_ty.as_pointer())
    nontemporal = b.module.add_metadata([ir.Constant(_I32, 1)])
    for i in range(value.type.count // per):
        mask = ir.Constant(ir.VectorType(_I32, per), list(range(i * per, (i + 1) * per)))
        piece = b.shuffle_vector(value, value, mask)
        store = b.store(piece, b.gep(base, [ir.Constant(_I32, i)]), align=_STORE_BYTES)
        store.set_metadata("nontemporal", nontemporal)


class _BFloat(ir.Type):
    """LLVM's bfloat, which llvmlite does not name."""

    def _to_string(self):
        return "bfloat"


def _narrow(b, value, kind, finite=False, f16c=False, bf16=False):
    """``value`` (float32 lanes) as ``kind`` lanes: itself or 16-bit bits.
    ``finite``: ``value`` is never NaN nor subnormal; then ``f16c`` and
    ``bf16`` let the CPU's conversion instructions round (as NumPy and
    ml_dtypes do on such values; not on NaN, nor bfloat16 on subnormals)."""
    if kind == KIND_F32:
        return value
    hw = (ir.HalfType() if kind == KIND_F16 and f16c else
          _BFloat() if kind == KIND_BF16 and bf16 else None)
    if finite and hw is not None:
        return b.bitcast(b.fptrunc(value, _lanes(hw, value.type)), _lanes(_I16, value.type))
    bits = b.bitcast(value, _lanes(_I32, value.type))
    return _f16_bits(b, bits) if kind == KIND_F16 else _bf16_bits(b, bits, not finite)


def _aligned(b, ptr, intp):
    low = b.and_(b.ptrtoint(ptr, intp), ir.Constant(intp, _STORE_BYTES - 1))
    return b.icmp_unsigned("==", low, ir.Constant(intp, 0))


def _by_kind(b, kind, build):
    """``build(kind)`` in a branch of its own for each of the three kinds,
    chosen by the runtime value ``kind``."""
    fn = b.function
    done = fn.append_basic_block("kind_done")
    switch = b.switch(kind, done)
    for k in (KIND_F32, KIND_F16, KIND_BF16):
        block = fn.append_basic_block(f"kind_{k}")
        switch.add_case(ir.Constant(kind.type, k), block)
        b.position_at_end(block)
        build(k)
        b.branch(done)
    b.position_at_end(done)


def _if_else(b, cond, then, other):
    with b.if_else(cond) as (yes, no):
        with yes:
            then()
        with no:
            other()


# ----------------------------------------------------------- dequantizing
def _build_dequantize(b, dst0, dst_step, codes0, codes_step, scales0, scales_step, runs,
                      num_groups, group, kind, stream, hw=()):
    """``dst`` (kind) = float32(codes) * scale, group by group (products
    of a code and a finite scale: never NaN), for ``runs`` runs of
    ``num_groups`` groups, each run the given byte steps after the one
    before (which keep 16-byte alignment: rows of 32 values do)."""
    intp = num_groups.type
    f32 = ir.PointerType(_F32)

    def each_run(body):
        with cgutils.for_range(b, runs) as run:
            r = run.index
            body(b.gep(dst0, [b.mul(r, dst_step)]), b.gep(codes0, [b.mul(r, codes_step)]),
                 b.gep(scales0, [b.mul(r, scales_step)]))

    def vector_loop(k, nt):
        width = _ITEMSIZE[k] * _LANES

        def body(dst, codes, scales):
            with cgutils.for_range(b, num_groups) as loop:
                g = loop.index
                scale = b.load(b.gep(b.bitcast(scales, f32), [g]))
                c = _load(b, b.gep(codes, [b.mul(g, ir.Constant(intp, _LANES))]),
                          ir.VectorType(_I8, _LANES))
                value = b.fmul(b.sitofp(c, ir.VectorType(_F32, _LANES)),
                               _splat(b, scale, _LANES))
                _write_value(b, b.gep(dst, [b.mul(g, ir.Constant(intp, width))]),
                             _narrow(b, value, k, True, *hw), nt)

        each_run(body)

    def scalar_loop(k):
        def body(dst, codes, scales):
            with cgutils.for_range(b, num_groups) as outer:
                scale = b.load(b.gep(b.bitcast(scales, f32), [outer.index]))
                with cgutils.for_range(b, group) as inner:
                    at = b.add(b.mul(outer.index, group), inner.index)
                    value = b.fmul(b.sitofp(b.load(b.gep(codes, [at])), _F32), scale)
                    out = b.gep(dst, [b.mul(at, ir.Constant(intp, _ITEMSIZE[k]))])
                    _write_value(b, out, _narrow(b, value, k, True, *hw), False)

        each_run(body)

    step_aligned = b.icmp_signed("==", b.and_(dst_step, ir.Constant(intp, _STORE_BYTES - 1)),
                                 ir.Constant(intp, 0))
    aligned = b.and_(stream, b.and_(_aligned(b, dst0, intp), step_aligned))

    def per_kind(k):
        _if_else(b, b.icmp_signed("==", group, ir.Constant(intp, _LANES)),
                 lambda: _if_else(b, aligned,
                                  lambda: vector_loop(k, True), lambda: vector_loop(k, False)),
                 lambda: scalar_loop(k))

    _by_kind(b, kind, per_kind)


# ------------------------------------------------------------- quantizing
def _group_max(b, m):
    """The largest lane of ``m`` (float32, no NaN), halving the vector."""
    n = m.type.count
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(m, m, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = b.shuffle_vector(m, m, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        m = b.select(b.fcmp_ordered(">", lo, hi), lo, hi)
    return b.extract_element(m, ir.Constant(_I32, 0))


def _magnitude(b, bits):
    """(|x| as float32 lanes, |x| >= SCALE_MIN, |x| counts for the scale).

    Subnormals count for the scale here, which the reference leaves out:
    when one is a group's largest, its scale (below 2**-126 / 127) is
    stored as 0 either way, and otherwise it is not the largest. That
    saves a comparison per vector."""
    ft = _lanes(_F32, bits.type)
    mag = b.bitcast(b.and_(bits, _const(bits.type, 0x7FFFFFFF)), ft)
    normal = b.fcmp_ordered(">=", mag, _const(ft, float(SCALE_MIN)))  # NaN: false
    return mag, normal, b.fcmp_ordered("<=", mag, _const(ft, float(F32_MAX)))


def _scale_of(b, amax):
    """(scale, scale > 0, divisor) of a group whose largest usable |x| is ``amax``."""
    zero = ir.Constant(_F32, 0.0)
    scale = b.fdiv(amax, ir.Constant(_F32, float(QMAX)))
    top = ir.Constant(_F32, float(SCALE_MAX))
    scale = b.select(b.fcmp_ordered(">", scale, top), top, scale)
    scale = b.select(b.fcmp_ordered("<", scale, ir.Constant(_F32, float(SCALE_MIN))), zero,
                     scale)
    nonzero = b.fcmp_ordered(">", scale, zero)
    return scale, nonzero, b.select(nonzero, scale, ir.Constant(_F32, 1.0))


def _codes_of(b, bits, normal, divisor, nonzero):
    """int8 lanes: rint(x / divisor) clipped to +-127, x = 0 where not
    ``normal`` (NaN, subnormal), all 0 unless ``nonzero``."""
    ft = _lanes(_F32, bits.type)
    x = b.select(normal, b.bitcast(bits, ft), _const(ft, 0.0))
    # Clipping before rounding equals clipping after (the bounds are
    # integers), and lets one conversion round (an infinity clips to 127).
    q = b.fdiv(x, divisor)
    q = b.select(b.fcmp_ordered("<", q, _const(ft, 127.0)), q, _const(ft, 127.0))
    q = b.select(b.fcmp_ordered(">", q, _const(ft, -127.0)), q, _const(ft, -127.0))
    codes = b.trunc(_rint_i32(b, q), _lanes(_I8, bits.type))
    return b.select(nonzero, codes, _const(codes.type, 0))


def _build_quantize(b, codes, scales, src, num_groups, group, stride, kind, stream, f16c=False):
    """Codes and scales of ``num_groups`` groups of ``group`` values of
    ``kind``, ``stride`` bytes apart from ``src`` (``f16c``: see
    :func:`_read_bits`; a NaN's bits do not matter here, it counts as 0)."""
    intp = num_groups.type
    f32 = ir.PointerType(_F32)

    def vector_loop(k, nt):
        with cgutils.for_range(b, num_groups) as loop:
            g = loop.index
            bits = _read_bits(b, b.gep(src, [b.mul(g, ir.Constant(intp, _ITEMSIZE[k] * _LANES))]),
                              k, _LANES, f16c)
            mag, normal, usable = _magnitude(b, bits)
            amax = _group_max(b, b.select(usable, mag, _const(mag.type, 0.0)))
            scale, nonzero, divisor = _scale_of(b, amax)
            q = _codes_of(b, bits, normal, _splat(b, divisor, _LANES), nonzero)
            _write_value(b, b.gep(codes, [b.mul(g, ir.Constant(intp, _LANES))]), q, nt)
            b.store(scale, b.gep(b.bitcast(scales, f32), [g]))

    def scalar_loop(k):
        amax_at = cgutils.alloca_once(b, _F32)
        with cgutils.for_range(b, num_groups) as outer:
            first = b.mul(outer.index, group)

            def element(inner):
                return _read_bits(b, b.gep(src, [b.mul(b.add(first, inner), stride)]), k, 1,
                                  f16c)

            b.store(ir.Constant(_F32, 0.0), amax_at)
            with cgutils.for_range(b, group) as inner:
                mag, _, usable = _magnitude(b, element(inner.index))
                amax = b.load(amax_at)
                bigger = b.and_(usable, b.fcmp_ordered(">", mag, amax))
                b.store(b.select(bigger, mag, amax), amax_at)
            scale, nonzero, divisor = _scale_of(b, b.load(amax_at))
            with cgutils.for_range(b, group) as inner:
                bits = element(inner.index)
                _, normal, _ = _magnitude(b, bits)
                b.store(_codes_of(b, bits, normal, divisor, nonzero),
                        b.gep(codes, [b.add(first, inner.index)]))
            b.store(scale, b.gep(b.bitcast(scales, f32), [outer.index]))

    def per_kind(k):
        fast = b.and_(b.icmp_signed("==", group, ir.Constant(intp, _LANES)),
                      b.icmp_signed("==", stride, ir.Constant(intp, _ITEMSIZE[k])))
        _if_else(b, fast,
                 lambda: _if_else(b, b.and_(stream, _aligned(b, codes, intp)),
                                  lambda: vector_loop(k, True), lambda: vector_loop(k, False)),
                 lambda: scalar_loop(k))

    _by_kind(b, kind, per_kind)


def _build_zero(b, dst, nbytes, stream):
    """Zero ``nbytes`` at ``dst``; streaming, the aligned middle part."""
    intp = nbytes.type

    def streamed():
        head = b.and_(b.neg(b.ptrtoint(dst, intp)), ir.Constant(intp, _STORE_BYTES - 1))
        head = b.select(b.icmp_signed("<", head, nbytes), head, nbytes)
        cgutils.memset(b, dst, head, 0)
        count = b.lshr(b.sub(nbytes, head), ir.Constant(intp, 4))
        body = b.gep(dst, [head])
        zero = ir.Constant(ir.VectorType(_I8, _STORE_BYTES), None)
        with cgutils.for_range(b, count) as loop:
            _write_value(b, b.gep(body, [b.mul(loop.index, ir.Constant(intp, 16))]), zero, True)
        done = b.add(head, b.shl(count, ir.Constant(intp, 4)))
        cgutils.memset(b, b.gep(dst, [done]), b.sub(nbytes, done), 0)

    _if_else(b, stream, streamed, lambda: cgutils.memset(b, dst, nbytes, 0))


def _build_convert(b, dst, src, n, kind):
    """``n`` float32 bits at ``src`` as ``kind`` bits at ``dst`` (16-bit
    kinds), or ``n`` ``kind`` bits widened to float32 bits (``kind`` + 2)."""
    intp = n.type
    full = b.udiv(n, ir.Constant(intp, _LANES))

    def run(k, widen):
        def step(at, lanes):
            if widen:
                value = _read_bits(b, b.gep(src, [b.mul(at, ir.Constant(intp, 2))]), k, lanes)
                out = b.gep(dst, [b.mul(at, ir.Constant(intp, 4))])
            else:
                value = _read_bits(b, b.gep(src, [b.mul(at, ir.Constant(intp, 4))]), KIND_F32,
                                   lanes)
                value = _narrow(b, b.bitcast(value, _lanes(_F32, value.type)), k)
                out = b.gep(dst, [b.mul(at, ir.Constant(intp, 2))])
            _write_value(b, out, value, False)

        with cgutils.for_range(b, full) as loop:
            step(b.mul(loop.index, ir.Constant(intp, _LANES)), _LANES)
        tail = b.mul(full, ir.Constant(intp, _LANES))
        with cgutils.for_range(b, b.sub(n, tail)) as loop:
            step(b.add(tail, loop.index), 1)

    fn = b.function
    done = fn.append_basic_block("convert_done")
    switch = b.switch(kind, done)
    for k, widen in ((KIND_F16, False), (KIND_BF16, False), (KIND_F16, True), (KIND_BF16, True)):
        block = fn.append_basic_block(f"convert_{k}_{widen}")
        switch.add_case(ir.Constant(kind.type, k + 2 * widen), block)
        b.position_at_end(block)
        run(k, widen)
        b.branch(done)
    b.position_at_end(done)


# ------------------------------------------------------------- intrinsics
def _out_of_line(module, name, argtys, build):
    """An internal, never inlined function of ``module``, built once per
    module: its loops then stand once in the code however many places call
    it, and LLVM does not unswitch the kernels' loops around each copy
    (which multiplies compile times)."""
    try:
        return module.get_global(name)
    except KeyError:
        pass
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), argtys), name=name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    build(b, *fn.args)
    b.ret_void()
    return fn


def _at(context, b, arrty, arr, index):
    """(``&arr.flat[index]`` as i8*, the array's struct); ``arr`` is contiguous."""
    ary = context.make_array(arrty)(context, b, arr)
    return b.bitcast(b.gep(ary.data, [index]), _I8P), ary


def _inside(context, b, arrty, ary, offset, nbytes):
    """An i1: bytes ``[offset, offset + nbytes)`` from the array's first
    element lie within it (any strides; always true without bounds checking,
    and for ``nbytes <= 0``)."""
    if not context.enable_boundscheck:
        return cgutils.true_bit
    intp = context.get_value_type(types.intp)
    zero, one = ir.Constant(intp, 0), ir.Constant(intp, 1)
    lo, hi = zero, ir.Constant(intp, context.get_abi_sizeof(context.get_data_type(arrty.dtype)))
    empty = cgutils.false_bit
    for size, stride in zip(cgutils.unpack_tuple(b, ary.shape, arrty.ndim),
                            cgutils.unpack_tuple(b, ary.strides, arrty.ndim)):
        reach = b.mul(b.sub(size, one), stride)
        below = b.icmp_signed("<", reach, zero)
        lo = b.add(lo, b.select(below, reach, zero))
        hi = b.add(hi, b.select(below, zero, reach))
        empty = b.or_(empty, b.icmp_signed("==", size, zero))
    outside = b.or_(empty, b.or_(b.icmp_signed("<", offset, lo),
                                 b.icmp_signed(">", b.add(offset, nbytes), hi)))
    return b.or_(b.icmp_signed("<=", nbytes, zero), b.not_(outside))


def _itemsize(context, arrty):
    return context.get_abi_sizeof(context.get_data_type(arrty.dtype))


@intrinsic
def _dequantize_runs(typingctx, out, out_at, out_step, codes, codes_at, codes_step, scales,
                     scales_at, scales_step, runs, num_groups, group, kind, stream):
    """Dequantize ``runs`` runs of ``num_groups`` groups of ``group`` codes
    from element ``codes_at`` of ``codes`` (scales from element
    ``scales_at``) into ``out`` (float32 or the bits of ``kind``) from
    element ``out_at``, each run ``*_step`` elements (>= 0) after the one
    before; all three arrays contiguous. Returns False, having written
    nothing, when a run falls outside an array (checked only with bounds
    checking on)."""
    sig = types.boolean(out, types.intp, types.intp, codes, types.intp, types.intp, scales,
                        types.intp, types.intp, types.intp, types.intp, types.intp, types.intp,
                        types.boolean)

    def codegen(context, b, sig, args):
        intp = context.get_value_type(types.intp)
        (out_v, out_i, out_s, codes_v, codes_i, codes_s, scales_v, scales_i, scales_s, nruns,
         ngroups, grp, knd, strm) = args
        dst, out_a = _at(context, b, sig.args[0], out_v, out_i)
        src, codes_a = _at(context, b, sig.args[3], codes_v, codes_i)
        sc, scales_a = _at(context, b, sig.args[6], scales_v, scales_i)
        zero, four = ir.Constant(intp, 0), ir.Constant(intp, 4)
        last = b.sub(nruns, ir.Constant(intp, 1))
        some = b.icmp_signed(">", nruns, zero)

        def span(step, length):  # elements from the first run's start to the last's end
            return b.select(some, b.add(b.mul(last, step), length), zero)

        size = b.mul(ngroups, grp)
        isz = ir.Constant(intp, _itemsize(context, sig.args[0]))
        ok = b.and_(_inside(context, b, sig.args[0], out_a, b.mul(out_i, isz),
                            b.mul(span(out_s, size), isz)),
                    b.and_(_inside(context, b, sig.args[3], codes_a, codes_i,
                                   span(codes_s, size)),
                           _inside(context, b, sig.args[6], scales_a, b.mul(scales_i, four),
                                   b.mul(span(scales_s, ngroups), four))))
        # F16C (vcvtps2ph) where the target has it: LLVM's half type would
        # otherwise call a runtime function
        features = context.codegen().magic_tuple()[2].split(",")
        hw = ("+f16c" in features, "+avx512bf16" in features)
        fn = _out_of_line(b.module, f"pagedkv_dequantize_{hw[0]:d}{hw[1]:d}",
                          [_I8P, intp, _I8P, intp, _I8P, intp, intp, intp, intp, intp, _I1],
                          lambda *a: _build_dequantize(*a, hw=hw))
        with b.if_then(ok, likely=True):
            b.call(fn, [dst, b.mul(out_s, isz), src, codes_s, sc, b.mul(scales_s, four), nruns,
                        ngroups, grp, knd, strm])
        return ok

    return sig, codegen


@intrinsic
def _quantize_run(typingctx, codes, codes_at, scales, scales_at, x, x_offset, num_groups,
                  group, stride, kind, stream):
    """Quantize ``num_groups`` groups of ``group`` values of ``x`` (of
    ``kind``), ``stride`` bytes apart from byte ``x_offset``, into ``codes``
    from element ``codes_at`` and ``scales`` from element ``scales_at``
    (both contiguous). Returns False as :func:`_dequantize_run` does."""
    sig = types.boolean(codes, types.intp, scales, types.intp, x, types.intp, types.intp,
                        types.intp, types.intp, types.intp, types.boolean)

    def codegen(context, b, sig, args):
        intp = context.get_value_type(types.intp)
        codes_v, codes_i, scales_v, scales_i, x_v, x_off, ngroups, grp, strd, knd, strm = args
        dst, codes_a = _at(context, b, sig.args[0], codes_v, codes_i)
        sc, scales_a = _at(context, b, sig.args[2], scales_v, scales_i)
        x_a = context.make_array(sig.args[4])(context, b, x_v)
        src = b.gep(b.bitcast(x_a.data, _I8P), [x_off])
        size = b.mul(ngroups, grp)
        # the values' span: from the lower end of a negative stride's run
        reach = b.mul(b.sub(size, ir.Constant(intp, 1)), strd)
        below = b.icmp_signed("<", reach, ir.Constant(intp, 0))
        first = b.add(x_off, b.select(below, reach, ir.Constant(intp, 0)))
        span = b.add(b.select(below, b.neg(reach), reach),
                     ir.Constant(intp, _itemsize(context, sig.args[4])))
        ok = b.and_(_inside(context, b, sig.args[0], codes_a, codes_i, size),
                    b.and_(_inside(context, b, sig.args[2], scales_a,
                                   b.mul(scales_i, ir.Constant(intp, 4)),
                                   b.mul(ngroups, ir.Constant(intp, 4))),
                           b.or_(b.icmp_signed("<=", size, ir.Constant(intp, 0)),
                                 _inside(context, b, sig.args[4], x_a, first, span))))
        f16c = "+f16c" in context.codegen().magic_tuple()[2].split(",")
        fn = _out_of_line(b.module, f"pagedkv_quantize_{f16c:d}",
                          [_I8P, _I8P, _I8P, intp, intp, intp, intp, _I1],
                          lambda *a: _build_quantize(*a, f16c=f16c))
        with b.if_then(ok, likely=True):
            b.call(fn, [dst, sc, src, ngroups, grp, strd, knd, strm])
        return ok

    return sig, codegen


@intrinsic
def _zero_run(typingctx, out, out_at, count, stream):
    """Zero ``count`` elements of the contiguous ``out`` from element
    ``out_at``. Returns False as :func:`_dequantize_run` does."""
    sig = types.boolean(out, types.intp, types.intp, types.boolean)

    def codegen(context, b, sig, args):
        intp = context.get_value_type(types.intp)
        dst, out_a = _at(context, b, sig.args[0], args[0], args[1])
        isz = ir.Constant(intp, _itemsize(context, sig.args[0]))
        nbytes = b.mul(args[2], isz)
        ok = _inside(context, b, sig.args[0], out_a, b.mul(args[1], isz), nbytes)
        fn = _out_of_line(b.module, "pagedkv_zero_run", [_I8P, intp, _I1], _build_zero)
        with b.if_then(ok, likely=True):
            b.call(fn, [dst, nbytes, args[3]])
        return ok

    return sig, codegen


@intrinsic
def _convert_run(typingctx, dst, src, how):
    """All of ``src`` into ``dst`` (contiguous, as many elements): float32
    bits to the bits of kind ``how``, or those widened (``how`` = kind + 2)."""
    sig = types.void(dst, src, types.intp)

    def codegen(context, b, sig, args):
        intp = context.get_value_type(types.intp)
        zero = ir.Constant(intp, 0)
        out, _ = _at(context, b, sig.args[0], args[0], zero)
        inp, src_a = _at(context, b, sig.args[1], args[1], zero)
        fn = _out_of_line(b.module, "pagedkv_convert", [_I8P, _I8P, intp, intp], _build_convert)
        b.call(fn, [out, inp, src_a.nitems, args[2]])
        return context.get_dummy_value()

    return sig, codegen


def _build_prefetch(b, src, nbytes):
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [_I8P, i32, i32, i32])
    fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.prefetch.p0i8")
    line = ir.Constant(nbytes.type, 64)
    count = b.udiv(b.add(nbytes, ir.Constant(nbytes.type, 63)), line)
    with cgutils.for_range(b, count) as loop:
        # read, keep in every cache level, data
        b.call(fn, [b.gep(src, [b.mul(loop.index, line)]), ir.Constant(i32, 0),
                    ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def _prefetch(typingctx, arr, at, count):
    """Ask the CPU for ``count`` elements of the contiguous ``arr`` from
    element ``at`` (a hint: no bounds to check)."""
    sig = types.void(arr, types.intp, types.intp)

    def codegen(context, b, sig, args):
        intp = context.get_value_type(types.intp)
        ptr, _ = _at(context, b, sig.args[0], args[0], args[1])
        fn = _out_of_line(b.module, "pagedkv_q_prefetch", [_I8P, intp], _build_prefetch)
        b.call(fn, [ptr, b.mul(args[2], ir.Constant(intp, _itemsize(context, sig.args[0])))])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _take(typingctx, counter):
    """Add 1 to ``counter[0]`` (int64) atomically; returns the value before."""
    sig = types.int64(counter)

    def codegen(context, b, sig, args):
        ary = context.make_array(sig.args[0])(context, b, args[0])
        return b.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """Order this thread's streaming stores before anything that follows."""
    sig = types.void()

    def codegen(context, b, sig, args):
        b.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@jit_kernel
def convert_bits(dst, src, how):
    """``dst`` [n] = ``src`` [n] converted: float32 bits (uint32) to float16
    (``how`` = KIND_F16) or bfloat16 (KIND_BF16) bits (uint16), or 16-bit
    bits widened to float32 bits (``how`` = kind + 2). The kernels' own
    conversions, exposed for testing them on every bit pattern."""
    if dst.shape[0] != src.shape[0]:
        raise ValueError("dst and src differ in length")
    _convert_run(dst, src, how)


# -------------------------------------------------------------------- write
@jit_kernel(error_model="numpy")
def _write_q_tokens(codes, scales, x, kind, layer, slot_mapping, hnd, group, stream, lo, hi):
    """Quantize tokens ``lo..hi-1`` of ``x`` [N, H, D] (bits, any strides)
    into their slots of ``codes``/``scales``. Returns the number of runs
    found out of bounds."""
    _, num_pages, a, b, head_dim = codes.shape
    page_size, num_heads = (b, a) if hnd else (a, b)
    num_groups = scales.shape[4]
    s_tok, s_head, s_elem = x.strides
    # a token's heads in one run where they follow each other on both sides
    joined = not hnd and s_head == head_dim * s_elem
    runs, groups = (1, num_heads * num_groups) if joined else (num_heads, num_groups)
    layer_page0 = layer * num_pages
    num_bad = 0
    for i in range(lo, hi):
        slot = slot_mapping[i]
        if slot < 0:
            continue
        page_id = slot // page_size
        offset = slot - page_id * page_size
        page_row = (layer_page0 + page_id) * page_size * num_heads
        for h in range(runs):
            row = page_row + (h * page_size + offset if hnd else offset * num_heads + h)
            if not _quantize_run(codes, row * head_dim, scales, row * num_groups, x,
                                 i * s_tok + h * s_head, groups, group, s_elem, kind, stream):
                num_bad += 1
    return num_bad


@jit_kernel(error_model="numpy")
def write_q_serial(k_codes, v_codes, k_scales, v_scales, layer, slot_mapping, k, v, kind,
                   hnd, group, stream):
    """Quantize ``k``/``v`` [N, H, D] into the slots of ``slot_mapping`` [N] (-1 skips)."""
    n = slot_mapping.shape[0]
    num_bad = _write_q_tokens(k_codes, k_scales, k, kind, layer, slot_mapping, hnd, group,
                              stream, 0, n)
    num_bad += _write_q_tokens(v_codes, v_scales, v, kind, layer, slot_mapping, hnd, group,
                               stream, 0, n)
    if stream:
        _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


@jit_kernel(parallel=True, error_model="numpy")
def write_q_parallel(k_codes, v_codes, k_scales, v_scales, layer, slot_mapping, k, v, kind,
                     hnd, group, stream):
    """:func:`write_q_serial` split into token chunks, taken by threads in turn."""
    n = slot_mapping.shape[0]
    nbytes = 2 * n * k.shape[1] * k.shape[2] * k.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    num_bad = 0
    taken = np.zeros(1, np.int64)
    for _ in prange(_TURNS):
        bad = 0
        c = _take(taken)
        while c < num_chunks:
            lo, hi = c * n // num_chunks, (c + 1) * n // num_chunks
            bad += _write_q_tokens(k_codes, k_scales, k, kind, layer, slot_mapping, hnd, group,
                                   stream, lo, hi)
            bad += _write_q_tokens(v_codes, v_scales, v, kind, layer, slot_mapping, hnd, group,
                                   stream, lo, hi)
            c = _take(taken)
        if stream:
            _store_fence()
        num_bad += bad  # one update of the reduction per turn, as prange requires
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


# ------------------------------------------------------------------- gather
@jit_kernel(error_model="numpy")
def _gather_q_blocks(codes, scales, out, kind, layer, page_table, seq_lens, hnd, bhtd, group,
                     stream, lo, hi):
    """Fill blocks ``lo..hi-1`` of ``out`` (C-contiguous); block
    ``b * num_blocks + j`` is positions ``[j * page_size, (j + 1) * page_size)``
    of sequence ``b``, dequantized from page ``page_table[b, j]`` below
    ``seq_lens[b]`` and zero from there. Returns the number of runs found
    out of bounds."""
    _, num_pages, a, b_, head_dim = codes.shape
    page_size, num_heads = (b_, a) if hnd else (a, b_)
    num_groups = scales.shape[4]
    num_positions = out.shape[2] if bhtd else out.shape[1]
    num_blocks = (num_positions + page_size - 1) // page_size
    layer_page0 = layer * num_pages
    # Rows of head_dim apart: a position's and a head's in a page of the
    # store, and in a sequence of the output.
    src_t, src_h = (1, page_size) if hnd else (num_heads, 1)
    dst_t, dst_h = (1, num_positions) if bhtd else (num_heads, 1)
    num_bad = 0
    page_rows = page_size * num_heads
    for item in range(lo, hi):
        seq = item // num_blocks
        j = item - seq * num_blocks
        t0 = j * page_size
        t1 = min(t0 + page_size, num_positions)
        n = seq_lens[seq]
        count = min(t1, n) - t0  # positions that come from the page
        # the next block's page, read while this one is written
        ahead = item + 1
        if ahead < hi:
            seq_a = ahead // num_blocks
            j_a = ahead - seq_a * num_blocks
            if j_a * page_size < seq_lens[seq_a]:
                row_a = (layer_page0 + page_table[seq_a, j_a]) * page_rows
                _prefetch(codes, row_a * head_dim, page_rows * head_dim)
                _prefetch(scales, row_a * num_groups, page_rows * num_groups)
        out_row0 = seq * num_positions * num_heads + t0 * dst_t
        if count > 0:
            page_row = (layer_page0 + page_table[seq, j]) * page_size * num_heads
            # Runs of rows contiguous on both sides: a page's tokens (NHD to
            # BTHD), a head's positions (HND to BHTD), else single rows in the
            # output's order, so that writes go forward.
            if not hnd and not bhtd:
                num_outer, s_o, d_o, num_inner, s_i, d_i, rows = 1, 0, 0, 1, 0, 0, count * num_heads
            elif hnd and bhtd:
                num_outer, s_o, d_o, num_inner, s_i, d_i, rows = (
                    num_heads, src_h, dst_h, 1, 0, 0, count)
            elif bhtd:
                num_outer, s_o, d_o, num_inner, s_i, d_i, rows = (
                    num_heads, src_h, dst_h, count, src_t, dst_t, 1)
            else:
                num_outer, s_o, d_o, num_inner, s_i, d_i, rows = (
                    count, src_t, dst_t, num_heads, src_h, dst_h, 1)
            for o in range(num_outer):
                src = page_row + o * s_o
                dst = out_row0 + o * d_o
                if not _dequantize_runs(out, dst * head_dim, d_i * head_dim, codes,
                                        src * head_dim, s_i * head_dim, scales,
                                        src * num_groups, s_i * num_groups, num_inner,
                                        rows * num_groups, group, kind, stream):
                    num_bad += 1
        z0 = max(t0, n)
        if z0 < t1:
            zero_row0 = seq * num_positions * num_heads + z0 * dst_t
            num_zero, zero_rows = (num_heads, t1 - z0) if bhtd else (1, (t1 - z0) * num_heads)
            for h in range(num_zero):
                if not _zero_run(out, (zero_row0 + h * dst_h) * head_dim, zero_rows * head_dim,
                                 stream):
                    num_bad += 1
    return num_bad


@jit_kernel
def _num_blocks(codes, out, hnd, bhtd):
    page_size = codes.shape[3] if hnd else codes.shape[2]
    num_positions = out.shape[2] if bhtd else out.shape[1]
    return out.shape[0] * ((num_positions + page_size - 1) // page_size)


@jit_kernel(error_model="numpy")
def gather_q_serial(k_codes, v_codes, k_scales, v_scales, layer, page_table, seq_lens, k_out,
                    v_out, kind, hnd, bhtd, group, stream):
    """Dequantize sequences [B] of ``page_table`` [B, max_pages] into ``k_out``/``v_out``."""
    n = _num_blocks(k_codes, k_out, hnd, bhtd)
    num_bad = _gather_q_blocks(k_codes, k_scales, k_out, kind, layer, page_table, seq_lens, hnd,
                               bhtd, group, stream, 0, n)
    num_bad += _gather_q_blocks(v_codes, v_scales, v_out, kind, layer, page_table, seq_lens,
                                hnd, bhtd, group, stream, 0, n)
    if stream:
        _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


@jit_kernel(parallel=True, error_model="numpy")
def gather_q_parallel(k_codes, v_codes, k_scales, v_scales, layer, page_table, seq_lens,
                      k_out, v_out, kind, hnd, bhtd, group, stream):
    """:func:`gather_q_serial` split into chunks of blocks, taken by threads in turn."""
    n = _num_blocks(k_codes, k_out, hnd, bhtd)
    nbytes = 2 * k_out.size * k_out.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    num_bad = 0
    taken = np.zeros(1, np.int64)
    for _ in prange(_TURNS):
        bad = 0
        c = _take(taken)
        while c < num_chunks:
            lo, hi = c * n // num_chunks, (c + 1) * n // num_chunks
            bad += _gather_q_blocks(k_codes, k_scales, k_out, kind, layer, page_table, seq_lens,
                                    hnd, bhtd, group, stream, lo, hi)
            bad += _gather_q_blocks(v_codes, v_scales, v_out, kind, layer, page_table,
                                    seq_lens, hnd, bhtd, group, stream, lo, hi)
            c = _take(taken)
        if stream:
            _store_fence()
        num_bad += bad
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)
