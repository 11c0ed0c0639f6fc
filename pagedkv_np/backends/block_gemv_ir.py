"""The inner loops of :mod:`pagedkv_np.backends.block_gemv`, written in LLVM IR.

Each function here returns a Numba ``@intrinsic`` that computes one piece of
a block product with its float32 lanes held as AVX2 vector registers: a
weight row's blocks dotted with 1, 2 or 4 activation rows
(:func:`block_dot_intrinsic`), a row's weights converted once into a buffer
(:func:`store_intrinsic`), and such a buffer dotted with activation rows
(:func:`buffer_dot_intrinsic`). The summation order they implement is the
one :mod:`pagedkv_np.backends.block_gemv` documents; they are apart from it
only so that each module stays readable.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["block_dot_intrinsic", "store_intrinsic", "buffer_dot_intrinsic"]


# The block loop is written in LLVM IR with its lanes as vector registers:
# Numba leaves LLVM's SLP vectorizer off, so a loop over a constant 16 or 32
# lanes is unrolled and stays scalar, and a vectorized lane loop of run-time
# length keeps the lanes in memory. Measured on one thread of this loaded
# 2-core machine, Q8 576 x 8192 at M = 1: scalar 1.3-1.6 GMAC/s, lanes in
# memory 2.6-3.7, this loop 5.5-6 (in cache; 576 x 49152 from memory 4.3-6).
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_LANES = 8                               # float32 lanes of one AVX2 register
_V8F = ir.VectorType(_F32, _LANES)
_V8I = ir.VectorType(_I32, _LANES)
_V8B = ir.VectorType(ir.IntType(8), _LANES)


def _splat(builder, value, vty):
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_V8I, [0] * _LANES))


def _row_pointer(context, builder, arrty, arr, row, elty):
    """``&arr[row, 0]`` as an ``elty *`` (a C-contiguous 2-D array)."""
    ary = context.make_array(arrty)(context, builder, arr)
    stride = builder.extract_value(ary.strides, 0)
    base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
    return builder.bitcast(builder.gep(base, [builder.mul(row, stride)]), elty.as_pointer())


def _fma(builder, a, b, c):
    """``a * b + c`` with one rounding (``llvm.fma``: a fused multiply-add on
    AVX2, exact whatever the flags; never contracted from separate operations)."""
    fnty = ir.FunctionType(_V8F, [_V8F, _V8F, _V8F])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v8f32")
    return builder.call(fn, [a, b, c])


def _build_block_dot(builder, bits, block_size, codes, zeros, scales, rows, num_blocks,
                     store=None):
    """IR of one output's two accumulators (see the module docstring), summed as
    a tree, for each of ``rows`` (pairs of even and odd input pointers): each
    group of 8 codes is converted to weights once for all rows, each row's
    arithmetic is its own and the same whatever rows come with it. With
    ``store`` (a float pointer), the weights are also written there, group
    after group (``K`` floats)."""
    intp = num_blocks.type
    block_bytes = block_size * bits // 8
    block_xs = block_size if bits == 8 else block_size // 2
    start = builder.block
    loop = builder.append_basic_block("block_dot.loop")
    done = builder.append_basic_block("block_dot.done")
    builder.branch(loop)
    builder.position_at_end(loop)
    b = builder.phi(intp)
    b.add_incoming(ir.Constant(intp, 0), start)
    accs = []
    for _ in range(2 * len(rows)):
        acc = builder.phi(_V8F)
        acc.add_incoming(ir.Constant(_V8F, [0.0] * _LANES), start)
        accs.append(acc)
    scale = _splat(builder, builder.load(builder.gep(scales, [b])), _V8F)
    zero = _splat(builder, builder.zext(builder.load(builder.gep(zeros, [b])), _I32), _V8I)
    at_code = builder.mul(b, ir.Constant(intp, block_bytes))
    at_x = builder.mul(b, ir.Constant(intp, block_xs))

    def load_x(base, off):
        ptr = builder.bitcast(builder.gep(base, [builder.add(at_x, off)]), _V8F.as_pointer())
        return builder.load(ptr, align=4)

    def weight(q):                       # scale_b * (code - zero), one rounding
        return builder.fmul(scale, builder.sitofp(builder.sub(q, zero), _V8F))

    groups = []                          # (weights, which input array, offset), in order
    for v in range(block_bytes // _LANES):
        off = ir.Constant(intp, v * _LANES)
        ptr = builder.gep(codes, [builder.add(at_code, off)])
        q = builder.zext(builder.load(builder.bitcast(ptr, _V8B.as_pointer()), align=1), _V8I)
        if bits == 8:
            groups.append((weight(q), 0, off))
        else:
            groups.append((weight(builder.and_(q, ir.Constant(_V8I, [15] * _LANES))), 0, off))
            groups.append((weight(builder.lshr(q, ir.Constant(_V8I, [4] * _LANES))), 1, off))
    if store is not None:
        at_w = builder.mul(b, ir.Constant(intp, block_size))
        for g, (w, _, _) in enumerate(groups):
            ptr = builder.gep(store, [builder.add(at_w, ir.Constant(intp, g * _LANES))])
            builder.store(w, builder.bitcast(ptr, _V8F.as_pointer()), align=4)
    new = list(accs)
    for g, (w, odd, off) in enumerate(groups):
        for r, pointers in enumerate(rows):
            i = 2 * r + g % 2
            new[i] = _fma(builder, w, load_x(pointers[odd], off), new[i])
    nxt = builder.add(b, ir.Constant(intp, 1))
    for acc, value in zip(accs, new):
        acc.add_incoming(value, loop)
    b.add_incoming(nxt, loop)
    builder.cbranch(builder.icmp_signed("<", nxt, num_blocks), loop, done)
    builder.position_at_end(done)
    undef = ir.Constant(_V8F, ir.Undefined)
    totals = []
    for r in range(len(rows)):
        vec = builder.fadd(new[2 * r], new[2 * r + 1])
        width = _LANES // 2
        while width:                     # lanes[i] += lanes[i + width], width halving
            mask = [(i + width) % _LANES for i in range(_LANES)]
            vec = builder.fadd(vec, builder.shuffle_vector(vec, undef, ir.Constant(_V8I, mask)))
            width //= 2
        totals.append(builder.extract_element(vec, ir.Constant(_I32, 0)))
    return totals


def block_dot_intrinsic(bits, block_size, num_rows):
    """``block_dot(codes, zeros, scales, even, odd, n, m)``: output ``n`` of rows
    ``m .. m + num_rows - 1`` without the block-sum term, a tuple (``even`` /
    ``odd``: the rows' even and odd inputs for 4 bits, both ``x`` for 8)."""

    def typer(typingctx, codes, zeros, scales, even, odd, n, m):
        sig = types.UniTuple(types.float32, num_rows)(
            codes, zeros, scales, even, odd, types.intp, types.intp)

        def codegen(context, builder, sig, args):
            codes_v, zeros_v, scales_v, even_v, odd_v, n_v, m_v = args
            ty = sig.args
            num_blocks = builder.extract_value(
                context.make_array(ty[2])(context, builder, scales_v).shape, 1)
            rows = []
            for r in range(num_rows):
                row = builder.add(m_v, ir.Constant(m_v.type, r))
                rows.append((_row_pointer(context, builder, ty[3], even_v, row, _F32),
                             _row_pointer(context, builder, ty[4], odd_v, row, _F32)))
            totals = _build_block_dot(
                builder, bits, block_size,
                _row_pointer(context, builder, ty[0], codes_v, n_v, ir.IntType(8)),
                _row_pointer(context, builder, ty[1], zeros_v, n_v, ir.IntType(8)),
                _row_pointer(context, builder, ty[2], scales_v, n_v, _F32), rows, num_blocks)
            return context.make_tuple(builder, sig.return_type, totals)

        return sig, codegen

    typer.__name__ = f"block_dot{bits}_{block_size}_{num_rows}"
    return intrinsic(typer)


def _build_buffer_dot(builder, bits, weights, rows, num_pairs):
    """As :func:`_build_block_dot`, the weights read from ``weights`` (as it
    stores them): the same operations on the same values, so the same bits."""
    intp = num_pairs.type
    start = builder.block
    loop = builder.append_basic_block("buffer_dot.loop")
    done = builder.append_basic_block("buffer_dot.done")
    builder.branch(loop)
    builder.position_at_end(loop)
    p = builder.phi(intp)
    p.add_incoming(ir.Constant(intp, 0), start)
    accs = []
    for _ in range(2 * len(rows)):
        acc = builder.phi(_V8F)
        acc.add_incoming(ir.Constant(_V8F, [0.0] * _LANES), start)
        accs.append(acc)
    at_w = builder.mul(p, ir.Constant(intp, 2 * _LANES))
    new = list(accs)
    for g in range(2):
        ptr = builder.gep(weights, [builder.add(at_w, ir.Constant(intp, g * _LANES))])
        w = builder.load(builder.bitcast(ptr, _V8F.as_pointer()), align=4)
        for r, (even, odd) in enumerate(rows):
            if bits == 8:
                base, at = even, builder.add(at_w, ir.Constant(intp, g * _LANES))
            else:
                base, at = (odd if g else even), builder.mul(p, ir.Constant(intp, _LANES))
            x = builder.load(builder.bitcast(builder.gep(base, [at]), _V8F.as_pointer()),
                             align=4)
            new[2 * r + g] = _fma(builder, w, x, new[2 * r + g])
    nxt = builder.add(p, ir.Constant(intp, 1))
    for acc, value in zip(accs, new):
        acc.add_incoming(value, loop)
    p.add_incoming(nxt, loop)
    builder.cbranch(builder.icmp_signed("<", nxt, num_pairs), loop, done)
    builder.position_at_end(done)
    undef = ir.Constant(_V8F, ir.Undefined)
    totals = []
    for r in range(len(rows)):
        vec = builder.fadd(new[2 * r], new[2 * r + 1])
        width = _LANES // 2
        while width:
            mask = [(i + width) % _LANES for i in range(_LANES)]
            vec = builder.fadd(vec, builder.shuffle_vector(vec, undef, ir.Constant(_V8I, mask)))
            width //= 2
        totals.append(builder.extract_element(vec, ir.Constant(_I32, 0)))
    return totals


def _array_pointer(context, builder, arrty, arr, elty):
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(ary.data, elty.as_pointer())


def store_intrinsic(bits, block_size):
    """``store_weights(codes, zeros, scales, weights, n)``: output ``n``'s
    weights, group after group, into ``weights`` (float32 ``[K]``)."""

    def typer(typingctx, codes, zeros, scales, weights, n):
        sig = types.intp(codes, zeros, scales, weights, types.intp)

        def codegen(context, builder, sig, args):
            codes_v, zeros_v, scales_v, weights_v, n_v = args
            ty = sig.args
            num_blocks = builder.extract_value(
                context.make_array(ty[2])(context, builder, scales_v).shape, 1)
            _build_block_dot(
                builder, bits, block_size,
                _row_pointer(context, builder, ty[0], codes_v, n_v, ir.IntType(8)),
                _row_pointer(context, builder, ty[1], zeros_v, n_v, ir.IntType(8)),
                _row_pointer(context, builder, ty[2], scales_v, n_v, _F32), [], num_blocks,
                store=_array_pointer(context, builder, ty[3], weights_v, _F32))
            return ir.Constant(ir.IntType(64), 0)

        return sig, codegen

    typer.__name__ = f"store_weights{bits}_{block_size}"
    return intrinsic(typer)


def buffer_dot_intrinsic(bits, num_rows):
    """``buffer_dot(weights, even, odd, m)``: rows ``m .. m + num_rows - 1``
    against weights stored by ``store_weights``, a tuple."""

    def typer(typingctx, weights, even, odd, m):
        sig = types.UniTuple(types.float32, num_rows)(weights, even, odd, types.intp)

        def codegen(context, builder, sig, args):
            weights_v, even_v, odd_v, m_v = args
            ty = sig.args
            num_pairs = builder.sdiv(
                builder.extract_value(context.make_array(ty[0])(context, builder,
                                                                weights_v).shape, 0),
                ir.Constant(m_v.type, 2 * _LANES))
            rows = []
            for r in range(num_rows):
                row = builder.add(m_v, ir.Constant(m_v.type, r))
                rows.append((_row_pointer(context, builder, ty[1], even_v, row, _F32),
                             _row_pointer(context, builder, ty[2], odd_v, row, _F32)))
            totals = _build_buffer_dot(
                builder, bits, _array_pointer(context, builder, ty[0], weights_v, _F32),
                rows, num_pairs)
            return context.make_tuple(builder, sig.return_type, totals)

        return sig, codegen

    typer.__name__ = f"buffer_dot{bits}_{num_rows}"
    return intrinsic(typer)
