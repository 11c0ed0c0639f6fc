"""The AVX2 inner loops of :mod:`pagedkv_np.backends.block_q8`, written in LLVM IR.

:func:`q8_span_intrinsic` returns a Numba ``@intrinsic`` that computes a span
of outputs ``n`` for 1, 2 or 4 consecutive quantized rows, in the order that
:mod:`pagedkv_np.backends.block_q8` documents. For each output:

* the block-term loop, 8 blocks at a time as 8 float lanes (then the last
  ``blocks % 8`` one by one): ``offset * s - (scale * zero) * dq``;
* the block loop (4 bits, block 32: blocks in pairs, then a last one): the
  exact integer lane sums ``P[l]`` of ``code * q``, then ``acc[l] + (scale *
  d) * float(P[l])``, a separate multiply and add;
* the lanes of both summed as a fixed tree.

The integer part, per block of a weight row (its codes read once for every
row of the tile), codes unsigned as stored (the zero point is in the block
term) but for signed 8-bit codes:

* 4 bits, block 32, blocks in pairs: the pair's 32 code bytes split into low
  and high nibbles (32 bytes each); per row ``maddubs(low, evens) +
  maddubs(high, odds)`` (u8 x s8 pairs to i16: at most 4 * 15 * 127, no
  saturation) then ``pmaddwd`` with ones: lanes 0-3 hold the first block,
  4-7 the second, 8 consecutive inputs a lane; ``scale * d`` of both blocks
  in one 2-lane product spread to 4 + 4 lanes.
* 4 bits, a last block 32 alone: its 16 code bytes become 32 (low nibbles,
  then high), ``maddubs`` and ``pmaddwd`` with ones: lane ``l`` holds
  positions ``4l .. 4l + 3``.
* 8 bits, block 32, signed (the zero point folded in, which the caller has
  checked fits): ``w = code - zero`` by one byte subtraction per block,
  ``|w|`` by ``psign(w, w)`` (-128 gives 0x80, read as 128 by ``maddubs``);
  per row ``maddubs(|w|, psign(q, w))`` (pairs at most 2 * 128 * 127) then
  ``pmaddwd`` with ones: lane ``l`` holds positions ``4l .. 4l + 3``; no
  zero-point block term.
* block 16 (4 or 8 bits) and 8 bits, block 32 otherwise: the codes widened to int16
  (0..255), the row's int8 values widened to int16, ``pmaddwd`` (pairs to
  i32: at most 2 * 255 * 127): lane ``l`` holds positions ``2l, 2l + 1``
  (and, for 32 inputs, ``16 + 2l, 17 + 2l``).

Where the CPU Numba compiles for has the VNNI byte dot (:data:`HAS_VNNI`:
AVX-VNNI, or AVX-512 VNNI with 256-bit vectors), ``vpdpbusd`` adds the
products of 4 unsigned-by-signed bytes into each i32 lane at once, replacing
each ``maddubs``, the ``i16`` addition of a pair's two and ``pmaddwd`` with
ones: the same exact lane sums, since none of those saturates.

Scales and offsets are float32 or float16 bit patterns (``i16`` loads
bitcast to ``half`` and widened by ``fpext``: exact, so the same float32
values). Positions are those of the block's inputs in the quantized row (4 bits: even
inputs, then odd; 8 bits: as they come).
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["q8_span_intrinsic", "target_features", "HAS_VNNI"]


def target_features() -> frozenset[str]:
    """The CPU features Numba compiles for: those ``$NUMBA_CPU_FEATURES``
    enables when it is set, else the host's."""
    from numba.core import config

    wanted = config.CPU_FEATURES  # type: ignore[attr-defined]  # set at run time
    if wanted is not None:
        return frozenset(f[1:] for f in wanted.split(",") if f.startswith("+"))
    return frozenset(k for k, on in llvm_binding.get_host_cpu_features().items() if on)


#: whether the kernels use ``vpdpbusd`` (see the module docstring)
HAS_VNNI = "avxvnni" in target_features() or {"avx512vnni", "avx512vl"} <= target_features()

_F32 = ir.FloatType()
_F16 = ir.HalfType()
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_LANES = 8
_V8F = ir.VectorType(_F32, _LANES)
_V8I = ir.VectorType(_I32, _LANES)
_V8B = ir.VectorType(_I8, _LANES)
_V16W = ir.VectorType(_I16, 16)
_V16B = ir.VectorType(_I8, 16)
_V32B = ir.VectorType(_I8, 32)
_ZERO8 = ir.Constant(_V8F, [0.0] * _LANES)


def splat(builder, value, vty):
    """``value`` in every lane of ``vty``."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vty.count),
                                                          [0] * vty.count))


def call_intrinsic(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def load_vector(builder, base, at, vty):
    ptr = builder.bitcast(builder.gep(base, [at]), vty.as_pointer())
    return builder.load(ptr, align=1)


def _floats(builder, base, at, count=None):
    """float32 values at ``base[at]``: one (``count`` None) or a vector of
    ``count``; ``base`` a ``float *`` or an ``i16 *`` of float16 bit patterns,
    widened exactly (``fpext``: ``vcvtph2ps`` with F16C)."""
    half = base.type.pointee == _I16
    if count is None:
        value = builder.load(builder.gep(base, [at]))
        return builder.fpext(builder.bitcast(value, _F16), _F32) if half else value
    vty = ir.VectorType(_I16 if half else _F32, count)
    value = builder.load(builder.bitcast(builder.gep(base, [at]), vty.as_pointer()),
                         align=2 if half else 4)
    if not half:
        return value
    if count == _LANES:
        return builder.fpext(builder.bitcast(value, ir.VectorType(_F16, count)), _V8F)
    # fewer than 8 widened as 8 lanes, then the first ones taken
    undef = ir.Constant(vty, ir.Undefined)
    wide = builder.shuffle_vector(value, undef, ir.Constant(
        _V8I, [i if i < count else count for i in range(_LANES)]))
    wide = builder.fpext(builder.bitcast(wide, ir.VectorType(_F16, _LANES)), _V8F)
    return builder.shuffle_vector(wide, ir.Constant(_V8F, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, count), list(range(count))))


def _tree(builder, vec):
    """The 8 lanes of ``vec`` summed: ``lane[i] += lane[i + width]``, width 4, 2, 1."""
    undef = ir.Constant(_V8F, ir.Undefined)
    width = _LANES // 2
    while width:
        mask = [(i + width) % _LANES for i in range(_LANES)]
        vec = builder.fadd(vec, builder.shuffle_vector(vec, undef, ir.Constant(_V8I, mask)))
        width //= 2
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def counted_loop(builder, name, start, stop, carried):
    """Open a counted loop ``start <= i < stop`` (possibly empty): returns
    ``(i, phis, finish)``; ``finish(new_values)`` closes the body and returns
    the carried values after the loop (``carried``: their initial values)."""
    entry = builder.block
    body = builder.append_basic_block(f"{name}.body")
    after = builder.append_basic_block(f"{name}.after")
    builder.cbranch(builder.icmp_signed("<", start, stop), body, after)
    builder.position_at_end(body)
    i = builder.phi(start.type)
    i.add_incoming(start, entry)
    phis = []
    for value in carried:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        phis.append(phi)

    def finish(new_values):
        nxt = builder.add(i, ir.Constant(i.type, 1))
        last = builder.block
        i.add_incoming(nxt, last)
        for phi, value in zip(phis, new_values):
            phi.add_incoming(value, last)
        builder.cbranch(builder.icmp_signed("<", nxt, stop), body, after)
        builder.position_at_end(after)
        out = []
        for value, new in zip(carried, new_values):
            phi = builder.phi(value.type)
            phi.add_incoming(value, entry)
            phi.add_incoming(new, last)
            out.append(phi)
        return out

    return i, phis, finish


def _byte_dots(builder, pairs):
    """Per i32 lane ``l``, the exact sum over bytes ``4l .. 4l + 3`` of ``u *
    s`` for every ``(u, s)`` of ``pairs`` (32 unsigned and 32 signed bytes
    each; the caller guarantees that no i16 sum of ``maddubs`` saturates)."""
    if HAS_VNNI:
        total = ir.Constant(_V8I, [0] * _LANES)
        for u, s in pairs:
            total = call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I,
                          [total, builder.bitcast(u, _V8I), builder.bitcast(s, _V8I)])
        return total
    words = None
    for u, s in pairs:
        w = call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16W, [u, s])
        words = w if words is None else builder.add(words, w)
    return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", _V8I,
                          [words, ir.Constant(_V16W, [1] * 16)])


def _codes(builder, bits, block_size, codes, at_code):
    """The block's codes in position order: ``("u8", v32)`` for 4 bits, block
    32; otherwise ``("i16", [v16, ...])``, 16 positions each."""
    if bits == 4:
        half = block_size // 2
        vty = ir.VectorType(_I8, half)
        c = load_vector(builder, codes, at_code, vty)
        mask = ir.Constant(vty, [15] * half)
        lo = builder.and_(c, mask)
        hi = builder.and_(builder.lshr(c, ir.Constant(vty, [4] * half)), mask)
        both = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, block_size),
                                                          list(range(block_size))))
        if block_size == 32:
            return "u8", both
        parts = [both]
    else:
        parts = [load_vector(builder, codes,
                             builder.add(at_code, ir.Constant(at_code.type, 16 * h)),
                       _V16B) for h in range(block_size // 16)]
    return "i16", [builder.zext(p, _V16W) for p in parts]


def _signed_codes(builder, codes, at_code, zero):
    """8 bits, block 32, zero point folded: ``("s8", w, |w|)``, ``w = code -
    zero`` as int8 (exact: the caller checked that it fits), ``|w|`` read as
    unsigned (128 for -128)."""
    w = builder.sub(load_vector(builder, codes, at_code, _V32B), splat(builder, zero, _V32B))
    return "s8", w, call_intrinsic(builder, "llvm.x86.avx2.psign.b", _V32B, [w, w])


def _lane_sums(builder, codes, q, at_q):
    """``P``: the block's exact integer lane sums of ``code * q`` (``("s8", ..)``:
    of ``(code - zero) * q``) for one row."""
    if codes[0] == "s8":              # sign(q, w) * |w| = q * w
        _, w, magnitude = codes
        signed_q = call_intrinsic(builder, "llvm.x86.avx2.psign.b", _V32B,
                         [load_vector(builder, q, at_q, _V32B), w])
        # |w| <= 128, |q| <= 127: a pair at most 2 * 128 * 127 = 32512, no saturation
        return _byte_dots(builder, [(magnitude, signed_q)])
    if codes[0] == "u8":
        return _byte_dots(builder, [(codes[1], load_vector(builder, q, at_q, _V32B))])
    total = None
    for h, c16 in enumerate(codes[1]):
        qv = load_vector(builder, q, builder.add(at_q, ir.Constant(at_q.type, 16 * h)), _V16B)
        p = call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [c16, builder.sext(qv, _V16W)])
        total = p if total is None else builder.add(total, p)
    return total


def _block_term(builder, offsets_on, zeros, scales, offsets, rows, at, vty, signed=False):
    """``offset * s - (scale * zero) * dq`` of the blocks at ``at`` for each row
    (``signed``: ``offset * s``): 8 blocks as lanes (``vty`` a vector) or one
    (``vty`` float)."""
    count = vty.count if isinstance(vty, ir.VectorType) else None

    def load(base):
        return _floats(builder, base, at, count)

    if signed:
        offset = load(offsets)
        return [builder.fmul(offset, load(sums)) for _, _, _, sums in rows]
    if count is not None:
        zero = builder.uitofp(builder.zext(load_vector(builder, zeros, at, _V8B), _V8I), vty)
    else:
        zero = builder.uitofp(builder.load(builder.gep(zeros, [at])), vty)
    zs = builder.fmul(load(scales), zero)
    offset = load(offsets) if offsets_on else None
    terms = []
    for _, _, dq, sums in rows:
        minus = builder.fmul(zs, load(dq))
        terms.append(builder.fsub(builder.fmul(offset, load(sums)), minus) if offsets_on
                     else builder.fneg(minus))
    return terms


def _paired_dots(builder, codes, scales, rows, num_pairs):
    """4 bits, block 32: the block dots of blocks ``2p, 2p + 1`` for ``p <
    num_pairs``, one 32-byte load of codes per pair: lanes 0-3 hold block
    ``2p``, lanes 4-7 block ``2p + 1``, each lane 8 consecutive inputs (the
    quantized row holds a pair as its evens, then its odds); the rows' 8-lane
    accumulators after the pairs."""
    intp = num_pairs.type
    p, accs, finish = counted_loop(builder, "q8_pairs", ir.Constant(intp, 0), num_pairs,
                            [_ZERO8 for _ in rows])
    c = load_vector(builder, codes, builder.mul(p, ir.Constant(intp, 32)), _V32B)
    mask = ir.Constant(_V32B, [15] * 32)
    lo = builder.and_(c, mask)
    hi = builder.and_(builder.lshr(c, ir.Constant(_V32B, [4] * 32)), mask)
    v2f = ir.VectorType(_F32, 2)
    at_scale = builder.mul(p, ir.Constant(intp, 2))
    scale = _floats(builder, scales, at_scale, 2)
    at_q = builder.mul(p, ir.Constant(intp, 64))
    spread = ir.Constant(_V8I, [0, 0, 0, 0, 1, 1, 1, 1])
    new = []
    for acc, (q, d, _, _) in zip(accs, rows):
        evens = load_vector(builder, q, at_q, _V32B)
        odds = load_vector(builder, q, builder.add(at_q, ir.Constant(intp, 32)), _V32B)
        # i16 sums of the two: at most 4 * 15 * 127
        lanes = _byte_dots(builder, [(lo, evens), (hi, odds)])
        d2 = builder.load(builder.bitcast(builder.gep(d, [at_scale]), v2f.as_pointer()),
                          align=4)
        sd = builder.shuffle_vector(builder.fmul(scale, d2), ir.Constant(v2f, ir.Undefined),
                                    spread)
        new.append(builder.fadd(acc, builder.fmul(sd, builder.sitofp(lanes, _V8F))))
    return finish(new)


def _output(builder, bits, block_size, offsets_on, codes, zeros, scales, offsets, rows,
            num_blocks, signed=False):
    """IR of one output for each of ``rows`` (``(q, d, dq, sums)`` pointers);
    ``signed``: 8 bits with the zero point folded into the codes."""
    intp = num_blocks.type
    eight = ir.Constant(intp, _LANES)
    lanes = tails = None
    if offsets_on or not signed:         # signed without offsets: no block terms
        groups = builder.sdiv(num_blocks, eight)
        g, phis, finish = counted_loop(builder, "q8_terms", ir.Constant(intp, 0), groups,
                                [_ZERO8 for _ in rows])
        terms = _block_term(builder, offsets_on, zeros, scales, offsets, rows,
                            builder.mul(g, eight), _V8F, signed)
        lanes = finish([builder.fadd(acc, t) for acc, t in zip(phis, terms)])
        b, phis, finish = counted_loop(builder, "q8_tail", builder.mul(groups, eight), num_blocks,
                                [ir.Constant(_F32, 0.0) for _ in rows])
        terms = _block_term(builder, offsets_on, zeros, scales, offsets, rows, b, _F32, signed)
        tails = finish([builder.fadd(acc, t) for acc, t in zip(phis, terms)])

    accs = [_ZERO8 for _ in rows]
    single_from = ir.Constant(intp, 0)
    if bits == 4 and block_size == 32:
        accs = _paired_dots(builder, codes, scales, rows, builder.sdiv(num_blocks,
                                                                       ir.Constant(intp, 2)))
        single_from = builder.mul(builder.sdiv(num_blocks, ir.Constant(intp, 2)),
                                  ir.Constant(intp, 2))
    b, phis, finish = counted_loop(builder, "q8_dot", single_from, num_blocks, accs)
    scale = _floats(builder, scales, b)
    at_code = builder.mul(b, ir.Constant(intp, block_size * bits // 8))
    if signed:
        c = _signed_codes(builder, codes, at_code, builder.load(builder.gep(zeros, [b])))
    else:
        c = _codes(builder, bits, block_size, codes, at_code)
    at_q = builder.mul(b, ir.Constant(intp, block_size))
    new = []
    for acc, (q, d, _, _) in zip(phis, rows):
        p = builder.sitofp(_lane_sums(builder, c, q, at_q), _V8F)
        sd = builder.fmul(scale, builder.load(builder.gep(d, [b])))
        new.append(builder.fadd(acc, builder.fmul(splat(builder, sd, _V8F), p)))
    accs = finish(new)
    if lanes is None:
        return [_tree(builder, acc) for acc in accs]
    return [builder.fadd(builder.fadd(_tree(builder, acc), _tree(builder, lane)), tail)
            for acc, lane, tail in zip(accs, lanes, tails)]


def _element(arrty):
    """The IR element type of a float32 array, or of a uint16 one (float16 bits)."""
    return _I16 if arrty.dtype == types.uint16 else _F32


class RowPointers:
    """A 2-D array's data pointer and row stride (bytes); each row contiguous
    (the row stride may be 0: every row the same)."""

    def __init__(self, context, builder, arrty, arr):
        ary = context.make_array(arrty)(context, builder, arr)
        self.base = builder.bitcast(ary.data, _I8.as_pointer())
        self.stride = builder.extract_value(ary.strides, 0)
        self.shape = ary.shape

    def row(self, builder, row, elty):
        """``&arr[row, 0]`` as an ``elty *``."""
        ptr = builder.gep(self.base, [builder.mul(row, self.stride)])
        return builder.bitcast(ptr, elty.as_pointer())


def q8_span_intrinsic(bits, block_size, num_rows, offsets_on, signed=False):
    """``q8_span(codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, m, out)``:
    writes ``out[m + r, n]`` for outputs ``lo <= n < hi`` and the quantized
    rows ``m .. m + num_rows - 1``; the offset term is included when
    ``offsets_on`` (``offsets`` is not read otherwise); ``signed`` (8 bits,
    block 32 only): the zero point folded into the codes, which the caller has
    checked (every ``code - zero`` in -128..127). ``scales`` and ``offsets``
    are float32, or uint16 holding float16 bit patterns (widened exactly);
    ``zeros`` may repeat one row (row stride 0)."""
    if signed and (bits, block_size) != (8, 32):
        raise ValueError(f"Invalid signed span: needs 8 bits, block 32, got {bits} bits, "
                         f"block {block_size}")

    def typer(typingctx, codes, zeros, scales, offsets, q, d, dq, sums, lo, hi, m, out):
        sig = types.intp(codes, zeros, scales, offsets, q, d, dq, sums, types.intp,
                         types.intp, types.intp, out)

        def codegen(context, builder, sig, args):
            arrays = [RowPointers(context, builder, ty, v)
                      for ty, v in zip(sig.args, args) if isinstance(ty, types.Array)]
            a_codes, a_zeros, a_scales, a_offsets, a_q, a_d, a_dq, a_sums, a_out = arrays
            lo_v, hi_v, m_v = args[8:11]
            num_blocks = builder.extract_value(a_scales.shape, 1)
            rows, outs = [], []
            for r in range(num_rows):
                row = builder.add(m_v, ir.Constant(m_v.type, r))
                rows.append((a_q.row(builder, row, _I8), a_d.row(builder, row, _F32),
                             a_dq.row(builder, row, _F32), a_sums.row(builder, row, _F32)))
                outs.append(a_out.row(builder, row, _F32))
            n, _, finish = counted_loop(builder, "q8_span", lo_v, hi_v, [])
            totals = _output(
                builder, bits, block_size, offsets_on, a_codes.row(builder, n, _I8),
                a_zeros.row(builder, n, _I8), a_scales.row(builder, n, _element(sig.args[2])),
                a_offsets.row(builder, n, _element(sig.args[3])) if offsets_on else None, rows,
                num_blocks,
                signed)
            for out_row, total in zip(outs, totals):
                builder.store(total, builder.gep(out_row, [n]))
            finish([])
            return ir.Constant(ir.IntType(64), 0)

        return sig, codegen

    typer.__name__ = (f"q8_span{bits}{'s' if signed else ''}_{block_size}_{num_rows}"
                      f"{'_off' if offsets_on else ''}")
    return intrinsic(typer)
