"""The inner loop of :mod:`pagedkv_np.backends.block_q8_tiles`, written in LLVM IR.

:func:`q8_tile_intrinsic` returns a Numba ``@intrinsic`` that computes the 16
outputs of one tile of a weight packed by
:func:`~pagedkv_np.backends.block_q8_tiles.q8_tiles`, for 1, 2 or 4
consecutive quantized rows, in the order that module documents. The 16
outputs are the 16 lanes of one vector, so no output needs a horizontal sum:
per block of 32 inputs,

* the integer part: 64-byte groups of codes, 4 bytes per output, each
  multiplied by the row's 4 matching int8 values (one 32-bit word broadcast
  to every lane) and summed into the output's i32 lane, exactly: ``vpdpbusd``
  on 512 bits where the CPU Numba compiles for has AVX-512 VNNI, on two
  halves of 256 bits with AVX-VNNI, else ``maddubs`` then ``pmaddwd`` with
  ones (4- and 5-bit codes; 8-bit codes go as their two nibbles, the high
  one's sum shifted by 4, so that no i16 sum saturates); a 5-bit code is its
  nibble with 16 added where its byte's bit in a 64-bit mask is set (a masked
  byte select on AVX-512);
* the float part, a separate multiply and add per operation: ``acc + ((scale
  * d) * float(P) + c * dq)`` (without block terms ``acc + (scale * d) *
  float(P)``).

Scales and block terms are float32 or float16 bit patterns (widened exactly).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .block_q8_ir import (HAS_VNNI, RowPointers, call_intrinsic, counted_loop, load_vector,
                          splat, target_features)

__all__ = ["q8_tile_intrinsic", "TILE", "HAS_VNNI_512"]

#: outputs per tile: the lanes of one 512-bit vector of float32
TILE = 16

#: whether the byte dots run on 512-bit ``vpdpbusd``
HAS_VNNI_512 = {"avx512vnni", "avx512bw", "avx512f"} <= target_features()

_F32 = ir.FloatType()
_F16 = ir.HalfType()
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, TILE)
_V16I = ir.VectorType(_I32, TILE)
_V64B = ir.VectorType(_I8, 64)
_V8I = ir.VectorType(_I32, 8)
_V32B = ir.VectorType(_I8, 32)
_V16W = ir.VectorType(_I16, 16)
_ZERO_F = ir.Constant(_V16F, [0.0] * TILE)
_ZERO_I = ir.Constant(_V16I, [0] * TILE)


def _halves(builder, vec, half_ty):
    """The low and high halves of a vector."""
    n = half_ty.count
    undef = ir.Constant(vec.type, ir.Undefined)
    return [builder.shuffle_vector(vec, undef, ir.Constant(ir.VectorType(_I32, n),
                                                           list(range(h * n, h * n + n))))
            for h in (0, 1)]


def _join(builder, lo, hi):
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n),
                                                      list(range(2 * n))))


def _dot4(builder, acc, u, s, small):
    """``acc`` plus, per i32 lane ``l``, the exact sum over bytes ``4l .. 4l +
    3`` of ``u * s`` (``u`` unsigned, ``s`` signed, 64 bytes each; ``small``:
    every ``u`` at most 15)."""
    if HAS_VNNI_512:
        return call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I,
                              [acc, builder.bitcast(u, _V16I), builder.bitcast(s, _V16I)])
    accs = _halves(builder, acc, _V8I)
    us, ss = _halves(builder, u, _V32B), _halves(builder, s, _V32B)
    out = []
    for a, uh, sh in zip(accs, us, ss):
        if HAS_VNNI:
            out.append(call_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I,
                                      [a, builder.bitcast(uh, _V8I), builder.bitcast(sh, _V8I)]))
            continue
        ones = ir.Constant(_V16W, [1] * 16)

        def words(v):
            return call_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [
                call_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16W, [v, sh]), ones])

        if small:                       # pairs at most 2 * 15 * 128: no saturation
            out.append(builder.add(a, words(uh)))
            continue
        low = builder.and_(uh, ir.Constant(_V32B, [15] * 32))
        high = builder.lshr(uh, ir.Constant(_V32B, [4] * 32))
        shifted = builder.shl(words(high), ir.Constant(_V8I, [4] * 8))
        out.append(builder.add(a, builder.add(words(low), shifted)))
    return _join(builder, *out)


def _lanes(builder, base, at):
    """16 float32 values at ``base[at]`` (``base`` a ``float *``, or an ``i16 *``
    of float16 bit patterns, widened exactly)."""
    if base.type.pointee == _I16:
        bits = load_vector(builder, base, at, ir.VectorType(_I16, TILE))
        return builder.fpext(builder.bitcast(bits, ir.VectorType(_F16, TILE)), _V16F)
    return load_vector(builder, base, at, _V16F)


def _word(builder, q, at):
    """The 4 int8 values at ``q[at]`` as one 32-bit word in every lane, as bytes."""
    ptr = builder.bitcast(builder.gep(q, [at]), _I32.as_pointer())
    return builder.bitcast(splat(builder, builder.load(ptr, align=1), _V16I), _V64B)


def _fifth_bit(builder, codes, at):
    """16 in each of 64 bytes whose bit is set in the 64-bit mask at
    ``codes[at]`` (bit ``n`` for byte ``n``), else 0."""
    ptr = builder.bitcast(builder.gep(codes, [at]), ir.IntType(64).as_pointer())
    mask = builder.bitcast(builder.load(ptr, align=1), ir.VectorType(ir.IntType(1), 64))
    return builder.select(mask, ir.Constant(_V64B, [16] * 64), ir.Constant(_V64B, [0] * 64))


def _element(arrty):
    return _I16 if arrty.dtype == types.uint16 else _F32


def q8_tile_intrinsic(bits, num_rows, terms_on, halves=False):
    """``q8_tile(codes, scales, terms, q, d, dq, t, m, out)``: writes ``out[r,
    :16]``, the outputs of tile ``t`` for the quantized row ``m + r``, ``r <
    num_rows``; ``codes``, ``scales`` and ``terms`` as
    :func:`~pagedkv_np.backends.block_q8_tiles.q8_tiles` makes them (``terms``
    read only when ``terms_on``); ``q`` int8 ``[M, K]`` in input order, ``d``
    and ``dq`` float32 ``[M, K // 32]``, or with ``halves`` (8 bits in blocks
    of 16: each 32 inputs' codes as one block of 8-bit codes, a sum per half,
    each half then a block of its own) ``[M, K // 16]``."""
    if bits not in (4, 5, 8) or (halves and bits != 8):
        raise ValueError(f"Invalid tile: needs 4, 5 or 8 bits (8 in halves), got {bits}")
    group_bytes = 64
    groups = 8 if bits == 8 else 4
    block_bytes = 64 * bits             # 5 bits: 4 groups of nibbles, then 8 masks

    def typer(typingctx, codes, scales, terms, q, d, dq, t, m, out):
        sig = types.intp(codes, scales, terms, q, d, dq, types.intp, types.intp, out)

        def codegen(context, builder, sig, args):
            arrays = [RowPointers(context, builder, ty, v)
                      for ty, v in zip(sig.args, args) if isinstance(ty, types.Array)]
            a_codes, a_scales, a_terms, a_q, a_d, a_dq, a_out = arrays
            t_v, m_v = args[6:8]
            intp = t_v.type
            codes = a_codes.row(builder, t_v, _I8)
            scales = a_scales.row(builder, t_v, _element(sig.args[1]))
            terms = a_terms.row(builder, t_v, _element(sig.args[2])) if terms_on else None
            num_blocks = builder.extract_value(a_d.shape, 1)
            if halves:
                num_blocks = builder.ashr(num_blocks, ir.Constant(num_blocks.type, 1))
            rows = []
            for r in range(num_rows):
                row = builder.add(m_v, ir.Constant(intp, r))
                rows.append((a_q.row(builder, row, _I8), a_d.row(builder, row, _F32),
                             a_dq.row(builder, row, _F32)))
            carried = [_ZERO_F] * num_rows
            b, phis, finish = counted_loop(builder, "q8_tile", ir.Constant(intp, 0),
                                           num_blocks, carried)
            at_codes = builder.mul(b, ir.Constant(intp, block_bytes))
            at_q = builder.mul(b, ir.Constant(intp, 32))
            # two partial sums per row: two independent chains of vpdpbusd
            sums = [[_ZERO_I, _ZERO_I] for _ in rows]
            for g in range(groups):
                c = load_vector(builder, codes, builder.add(
                    at_codes, ir.Constant(intp, g * group_bytes)), _V64B)
                if bits == 8:
                    parts = [(c, 4 * g)]
                else:
                    parts = [(builder.and_(c, ir.Constant(_V64B, [15] * 64)), 8 * g),
                             (builder.lshr(c, ir.Constant(_V64B, [4] * 64)), 8 * g + 4)]
                if bits == 5:                    # each byte's fifth bit from its mask
                    parts = [(builder.or_(u, _fifth_bit(builder, codes, builder.add(
                        at_codes, ir.Constant(intp, 4 * group_bytes + 8 * (2 * g + k))))),
                        offset) for k, (u, offset) in enumerate(parts)]
                for k, (u, offset) in enumerate(parts):
                    for r, (q, _, _) in enumerate(rows):
                        s = _word(builder, q, builder.add(at_q, ir.Constant(intp, offset)))
                        chain = g // 4 if halves else (g * len(parts) + k) % 2
                        sums[r][chain] = _dot4(builder, sums[r][chain], u, s, bits != 8)
            if halves:                       # block 2b, then 2b + 1, each its own half
                units = [(builder.add(builder.add(b, b), ir.Constant(intp, h)), [h])
                         for h in (0, 1)]
            else:
                units = [(b, [0, 1])]
            accs = list(phis)
            for at, chains in units:
                at_lanes = builder.mul(at, ir.Constant(intp, TILE))
                scale = _lanes(builder, scales, at_lanes)
                term = _lanes(builder, terms, at_lanes) if terms_on else None
                for r, (_, d, dq) in enumerate(rows):
                    total = sums[r][chains[0]]
                    for chain in chains[1:]:
                        total = builder.add(total, sums[r][chain])
                    p = builder.sitofp(total, _V16F)
                    sd = builder.fmul(scale, splat(builder, builder.load(builder.gep(d, [at])),
                                                   _V16F))
                    block = builder.fmul(sd, p)
                    if terms_on:             # the block's value before it is added
                        dqv = splat(builder, builder.load(builder.gep(dq, [at])), _V16F)
                        block = builder.fadd(block, builder.fmul(term, dqv))
                    accs[r] = builder.fadd(accs[r], block)
            done = finish(accs)
            for r in range(num_rows):
                out = a_out.row(builder, ir.Constant(intp, r), _F32)
                builder.store(done[r], builder.bitcast(out, _V16F.as_pointer()), align=4)
            return ir.Constant(ir.IntType(64), 0)

        return sig, codegen

    typer.__name__ = (f"q8_tile{bits}_{num_rows}{'_terms' if terms_on else ''}"
                      f"{'_halves' if halves else ''}")
    return intrinsic(typer)
