"""The pieces of a decoder's decode step that are not products with a weight.

:mod:`pagedkv_np.onnxruntime.native` runs a decode step of the decoders that
:mod:`pagedkv_np.models.graph` builds with its own kernels instead of the
onnxruntime graph; these are its Numba kernels for everything but the
weights' products (:mod:`.block_gemv`, :mod:`.block_q8`, :func:`float_matmul`
here): RMSNorm, rotate-half RoPE, grouped-query attention over a contiguous
past, the gated MLP's activation and the embedding's rows.

Every kernel works row by row (a row is one sequence's token) with the same
code for every row, so a row's result does not depend on the other rows of
the batch or on the thread count. Only two pure reductions (:func:`_dot`,
:func:`_sum`) let LLVM reorder their sums so that they vectorize; every other
loop keeps IEEE order, so that its bits do not depend on how the compiler
inlined it. Reordering flags on a kernel that stores made parallel and serial
attention differ in the last bit when one of them was compiled against a
callee that another process had left in the disk cache. Inputs
are trusted: the caller (:class:`~pagedkv_np.onnxruntime.native.NativeDecode`)
checks the shapes once, when it lays the weights out, and owns every buffer.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from .jit import jit_kernel

__all__ = ["rms_norm", "head_norm", "rope", "write_kv", "rope_write_kv", "attend",
           "attend_serial", "gated", "float_matmul", "embed_float", "embed_blocks", "add_into",
           "add_norm", "ACT_SILU", "ACT_GELU_TANH"]

#: :func:`gated`'s activation codes
ACT_SILU, ACT_GELU_TANH = 0, 1

@jit_kernel
def rms_norm(x, weight, eps, out):
    """``out[b] = x[b] / sqrt(mean(x[b]^2) + eps) * weight``, float32, sums in order."""
    n = x.shape[1]
    for b in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[b, i] * x[b, i]
        inv = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + np.float32(eps)))
        for i in range(n):
            out[b, i] = x[b, i] * inv * weight[i]


@jit_kernel
def head_norm(x, num_heads, head_dim, weight, eps):
    """RMSNorm of each head of ``x[b]`` (``[num_heads * head_dim]``), in place."""
    for b in range(x.shape[0]):
        for h in range(num_heads):
            o = h * head_dim
            ss = np.float32(0.0)
            for i in range(head_dim):
                ss += x[b, o + i] * x[b, o + i]
            inv = np.float32(1.0) / np.float32(
                math.sqrt(ss / np.float32(head_dim) + np.float32(eps)))
            for i in range(head_dim):
                x[b, o + i] = x[b, o + i] * inv * weight[i]


@jit_kernel
def rope(x, num_heads, head_dim, cos, sin, positions):
    """Rotate-half RoPE of the heads of ``x[b]`` at position ``positions[b]``, in place."""
    half = head_dim // 2
    for b in range(x.shape[0]):
        p = positions[b]
        for h in range(num_heads):
            o = h * head_dim
            for i in range(half):
                x1, x2 = x[b, o + i], x[b, o + half + i]
                c, s = cos[p, i], sin[p, i]
                x[b, o + i] = x1 * c - x2 * s
                x[b, o + half + i] = x2 * c + x1 * s


@jit_kernel
def write_kv(k, v, num_kv_heads, head_dim, kbuf, vbuf, positions):
    """The heads of ``k[b]`` and ``v[b]`` into ``kbuf[b, :, positions[b]]`` and
    ``vbuf[b, :, positions[b]]``."""
    for b in range(k.shape[0]):
        p = positions[b]
        for h in range(num_kv_heads):
            for i in range(head_dim):
                kbuf[b, h, p, i] = k[b, h * head_dim + i]
                vbuf[b, h, p, i] = v[b, h * head_dim + i]


@jit_kernel
def rope_write_kv(q, k, v, num_heads, num_kv_heads, head_dim, cos, sin, positions, kbuf, vbuf):
    """:func:`rope` of ``q`` and ``k``, then :func:`write_kv`: one call, the same bits."""
    rope(q, num_heads, head_dim, cos, sin, positions)
    rope(k, num_kv_heads, head_dim, cos, sin, positions)
    write_kv(k, v, num_kv_heads, head_dim, kbuf, vbuf, positions)


# exp(r) on |r| <= ln(2) / 2 as 1 + r + r^2 (c0 + c1 r + ... + c5 r^5): the
# coefficients of Cephes' expf (relative error about 1e-7 over the range)
_EXP_C = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3,
          1.3981999507e-3, 1.9875691500e-4)
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4


# LLVM may reorder the sums of these two to vectorize them (reassoc) and fuse
# their products (contract). Each is a pure reduction with no store, so its
# vector loop runs without a runtime alias check: the order of its sums is
# that of its compiled code and ``n`` alone, the same on every call and in
# every caller. Loops that store keep strict IEEE order, so whichever path an
# alias check takes there, the bits are the same.
_REDUCE = {"reassoc", "contract", "nsz"}


@jit_kernel(fastmath=_REDUCE)
def _dot(a, b, n):
    """``sum(a[:n] * b[:n])`` in float32."""
    s = np.float32(0.0)
    for i in range(n):
        s += a[i] * b[i]
    return s


@jit_kernel(fastmath=_REDUCE)
def _sum(a, n):
    """``sum(a[:n])`` in float32."""
    s = np.float32(0.0)
    for i in range(n):
        s += a[i]
    return s


@jit_kernel
def _exp_in_place(row, n, shift, twos):
    """``row[:n] = exp(row[:n] - shift)``: ``2^k * p(r)`` with ``k`` the nearest
    integer to ``x / ln 2``, ``p`` a polynomial on the rest and ``2^k`` built
    from its exponent bits in ``twos`` (int32 scratch of ``n`` or more); ``x``
    clamped to [-87, 88] (``exp(-87)`` is ~1e-38, ``exp(88)`` ~1.7e38). No
    library call, so the loop vectorizes."""
    c0, c1, c2, c3, c4, c5 = _EXP_C
    for t in range(n):
        x = min(max(row[t] - shift, np.float32(-87.0)), np.float32(88.0))
        k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
        r = x - k * np.float32(_LN2_HI) - k * np.float32(_LN2_LO)
        poly = (((((np.float32(c5) * r + np.float32(c4)) * r + np.float32(c3)) * r
                  + np.float32(c2)) * r + np.float32(c1)) * r + np.float32(c0))
        row[t] = poly * r * r + r + np.float32(1.0)
        twos[t] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = twos[:n].view(np.float32)
    for t in range(n):
        row[t] *= scale[t]


@jit_kernel
def _exp_shifted(row, n, top, twos):
    """``row[:n] = exp(row[:n] - top)`` (every value <= top, see
    :func:`_exp_in_place`); returns their sum (:func:`_sum`)."""
    _exp_in_place(row, n, top, twos)
    return _sum(row, n)


#: positions per part of a long past: attention over more positions than this
#: runs in parts of this many (the last one shorter), each part a job of its
#: own, joined in order (see :func:`attend`)
ATTEND_PART = 128


@jit_kernel
def _span(b, positions, window):
    """The first position sequence ``b`` attends to and how many it sees."""
    last = positions[b]
    first = max(0, last - window + 1) if window > 0 else 0
    return first, last - first + 1


@jit_kernel
def _num_parts(b, positions, window):
    _, n = _span(b, positions, window)
    return (n + ATTEND_PART - 1) // ATTEND_PART


@jit_kernel
def _attend_part(b, kv, part, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions,
                 window, scale, top, total, acc):
    """Part ``part`` of the past of K/V head ``kv`` of sequence ``b``, for the
    query heads that share it (each key and value read once for all):
    ``top[g]`` the highest scaled score of query head ``g``, ``total[g]`` the
    sum of ``exp(score - top[g])`` and ``acc[g]`` those weights times the
    values, summed in position order."""
    groups = num_heads // num_kv_heads
    first, n = _span(b, positions, window)
    lo = first + part * ATTEND_PART
    count = min(ATTEND_PART, first + n - lo)
    scores = np.empty((groups, count), np.float32)
    q = np.empty((groups, head_dim), np.float32)
    base = kv * groups
    for g in range(groups):
        o = (base + g) * head_dim
        for i in range(head_dim):
            q[g, i] = x[b, o + i] * np.float32(scale)
    keys, values = kbuf[b, kv], vbuf[b, kv]
    for t in range(count):
        k = keys[lo + t]
        for g in range(groups):
            scores[g, t] = _dot(q[g], k, head_dim)
    twos = np.empty(count, np.int32)
    for g in range(groups):
        high = np.float32(-np.inf)
        for t in range(count):
            high = max(high, scores[g, t])
        top[g] = high
        total[g] = _exp_shifted(scores[g], count, high, twos)
        for i in range(head_dim):
            acc[g, i] = np.float32(0.0)
    for t in range(count):
        v = values[lo + t]
        for g in range(groups):
            p = scores[g, t]
            for i in range(head_dim):
                acc[g, i] += p * v[i]


@jit_kernel
def _jobs(batch, num_kv_heads, positions, window, starts):
    """``starts[pair]``: the first job of each (sequence, K/V head) pair, a
    job per part; returns the number of jobs."""
    jobs = 0
    for pair in range(batch * num_kv_heads):
        starts[pair] = jobs
        jobs += _num_parts(pair // num_kv_heads, positions, window)
    return jobs


@jit_kernel
def _job_buffers(batch, num_heads, num_kv_heads, head_dim, positions, window):
    """``starts`` (:func:`_jobs`), the number of jobs, and each job's ``top``,
    ``total`` and ``acc`` (:func:`_attend_part`)."""
    groups = num_heads // num_kv_heads
    starts = np.empty(batch * num_kv_heads, np.int64)
    jobs = _jobs(batch, num_kv_heads, positions, window, starts)
    tops = np.empty((jobs, groups), np.float32)
    totals = np.empty((jobs, groups), np.float32)
    accs = np.empty((jobs, groups, head_dim), np.float32)
    return starts, jobs, tops, totals, accs


@jit_kernel
def _run_job(job, starts, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
             scale, tops, totals, accs):
    pair = 0
    while pair + 1 < starts.shape[0] and starts[pair + 1] <= job:
        pair += 1
    _attend_part(pair // num_kv_heads, pair % num_kv_heads, job - starts[pair], x, num_heads,
                 num_kv_heads, head_dim, kbuf, vbuf, positions, window, scale, tops[job],
                 totals[job], accs[job])


@jit_kernel
def _join(starts, jobs, num_heads, num_kv_heads, head_dim, tops, totals, accs, out):
    """Each pair's parts in order: ``sum_j w_j acc_j / sum_j w_j total_j`` with
    ``w_j = exp(top_j - max top)``, into ``out[b, h * head_dim:]``."""
    groups = num_heads // num_kv_heads
    pairs = starts.shape[0]
    row = np.empty(head_dim, np.float32)
    for pair in range(pairs):
        b, kv = pair // num_kv_heads, pair % num_kv_heads
        lo = starts[pair]
        hi = starts[pair + 1] if pair + 1 < pairs else jobs
        for g in range(groups):
            high = tops[lo, g]
            for j in range(lo + 1, hi):
                high = max(high, tops[j, g])
            weight = np.float32(0.0)
            for i in range(head_dim):
                row[i] = np.float32(0.0)
            for j in range(lo, hi):
                w = np.float32(math.exp(tops[j, g] - high))
                weight += w * totals[j, g]
                for i in range(head_dim):
                    row[i] += w * accs[j, g, i]
            inv = np.float32(1.0) / weight
            o = (kv * groups + g) * head_dim
            for i in range(head_dim):
                out[b, o + i] = row[i] * inv


def attend(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window, scale, out):
    """Each query head of ``x[b]`` attends to the keys of ``kbuf[b]`` /
    ``vbuf[b]`` at positions ``0 .. positions[b]`` (the last ``window`` of
    them when ``window > 0``): softmax of the scaled scores, then the
    weighted sum of values, into ``out[b, h * head_dim:]``.

    The work is split in jobs: a job per K/V head of each sequence and per
    :data:`ATTEND_PART` positions of its past, each with the query heads
    that share that K/V head (so each key and value is read once); the parts
    of a past are then joined in order. The split depends on the sequence's
    own length only, never on the batch or the thread count, so a row's bits
    do not either. One job (one K/V head, at batch 1 and a short past)
    runs on the calling thread; more run in parallel. At batch 1 on 2
    threads, a layer at 4,096 positions took 0.70 ms against 1.28 serially
    (Gemma 3 270M, one K/V head of 256) and 0.59 against 0.78 (SmolLM2, 3 of
    64); before the parts, one K/V head ran alone on one thread whatever the
    length. Parts of 128 positions beat 256 and 512 on Gemma 3's 512-position
    windows (0.105 ms against 0.126 and 0.151)."""
    # one job: one (sequence, K/V head) pair whose past fits one part
    single = x.shape[0] * num_kv_heads == 1 and min(
        int(positions[0]) + 1, window if window > 0 else ATTEND_PART + 1) <= ATTEND_PART
    if single:
        attend_serial(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
                      scale, out)
    else:
        _attend_parallel(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
                         scale, out)


@jit_kernel(parallel=True)
def _attend_parallel(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
                     scale, out):
    """:func:`attend`, its jobs in parallel."""
    starts, jobs, tops, totals, accs = _job_buffers(x.shape[0], num_heads, num_kv_heads,
                                                    head_dim, positions, window)
    for job in prange(jobs):
        _run_job(job, starts, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions,
                 window, scale, tops, totals, accs)
    _join(starts, jobs, num_heads, num_kv_heads, head_dim, tops, totals, accs, out)


@jit_kernel
def attend_serial(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window, scale,
                  out):
    """:func:`attend` on the calling thread (the same bits): for short pasts,
    where a parallel region costs more than it saves."""
    starts, jobs, tops, totals, accs = _job_buffers(x.shape[0], num_heads, num_kv_heads,
                                                    head_dim, positions, window)
    for job in range(jobs):
        _run_job(job, starts, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions,
                 window, scale, tops, totals, accs)
    _join(starts, jobs, num_heads, num_kv_heads, head_dim, tops, totals, accs, out)


@jit_kernel
def gated(gate, up, activation, out):
    """``act(gate[b]) * up[b]``: SiLU ``g / (1 + exp(-g))``, or tanh GELU
    written the same way, ``0.5 g (1 + tanh(u)) = g / (1 + exp(-2u))`` with
    ``u = sqrt(2 / pi) (g + 0.044715 g^3)``; ``exp`` as
    :func:`_exp_in_place`, so that a row's loops vectorize (Gemma 3 270M's
    18 x 2,048 per token: 1.2 ms with the library's scalar ``tanh``)."""
    n = gate.shape[1]
    z = np.empty(n, np.float32)
    twos = np.empty(n, np.int32)
    c = np.float32(-2.0 * math.sqrt(2.0 / math.pi))
    for b in range(gate.shape[0]):
        if activation == ACT_SILU:
            for i in range(n):
                z[i] = -gate[b, i]
        else:
            for i in range(n):
                g = gate[b, i]
                z[i] = c * (g + np.float32(0.044715) * g * g * g)
        _exp_in_place(z, n, np.float32(0.0), twos)
        for i in range(n):
            out[b, i] = gate[b, i] / (np.float32(1.0) + z[i]) * up[b, i]


@jit_kernel
def add_into(x, y):
    """``x += y``."""
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[b, i] += y[b, i]


@jit_kernel
def add_norm(x, y, post, weight, eps, out):
    """A residual step in one call, the same bits as its parts: ``y`` normed
    in place by ``post`` first unless that is empty (:func:`rms_norm`), then
    ``x += y`` (:func:`add_into`), then ``out`` = :func:`rms_norm` of ``x`` by
    ``weight``."""
    if post.shape[0] != 0:
        rms_norm(y, post, eps, y)
    add_into(x, y)
    rms_norm(x, weight, eps, out)


@jit_kernel(parallel=True)
def float_matmul(x, w, chunks, out):
    """``out = x @ w`` for float32 ``w`` ``[K, N]``: each output summed over
    ``k`` in order, outputs split over threads in ``chunks`` column ranges."""
    k_total, n_total = w.shape
    for c in prange(chunks):
        lo, hi = c * n_total // chunks, (c + 1) * n_total // chunks
        for b in range(x.shape[0]):
            for n in range(lo, hi):
                out[b, n] = 0.0
            for k in range(k_total):
                xk = x[b, k]
                for n in range(lo, hi):
                    out[b, n] += xk * w[k, n]


@jit_kernel
def embed_float(table, tokens, scale, out):
    """``out[b] = table[tokens[b]] * scale`` (float32 or float16 ``table``)."""
    for b in range(tokens.shape[0]):
        for i in range(out.shape[1]):
            out[b, i] = np.float32(table[tokens[b], i]) * np.float32(scale)


@jit_kernel
def embed_blocks(codes, zeros, scales, offsets, bits, block_size, tokens, scale, out):
    """``out[b]``: row ``tokens[b]`` of an embedding in blocks (MatMulNBits
    layout, ``codes`` ``[vocab, K * bits // 8]``, ``zeros`` / ``scales`` /
    ``offsets`` ``[vocab, blocks]``; no offsets: an empty second axis), each
    value ``(code - zero) * scale (+ offset)`` in float32, then times ``scale``."""
    hidden = out.shape[1]
    for b in range(tokens.shape[0]):
        t = tokens[b]
        for i in range(hidden):
            blk = i // block_size
            if bits == 8:
                code = np.int32(codes[t, i])
            else:
                byte = np.int32(codes[t, i // 2])
                code = byte & 15 if i % 2 == 0 else byte >> 4
            v = np.float32(code - np.int32(zeros[t, blk])) * scales[t, blk]
            if offsets.shape[1]:
                v = v + offsets[t, blk]
            if scale != 1.0:
                v = v * np.float32(scale)
            out[b, i] = v
