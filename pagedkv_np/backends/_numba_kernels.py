"""Private Numba kernels of the numba backend: they never validate or allocate.

Every kernel takes the K/V store and the data as float32 arrays or as
``uint16`` views of float16/bfloat16 ones (Numba has neither 16-bit float type
on CPU), never loads an element as a number (it copies bytes, so NaN payloads
survive), assumes that :class:`~pagedkv_np.backends.base.Backend`
has checked every shape, dtype and index, and moves whole contiguous runs of
bytes: a token's ``[num_kv_heads, head_dim]`` row where both sides hold it in
one piece (NHD store to or from BTHD data), a run of ``head_dim`` elements per
head otherwise, and up to a page of tokens at once where a page is contiguous
on both sides (NHD to BTHD, HND to BHTD).

Runs are copied by three small LLVM intrinsics instead of element loops
(an element loop also pays Numba's negative-index wraparound on every
computed index, and compiles slower):

* ``_copy_rows`` copies a set of equally spaced runs (one call per page,
  head or run of consecutive slots, not per row) with ``memcpy`` or, when
  ``stream`` is set, with 16-byte non-temporal stores. A write's destination
  rows are not in the cache, nor is most of a large gather's output by the
  time it is read; ordinary stores first read every such line into the cache
  (3 memory transfers per line instead of 2), which caps a large copy at
  about 2/3 of a plain ``np.copyto`` (whose ``memcpy`` streams large copies
  itself). Streaming stores reach the copy's speed.
* ``_zero_bytes`` does the same for the zero fill past each sequence.
* ``_prefetch`` asks for a page's (or a block of tokens') bytes before a
  transposing copy reads them in strided order.

With ``NUMBA_BOUNDSCHECK=1`` the intrinsics also check each run against its
array's extent; a run outside is skipped and counted, and the kernel raises
IndexError at its end (Numba drops exceptions raised in functions called from
a ``prange`` body, so a count is what crosses it).

The intrinsics live in this file, not in a module of their own, because
Numba's disk cache keys compiled kernels by their own source file's contents:
a change to an intrinsic defined elsewhere would leave stale kernels cached.

Flags are one small int (fewer arguments make a cheaper call): bit 0 the HND
store layout, bit 1 the BHTD output layout, bit 2 streaming stores. Each
operation has a serial kernel and a ``parallel=True`` one that splits the same
work into chunks with ``prange``; the two must stay separate functions because
Numba's disk cache does not key compiled code by the ``parallel`` flag.
"""

from __future__ import annotations

from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import jit_kernel

HND = 1  # store layout [.., num_kv_heads, page_size, head_dim]
BHTD = 2  # output layout [B, num_kv_heads, T, head_dim]
STREAM = 4  # non-temporal stores for destinations that overflow the cache

_VEC_BYTES = 16  # one SSE/NEON register: the widest store every x86-64 CPU has
_CACHE_LINE = 64
_I8P = ir.IntType(8).as_pointer()

# Parallel kernels split their work into chunks of at least _MIN_CHUNK_BYTES
# written and at most _MAX_CHUNKS chunks; prange hands each thread an equal
# share of chunks, and each chunk ends with one store fence (which waits for
# the chunk's streaming stores: too many small chunks would make that cost
# show). Constants, because a kernel that calls numba.get_num_threads()
# cannot be cached on disk.
_MAX_CHUNKS = 256
_MIN_CHUNK_BYTES = 256 << 10

# Tokens per block of an HND write: the block's k/v rows (16 x 4 KiB for 8
# heads of 128 float32) are prefetched and stay in cache while each head's
# rows are written in turn, so that each head's writes form one stream.
_WRITE_BLOCK = 16

_OUT_OF_BOUNDS = "pagedkv_np kernel: a run of bytes falls outside its array"


def _byte_pointer(context, builder, arrty, arr, offset):
    """``(char *)arr.data + offset`` and the array's struct."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.gep(builder.bitcast(ary.data, _I8P), [offset]), ary


def _rows_in_extent(context, builder, arrty, ary, offset, stride, row_bytes, num_rows):
    """An i1 that is true when ``num_rows`` runs of ``row_bytes``, ``stride``
    bytes apart from byte ``offset``, lie in the array (always true unless
    bounds checking is on)."""
    if not context.enable_boundscheck:
        return cgutils.true_bit
    intp = context.get_value_type(types.intp)
    zero, one = ir.Constant(intp, 0), ir.Constant(intp, 1)
    reach = builder.mul(builder.sub(num_rows, one), stride)
    neg = builder.icmp_signed("<", reach, zero)
    first = builder.add(offset, builder.select(neg, reach, zero))
    span = builder.add(builder.select(neg, builder.neg(reach), reach), row_bytes)
    inside = _in_extent(context, builder, arrty, ary, first, span)
    nothing = builder.or_(builder.icmp_signed("<=", num_rows, zero),
                          builder.icmp_signed("<=", row_bytes, zero))
    return builder.or_(nothing, inside)


def _in_extent(context, builder, arrty, ary, offset, nbytes):
    """An i1 that is true when bytes [offset, offset + nbytes) lie in the array
    (always true unless bounds checking is on)."""
    if not context.enable_boundscheck:
        return cgutils.true_bit
    intp = context.get_value_type(types.intp)
    zero = ir.Constant(intp, 0)
    itemsize = context.get_abi_sizeof(context.get_data_type(arrty.dtype))
    lo, hi, empty = zero, ir.Constant(intp, itemsize), cgutils.false_bit
    shapes = cgutils.unpack_tuple(builder, ary.shape, arrty.ndim)
    strides = cgutils.unpack_tuple(builder, ary.strides, arrty.ndim)
    for size, stride in zip(shapes, strides):
        reach = builder.mul(builder.sub(size, ir.Constant(intp, 1)), stride)
        neg = builder.icmp_signed("<", reach, zero)
        lo = builder.add(lo, builder.select(neg, reach, zero))
        hi = builder.add(hi, builder.select(neg, zero, reach))
        empty = builder.or_(empty, builder.icmp_signed("==", size, zero))
    outside = builder.or_(
        empty,
        builder.or_(builder.icmp_signed("<", offset, lo),
                    builder.icmp_signed(">", builder.add(offset, nbytes), hi)))
    return builder.not_(builder.and_(builder.icmp_signed(">", nbytes, zero), outside))


def _stream_loop(builder, dst, src, nbytes, intp):
    """Copy (``src`` given) or zero ``nbytes`` at ``dst``: byte head up to
    16-byte alignment of ``dst``, aligned non-temporal 16-byte stores, byte
    tail. The head makes any destination address safe for the aligned store."""
    vec = ir.VectorType(ir.IntType(8), _VEC_BYTES)
    fifteen = ir.Constant(intp, _VEC_BYTES - 1)
    misalign = builder.and_(builder.neg(builder.ptrtoint(dst, intp)), fifteen)
    head = builder.select(builder.icmp_signed("<", misalign, nbytes), misalign, nbytes)
    rest = builder.sub(nbytes, head)
    num_vec = builder.lshr(rest, ir.Constant(intp, 4))
    tail = builder.and_(rest, fifteen)
    body = builder.gep(dst, [head])
    after = builder.gep(body, [builder.shl(num_vec, ir.Constant(intp, 4))])
    zero = ir.Constant(intp, 0)
    # Rows of head_dim elements usually start aligned: skip the calls then.
    with builder.if_then(builder.icmp_unsigned("!=", head, zero), likely=False):
        if src is not None:
            cgutils.raw_memcpy(builder, dst, src, head, 1)
        else:
            cgutils.memset(builder, dst, head, 0)
    if src is not None:
        src_body = builder.gep(src, [head])
        src_after = builder.gep(src_body, [builder.shl(num_vec, ir.Constant(intp, 4))])
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    dvec = builder.bitcast(body, vec.as_pointer())
    with cgutils.for_range(builder, num_vec) as loop:
        if src is not None:
            svec = builder.bitcast(src_body, vec.as_pointer())
            value = builder.load(builder.gep(svec, [loop.index]), align=1)
        else:
            value = ir.Constant(vec, None)
        store = builder.store(value, builder.gep(dvec, [loop.index]), align=_VEC_BYTES)
        store.set_metadata("nontemporal", nontemporal)
    with builder.if_then(builder.icmp_unsigned("!=", tail, zero), likely=False):
        if src is not None:
            cgutils.raw_memcpy(builder, after, src_after, tail, 1)
        else:
            cgutils.memset(builder, after, tail, 0)


def _out_of_line(module, name, argtys, build):
    """An internal, never inlined function of ``module``, built once per module.

    The copy loops live in such functions rather than at every call site:
    inlined, LLVM unswitches the kernels' loops on each invariant flag and
    analyses every copy, which made one parallel kernel take 20 s to compile.
    A call per run of bytes costs a few nanoseconds.
    """
    try:
        return module.get_global(name)
    except KeyError:
        pass
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), argtys), name=name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    fn.attributes.add("nounwind")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    build(builder, *fn.args)
    builder.ret_void()
    return fn


def _build_copy_rows(builder, dst, dst_stride, src, src_stride, row_bytes, num_rows, stream):
    intp = row_bytes.type
    # Rows that follow each other on both sides are one run.
    joined = builder.and_(builder.icmp_signed("==", dst_stride, row_bytes),
                          builder.icmp_signed("==", src_stride, row_bytes))
    run = builder.select(joined, builder.mul(row_bytes, num_rows), row_bytes)
    count = builder.select(joined, ir.Constant(intp, 1), num_rows)
    # Runs of one head_dim row each, in sizes compiled as constants: their
    # copies unroll into straight vector moves. Moving 16-bit rows (256 bytes
    # for 128 elements) through the general loop cost as much time per row
    # as float32 rows, twice the bytes.
    fn = builder.function
    done = fn.append_basic_block("rows_done")
    general = fn.append_basic_block("rows_any_size")
    switch = builder.switch(run, general)
    for size in _CONSTANT_RUNS:
        block = fn.append_basic_block(f"rows_of_{size}")
        switch.add_case(ir.Constant(intp, size), block)
        builder.position_at_end(block)
        _copy_row_loop(builder, dst, dst_stride, src, src_stride, ir.Constant(intp, size),
                       count, stream, constant=True)
        builder.branch(done)
    builder.position_at_end(general)
    _copy_row_loop(builder, dst, dst_stride, src, src_stride, run, count, stream,
                   constant=False)
    builder.branch(done)
    builder.position_at_end(done)


# Row sizes in bytes (head_dim x itemsize) with copies of their own.
_CONSTANT_RUNS = (128, 256, 512)


def _copy_row_loop(builder, dst, dst_stride, src, src_stride, run, count, stream, constant):
    intp = run.type
    with cgutils.for_range(builder, count) as loop:
        d = builder.gep(dst, [builder.mul(loop.index, dst_stride)])
        s = builder.gep(src, [builder.mul(loop.index, src_stride)])
        with builder.if_else(stream) as (streamed, plain):
            with streamed:
                if constant:
                    _stream_row(builder, d, s, run, intp)
                else:
                    _call_stream_copy(builder, d, s, run)
            with plain:
                cgutils.raw_memcpy(builder, d, s, run, 1)


def _call_stream_copy(builder, dst, src, nbytes):
    """A call of :func:`_stream_loop` as a function of its own: its code then
    stands once in a module, however many places copy this way (which keeps
    compile times down)."""
    intp = nbytes.type
    fn = _out_of_line(builder.module, "pagedkv_stream_copy", [_I8P, _I8P, intp],
                      lambda b, d, s, n: _stream_loop(b, d, s, n, intp))
    builder.call(fn, [dst, src, nbytes])


def _stream_row(builder, dst, src, nbytes, intp):
    """:func:`_stream_loop` for a constant ``nbytes``, a multiple of 16: when
    ``dst`` is 16-byte aligned (rows of an aligned array are), a fixed
    sequence of streaming stores."""
    aligned = builder.icmp_unsigned(
        "==", builder.and_(builder.ptrtoint(dst, intp), ir.Constant(intp, _VEC_BYTES - 1)),
        ir.Constant(intp, 0))
    with builder.if_else(aligned, likely=True) as (fast, slow):
        with fast:
            vec = ir.VectorType(ir.IntType(8), _VEC_BYTES)
            nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            dvec = builder.bitcast(dst, vec.as_pointer())
            svec = builder.bitcast(src, vec.as_pointer())
            for i in range(nbytes.constant // _VEC_BYTES):
                index = [ir.Constant(intp, i)]
                value = builder.load(builder.gep(svec, index), align=1)
                store = builder.store(value, builder.gep(dvec, index), align=_VEC_BYTES)
                store.set_metadata("nontemporal", nontemporal)
        with slow:
            _call_stream_copy(builder, dst, src, nbytes)


def _build_zero(builder, dst, nbytes, stream):
    with builder.if_else(stream) as (streamed, plain):
        with streamed:
            _stream_loop(builder, dst, None, nbytes, nbytes.type)
        with plain:
            cgutils.memset(builder, dst, nbytes, 0)


def _build_prefetch(builder, src, nbytes):
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [_I8P, i32, i32, i32])
    # typed-pointer mangling, as Numba names llvm.memcpy; LLVM remangles it
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    line = ir.Constant(nbytes.type, _CACHE_LINE)
    num_lines = builder.udiv(builder.add(nbytes, ir.Constant(nbytes.type, _CACHE_LINE - 1)),
                             line)
    with cgutils.for_range(builder, num_lines) as loop:
        at = builder.gep(src, [builder.mul(loop.index, line)])
        # read access, keep in all cache levels, data cache
        builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def _copy_rows(typingctx, dst, dst_offset, dst_stride, src, src_offset, src_stride, row_bytes,
               num_rows, stream):
    """Copy ``num_rows`` runs of ``row_bytes``: run ``r`` from byte
    ``src_offset + r * src_stride`` of ``src`` to byte ``dst_offset + r *
    dst_stride`` of ``dst`` (any arrays, strides may be negative); streaming
    stores when ``stream``. Returns False, having copied nothing, when a run
    falls outside either array (checked only with bounds checking on)."""
    sig = types.boolean(dst, types.intp, types.intp, src, types.intp, types.intp, types.intp,
                        types.intp, types.boolean)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        dst_v, dst_off, dst_stride, src_v, src_off, src_stride, row, num, use_stream = args
        dptr, dary = _byte_pointer(context, builder, sig.args[0], dst_v, dst_off)
        sptr, sary = _byte_pointer(context, builder, sig.args[3], src_v, src_off)
        ok = builder.and_(
            _rows_in_extent(context, builder, sig.args[0], dary, dst_off, dst_stride, row, num),
            _rows_in_extent(context, builder, sig.args[3], sary, src_off, src_stride, row, num))
        fn = _out_of_line(builder.module, "pagedkv_copy_rows",
                          [_I8P, intp, _I8P, intp, intp, intp, ir.IntType(1)], _build_copy_rows)
        with builder.if_then(ok, likely=True):
            builder.call(fn, [dptr, dst_stride, sptr, src_stride, row, num, use_stream])
        return ok

    return sig, codegen


@intrinsic
def _zero_bytes(typingctx, dst, dst_offset, nbytes, stream):
    """Zero ``nbytes`` of ``dst`` from byte ``dst_offset``; returns False as
    :func:`_copy_rows` does."""
    sig = types.boolean(dst, types.intp, types.intp, types.boolean)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        dst_v, dst_off, count, use_stream = args
        dptr, dary = _byte_pointer(context, builder, sig.args[0], dst_v, dst_off)
        ok = _in_extent(context, builder, sig.args[0], dary, dst_off, count)
        fn = _out_of_line(builder.module, "pagedkv_zero_bytes",
                          [_I8P, intp, ir.IntType(1)], _build_zero)
        with builder.if_then(ok, likely=True):
            builder.call(fn, [dptr, count, use_stream])
        return ok

    return sig, codegen


@intrinsic
def _prefetch(typingctx, src, offset, nbytes):
    """Hint the CPU to fetch ``nbytes`` of ``src`` from byte ``offset``."""
    sig = types.void(src, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        ptr, _ = _byte_pointer(context, builder, sig.args[0], args[0], args[1])
        fn = _out_of_line(builder.module, "pagedkv_prefetch", [_I8P, intp], _build_prefetch)
        builder.call(fn, [ptr, args[2]])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """Order this thread's streaming stores before anything that follows."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


# -------------------------------------------------------------------- write
@jit_kernel
def _write_tokens(k_cache, v_cache, k, v, layer, slot_mapping, flags, lo, hi):
    """Write tokens ``lo..hi-1`` of ``k``/``v`` [N, H, D] (any strides).
    Returns the number of runs found out of bounds (0 unless bounds checking
    is on and something is wrong)."""
    _, num_pages, a, b, head_dim = k_cache.shape
    hnd = (flags & HND) != 0
    page_size, num_heads = (b, a) if hnd else (a, b)
    itemsize = k_cache.itemsize
    row = head_dim * itemsize
    token_row = num_heads * row
    page_bytes = page_size * token_row
    layer_base = layer * num_pages * page_bytes
    stream = (flags & STREAM) != 0
    # Store byte strides of a position and of a head within a page.
    pos_stride, head_stride = (row, page_size * row) if hnd else (token_row, row)
    num_bad = 0
    for which in range(2):
        cache = k_cache if which == 0 else v_cache
        x = k if which == 0 else v
        s_tok, s_head, s_elem = x.strides
        # Loops over heads (outer, inner) and elements, and the bytes per
        # run. HND goes head by head within a block of tokens so that
        # consecutive slots of one head form one write stream; NHD moves a
        # token's heads in one run when they follow each other in x.
        num_elems = 1
        if hnd:
            num_outer, num_inner, run = num_heads, 1, row
        elif s_head == row and s_elem == itemsize:
            num_outer, num_inner, run = 1, 1, token_row
        else:
            num_outer, num_inner, run = 1, num_heads, row
        if s_elem != itemsize:  # head_dim itself strided: element by element
            num_elems, run = head_dim, itemsize
        for first in range(lo, hi, _WRITE_BLOCK):
            last = min(first + _WRITE_BLOCK, hi)
            if num_outer > 1 and s_tok > 0:  # the block's rows are read once per head
                _prefetch(x, first * s_tok, (last - first) * s_tok)
            for h_out in range(num_outer):
                i = first
                while i < last:
                    slot = slot_mapping[i]
                    if slot < 0:
                        i += 1
                        continue
                    page_id = slot // page_size
                    offset = slot - page_id * page_size
                    # Tokens bound for the next offsets of the same page: one
                    # set of rows, usually one run (a prefill's case).
                    count = 1
                    while (i + count < last and offset + count < page_size
                           and slot_mapping[i + count] == slot + count):
                        count += 1
                    dst = (layer_base + page_id * page_bytes + offset * pos_stride
                           + h_out * head_stride)
                    src = i * s_tok + h_out * s_head
                    for h_in in range(num_inner):
                        for e in range(num_elems):
                            if not _copy_rows(cache, dst + h_in * head_stride + e * itemsize,
                                              pos_stride, x, src + h_in * s_head + e * s_elem,
                                              s_tok, run, count, stream):
                                num_bad += 1
                    i += count
    return num_bad


@jit_kernel
def write_serial(k_cache, v_cache, layer, slot_mapping, k, v, flags):
    """Write ``k``/``v`` [N, H, D] into the slots of ``slot_mapping`` [N] (-1 skips)."""
    num_bad = _write_tokens(k_cache, v_cache, k, v, layer, slot_mapping, flags,
                            0, slot_mapping.shape[0])
    if flags & STREAM:
        _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


@jit_kernel(parallel=True)
def write_parallel(k_cache, v_cache, layer, slot_mapping, k, v, flags):
    """:func:`write_serial` split into token chunks across threads."""
    n = slot_mapping.shape[0]
    nbytes = 2 * n * k.shape[1] * k.shape[2] * k.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    num_bad = 0
    for c in prange(num_chunks):
        num_bad += _write_tokens(k_cache, v_cache, k, v, layer, slot_mapping, flags,
                                 c * n // num_chunks, (c + 1) * n // num_chunks)
        if flags & STREAM:
            _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


# ------------------------------------------------------------------- gather
@jit_kernel
def _num_blocks(k_cache, k_out, flags):
    """Blocks of ``page_size`` output positions over all sequences."""
    page_size = k_cache.shape[3] if flags & HND else k_cache.shape[2]
    num_positions = k_out.shape[2] if flags & BHTD else k_out.shape[1]
    return k_out.shape[0] * ((num_positions + page_size - 1) // page_size)


@jit_kernel
def _gather_blocks(k_cache, v_cache, k_out, v_out, layer, page_table, seq_lens, flags, lo, hi):
    """Fill blocks ``lo..hi-1`` of the outputs; block ``b * num_blocks + j`` is
    positions ``[j * page_size, (j + 1) * page_size)`` of sequence ``b``: the
    part below ``seq_lens[b]`` comes from page ``page_table[b, j]``, the rest is
    zero. Returns the number of runs found out of bounds."""
    _, num_pages, a, b, head_dim = k_cache.shape
    hnd = (flags & HND) != 0
    bhtd = (flags & BHTD) != 0
    stream = (flags & STREAM) != 0
    page_size, num_heads = (b, a) if hnd else (a, b)
    row = head_dim * k_cache.itemsize
    token_row = num_heads * row
    page_bytes = page_size * token_row
    layer_base = layer * num_pages * page_bytes
    num_positions = k_out.shape[2] if bhtd else k_out.shape[1]
    num_blocks = (num_positions + page_size - 1) // page_size
    # Byte strides of a head and of a position, in the store and in the output.
    src_h, src_t = (page_size * row, row) if hnd else (row, token_row)
    dst_h, dst_t = (num_positions * row, row) if bhtd else (row, token_row)
    # Whatever is contiguous on both sides moves as one run; otherwise rows of
    # head_dim go in the output's order, so that writes form one stream.
    joined_tokens = not hnd and not bhtd
    joined_positions = hnd and bhtd
    # Rows read with a stride: each block's pages are fetched while the block
    # before is copied, so that memory's latency overlaps the copy. (Fetching
    # several blocks ahead, or copying head by head across several blocks,
    # measured slower.)
    strided = not joined_tokens and not joined_positions
    num_bad = 0
    # (with strided reads, one turn ahead of the first block: its fetch)
    for item in range(lo - 1 if strided else lo, hi):
        ahead = item + 1
        if strided and ahead < hi:
            seq = ahead // num_blocks
            t0 = (ahead - seq * num_blocks) * page_size
            if t0 < seq_lens[seq]:
                src0 = layer_base + page_table[seq, t0 // page_size] * page_bytes
                _prefetch(k_cache, src0, page_bytes)
                _prefetch(v_cache, src0, page_bytes)
        if item < lo:
            continue
        seq = item // num_blocks
        t0 = (item - seq * num_blocks) * page_size
        t1 = min(t0 + page_size, num_positions)
        n = seq_lens[seq]
        count = min(t1, n) - t0  # positions that come from the page
        out_seq = seq * num_positions * token_row
        if count > 0:
            src0 = layer_base + page_table[seq, t0 // page_size] * page_bytes
            dst0 = out_seq + t0 * dst_t
            if joined_tokens:
                num_outer, s_out, d_out, num_inner, s_in, d_in, run = (
                    1, 0, 0, 1, 0, 0, count * token_row)
            elif joined_positions:
                num_outer, s_out, d_out, num_inner, s_in, d_in, run = (
                    num_heads, src_h, dst_h, 1, 0, 0, count * row)
            elif bhtd:
                num_outer, s_out, d_out, num_inner, s_in, d_in, run = (
                    num_heads, src_h, dst_h, count, src_t, dst_t, row)
            else:
                num_outer, s_out, d_out, num_inner, s_in, d_in, run = (
                    count, src_t, dst_t, num_heads, src_h, dst_h, row)
            for which in range(2):
                cache = k_cache if which == 0 else v_cache
                out = k_out if which == 0 else v_out
                for o in range(num_outer):
                    if not _copy_rows(out, dst0 + o * d_out, d_in, cache, src0 + o * s_out,
                                      s_in, run, num_inner, stream):
                        num_bad += 1
        z0 = max(t0, n)
        if z0 < t1:
            num_zero, zero_run = (num_heads, (t1 - z0) * row) if bhtd else (
                1, (t1 - z0) * token_row)
            for which in range(2):
                out = k_out if which == 0 else v_out
                for h in range(num_zero):
                    if not _zero_bytes(out, out_seq + h * dst_h + z0 * dst_t, zero_run, stream):
                        num_bad += 1
    return num_bad


@jit_kernel
def gather_serial(k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out, flags):
    """Gather sequences [B] of ``page_table`` [B, max_pages] into ``k_out``/``v_out``."""
    num_bad = _gather_blocks(k_cache, v_cache, k_out, v_out, layer, page_table, seq_lens,
                             flags, 0, _num_blocks(k_cache, k_out, flags))
    if flags & STREAM:
        _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


@jit_kernel(parallel=True)
def gather_parallel(k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out, flags):
    """:func:`gather_serial` split into chunks of blocks across threads."""
    n = _num_blocks(k_cache, k_out, flags)
    nbytes = 2 * k_out.size * k_out.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    num_bad = 0
    for c in prange(num_chunks):
        num_bad += _gather_blocks(k_cache, v_cache, k_out, v_out, layer, page_table, seq_lens,
                                  flags, c * n // num_chunks, (c + 1) * n // num_chunks)
        if flags & STREAM:
            _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


# --------------------------------------------------------------- copy_pages
@jit_kernel
def _copy_page_pairs(k_cache, v_cache, src_pages, dst_pages, stream, lo, hi):
    """Copy pairs ``lo..hi-1``; pair ``l * n + i`` is page ``i`` of layer ``l``.
    Returns the number of runs found out of bounds."""
    num_layers, num_pages = k_cache.shape[0], k_cache.shape[1]
    page_bytes = k_cache.size // (num_layers * num_pages) * k_cache.itemsize
    n = src_pages.shape[0]
    num_bad = 0
    for item in range(lo, hi):
        layer = item // n
        i = item - layer * n
        base = layer * num_pages
        for which in range(2):
            cache = k_cache if which == 0 else v_cache
            if not _copy_rows(cache, (base + dst_pages[i]) * page_bytes, 0, cache,
                              (base + src_pages[i]) * page_bytes, 0, page_bytes, 1, stream):
                num_bad += 1
    return num_bad


@jit_kernel
def copy_pages_serial(k_cache, v_cache, src_pages, dst_pages, flags):
    """Copy every layer's page ``src_pages[i]`` to ``dst_pages[i]``, K and V."""
    stream = (flags & STREAM) != 0
    num_bad = _copy_page_pairs(k_cache, v_cache, src_pages, dst_pages, stream,
                               0, k_cache.shape[0] * src_pages.shape[0])
    if stream:
        _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)


@jit_kernel(parallel=True)
def copy_pages_parallel(k_cache, v_cache, src_pages, dst_pages, flags):
    """:func:`copy_pages_serial` split into chunks of pages across threads."""
    n = k_cache.shape[0] * src_pages.shape[0]
    stream = (flags & STREAM) != 0
    nbytes = 2 * n * (k_cache.size // (k_cache.shape[0] * k_cache.shape[1])) * k_cache.itemsize
    num_chunks = min(n, _MAX_CHUNKS, max(1, nbytes // _MIN_CHUNK_BYTES))
    num_bad = 0
    for c in prange(num_chunks):
        num_bad += _copy_page_pairs(k_cache, v_cache, src_pages, dst_pages, stream,
                                    c * n // num_chunks, (c + 1) * n // num_chunks)
        if stream:
            _store_fence()
    if num_bad:
        raise IndexError(_OUT_OF_BOUNDS)
