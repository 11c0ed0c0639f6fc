"""The AVX2 inner loop of :mod:`pagedkv_np.backends.block_q8`, written in LLVM IR.

:func:`q8_span_intrinsic` returns a Numba ``@intrinsic`` computing a span of
outputs ``n`` of 1, 2 or 4 consecutive quantized rows, in the order that
:mod:`pagedkv_np.backends.block_q8` documents: per block, the exact integer
lane sums ``P[l]`` (AVX2 integer ops), then ``acc[l] += (scale * d) *
float(P[l])`` with a separate multiply and add, the block's offset term on a
scalar chain beside it, and at the end the 8 lanes summed as a fixed tree.

The integer part, per block of a weight row (its codes read once for every
row of the tile):

* 4 bits, block 32: the 16 code bytes become 32 bytes (low nibbles, then high
  nibbles: the even inputs, then the odd ones), minus the zero point, as
  int8 ``w`` in -15..15; per row, ``maddubs(|w|, sign(q, w))`` (u8 x s8 pairs
  to i16: at most 2 * 15 * 127, no saturation) then ``pmaddwd`` with ones,
  so lane ``l`` holds positions ``4l .. 4l + 3`` of the block.
* block 16 (4 or 8 bits) and 8 bits, block 32: the codes widened to int16
  minus the zero point (-255..255), the row's int8 values widened to int16,
  ``pmaddwd`` (pairs to i32: at most 2 * 255 * 127): lane ``l`` holds
  positions ``2l, 2l + 1`` (and, for 32 inputs, ``16 + 2l, 17 + 2l``).

Positions are those of the block's inputs in the quantized row's order (4
bits: even inputs, then odd; 8 bits: as they come).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["q8_span_intrinsic"]

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_LANES = 8
_V8F = ir.VectorType(_F32, _LANES)
_V8I = ir.VectorType(_I32, _LANES)
_V16W = ir.VectorType(_I16, 16)
_V16B = ir.VectorType(_I8, 16)
_V32B = ir.VectorType(_I8, 32)


def _splat(builder, value, vty):
    """``value`` in every lane of ``vty``."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vty.count),
                                                          [0] * vty.count))


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _load(builder, base, at, vty):
    ptr = builder.bitcast(builder.gep(base, [at]), vty.as_pointer())
    return builder.load(ptr, align=1)


def _weights(builder, bits, block_size, codes, at_code, zero):
    """The block's weights ``code - zero`` in position order: ``("s8", w, |w|)``
    for 4 bits, block 32; otherwise ``("s16", [w16, ...])``, 16 positions each."""
    if bits == 4:
        half = block_size // 2
        vty = ir.VectorType(_I8, half)
        c = _load(builder, codes, at_code, vty)
        mask = ir.Constant(vty, [15] * half)
        lo = builder.and_(c, mask)
        hi = builder.and_(builder.lshr(c, ir.Constant(vty, [4] * half)), mask)
        both = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, block_size),
                                                          list(range(block_size))))
        if block_size == 32:
            w = builder.sub(both, _splat(builder, zero, _V32B))
            aw = _call(builder, "llvm.abs.v32i8", _V32B, [w, ir.Constant(ir.IntType(1), 0)])
            return "s8", w, aw
        parts = [both]
    else:
        parts = [_load(builder, codes, builder.add(at_code, ir.Constant(at_code.type, 16 * h)),
                       _V16B) for h in range(block_size // 16)]
    z16 = _splat(builder, builder.zext(zero, _I16), _V16W)
    return "s16", [builder.sub(builder.zext(p, _V16W), z16) for p in parts]


def _lane_sums(builder, weights, q, at_q):
    """``P``: the block's exact integer lane sums for one row (``q`` its int8s)."""
    if weights[0] == "s8":
        _, w, aw = weights
        qv = _load(builder, q, at_q, _V32B)
        sq = _call(builder, "llvm.x86.avx2.psign.b", _V32B, [qv, w])
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16W, [aw, sq])
        ones = ir.Constant(_V16W, [1] * 16)
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [pairs, ones])
    total = None
    for h, w16 in enumerate(weights[1]):
        qv = _load(builder, q, builder.add(at_q, ir.Constant(at_q.type, 16 * h)), _V16B)
        p = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [w16, builder.sext(qv, _V16W)])
        total = p if total is None else builder.add(total, p)
    return total


def _loop(builder, name, start_value, stop, carried):
    """Open a counted loop: returns ``(counter, phis, finish)``; call
    ``finish(new_values)`` at the end of the body to close it (``carried``: the
    initial values of the loop-carried registers)."""
    entry = builder.block
    body = builder.append_basic_block(f"{name}.body")
    after = builder.append_basic_block(f"{name}.after")
    builder.branch(body)
    builder.position_at_end(body)
    i = builder.phi(start_value.type)
    i.add_incoming(start_value, entry)
    phis = []
    for value in carried:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        phis.append(phi)

    def finish(new_values):
        nxt = builder.add(i, ir.Constant(i.type, 1))
        i.add_incoming(nxt, builder.block)
        for phi, value in zip(phis, new_values):
            phi.add_incoming(value, builder.block)
        builder.cbranch(builder.icmp_signed("<", nxt, stop), body, after)
        builder.position_at_end(after)

    return i, phis, finish


def _block_loop(builder, bits, block_size, offsets_on, codes, zeros, scales, offsets, rows,
                num_blocks):
    """IR of one output for each of ``rows`` (``(q, d, sums)`` pointers): the
    block loop, then the lanes' tree and the offset chain; the totals."""
    intp = num_blocks.type
    carried = [ir.Constant(_V8F, [0.0] * _LANES) for _ in rows]
    if offsets_on:
        carried += [ir.Constant(_F32, 0.0) for _ in rows]
    b, phis, finish = _loop(builder, "q8_dot", ir.Constant(intp, 0), num_blocks, carried)
    accs, offs = phis[:len(rows)], phis[len(rows):]
    zero = builder.load(builder.gep(zeros, [b]))
    scale = builder.load(builder.gep(scales, [b]))
    offset = builder.load(builder.gep(offsets, [b])) if offsets_on else None
    at_code = builder.mul(b, ir.Constant(intp, block_size * bits // 8))
    at_q = builder.mul(b, ir.Constant(intp, block_size))
    weights = _weights(builder, bits, block_size, codes, at_code, zero)
    new_accs, new_offs = [], []
    for r, (q, d, sums) in enumerate(rows):
        lanes = builder.sitofp(_lane_sums(builder, weights, q, at_q), _V8F)
        sd = builder.fmul(scale, builder.load(builder.gep(d, [b])))
        new_accs.append(builder.fadd(accs[r], builder.fmul(_splat(builder, sd, _V8F), lanes)))
        if offsets_on:
            term = builder.fmul(offset, builder.load(builder.gep(sums, [b])))
            new_offs.append(builder.fadd(offs[r], term))
    finish(new_accs + new_offs)
    undef = ir.Constant(_V8F, ir.Undefined)
    totals = []
    for r in range(len(rows)):
        vec = new_accs[r]
        width = _LANES // 2
        while width:                     # lanes[i] += lanes[i + width], width 4, 2, 1
            mask = [(i + width) % _LANES for i in range(_LANES)]
            vec = builder.fadd(vec, builder.shuffle_vector(vec, undef, ir.Constant(_V8I, mask)))
            width //= 2
        total = builder.extract_element(vec, ir.Constant(_I32, 0))
        totals.append(builder.fadd(total, new_offs[r]) if offsets_on else total)
    return totals


class _Rows:
    """A 2-D C-contiguous array's data pointer and row stride (bytes)."""

    def __init__(self, context, builder, arrty, arr):
        ary = context.make_array(arrty)(context, builder, arr)
        self.base = builder.bitcast(ary.data, _I8.as_pointer())
        self.stride = builder.extract_value(ary.strides, 0)
        self.shape = ary.shape

    def row(self, builder, row, elty):
        """``&arr[row, 0]`` as an ``elty *``."""
        ptr = builder.gep(self.base, [builder.mul(row, self.stride)])
        return builder.bitcast(ptr, elty.as_pointer())


def q8_span_intrinsic(bits, block_size, num_rows, offsets_on):
    """``q8_span(codes, zeros, scales, offsets, q, d, sums, lo, hi, m, out)``:
    writes ``out[m + r, n]`` for outputs ``lo <= n < hi`` (``lo < hi``) and
    the quantized rows ``m .. m + num_rows - 1``; the offset term is included
    when ``offsets_on`` (``offsets`` is not read otherwise). The weight has
    at least one block."""

    def typer(typingctx, codes, zeros, scales, offsets, q, d, sums, lo, hi, m, out):
        sig = types.intp(codes, zeros, scales, offsets, q, d, sums, types.intp, types.intp,
                         types.intp, out)

        def codegen(context, builder, sig, args):
            arrays = [_Rows(context, builder, ty, v)
                      for ty, v in zip(sig.args, args) if isinstance(ty, types.Array)]
            a_codes, a_zeros, a_scales, a_offsets, a_q, a_d, a_sums, a_out = arrays
            lo_v, hi_v, m_v = args[7:10]
            num_blocks = builder.extract_value(a_scales.shape, 1)
            rows, outs = [], []
            for r in range(num_rows):
                row = builder.add(m_v, ir.Constant(m_v.type, r))
                rows.append((a_q.row(builder, row, _I8), a_d.row(builder, row, _F32),
                             a_sums.row(builder, row, _F32)))
                outs.append(a_out.row(builder, row, _F32))
            n, _, finish = _loop(builder, "q8_span", lo_v, hi_v, [])
            totals = _block_loop(
                builder, bits, block_size, offsets_on, a_codes.row(builder, n, _I8),
                a_zeros.row(builder, n, _I8), a_scales.row(builder, n, _F32),
                a_offsets.row(builder, n, _F32) if offsets_on else None, rows, num_blocks)
            for out_row, total in zip(outs, totals):
                builder.store(total, builder.gep(out_row, [n]))
            finish([])
            return ir.Constant(ir.IntType(64), 0)

        return sig, codegen

    typer.__name__ = f"q8_span{bits}_{block_size}_{num_rows}{'_off' if offsets_on else ''}"
    return intrinsic(typer)
