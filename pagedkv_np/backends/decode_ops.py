"""The pieces of a decoder's decode step that are not products with a weight.

:mod:`pagedkv_np.onnxruntime.native` runs a decode step of the decoders that
:mod:`pagedkv_np.models.graph` builds with its own kernels instead of the
onnxruntime graph; these are its Numba kernels for everything but the
weights' products (:mod:`.block_gemv`, :mod:`.block_q8`, :func:`float_matmul`
here): RMSNorm, rotate-half RoPE, grouped-query attention over a contiguous
past, the gated MLP's activation and the embedding's rows.

Every kernel works row by row (a row is one sequence's token) with the same
code for every row, so a row's result does not depend on the other rows of
the batch or on the thread count. The attention kernel lets LLVM reorder its
dot products' sums (``fastmath={"reassoc", "contract"}``) so that they
vectorize: the order is then the compiler's, the same on every call. Inputs
are trusted: the caller (:class:`~pagedkv_np.onnxruntime.native.NativeDecode`)
checks the shapes once, when it lays the weights out, and owns every buffer.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from .jit import jit_kernel

__all__ = ["rms_norm", "head_norm", "rope", "write_kv", "attend", "attend_serial", "gated",
           "float_matmul", "embed_float", "embed_blocks", "add_into", "ACT_SILU",
           "ACT_GELU_TANH"]

#: :func:`gated`'s activation codes
ACT_SILU, ACT_GELU_TANH = 0, 1

_FAST = {"reassoc", "contract", "nsz"}


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


@jit_kernel(fastmath=_FAST)
def _dot(a, a_off, k, n):
    t = np.float32(0.0)
    for i in range(n):
        t += a[a_off + i] * k[i]
    return t


@jit_kernel(fastmath=_FAST)
def _attend_one(job, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
                scale, out):
    """Query head ``job % num_heads`` of sequence ``job // num_heads``."""
    b, h = job // num_heads, job % num_heads
    kv = h // (num_heads // num_kv_heads)
    last = positions[b]
    first = max(0, last - window + 1) if window > 0 else 0
    scores = np.empty(last - first + 1, np.float32)
    q = x[b]
    qo = h * head_dim
    top = np.float32(-np.inf)
    for t in range(first, last + 1):
        s = _dot(q, qo, kbuf[b, kv, t], head_dim) * np.float32(scale)
        scores[t - first] = s
        top = max(top, s)
    total = np.float32(0.0)
    for t in range(scores.shape[0]):
        e = np.float32(math.exp(scores[t] - top))
        scores[t] = e
        total += e
    acc = np.zeros(head_dim, np.float32)
    for t in range(first, last + 1):
        p = scores[t - first]
        v = vbuf[b, kv, t]
        for i in range(head_dim):
            acc[i] += p * v[i]
    inv = np.float32(1.0) / total
    for i in range(head_dim):
        out[b, qo + i] = acc[i] * inv


@jit_kernel(parallel=True)
def attend(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window, scale, out):
    """Each query head of ``x[b]`` attends to the keys of ``kbuf[b]`` /
    ``vbuf[b]`` at positions ``0 .. positions[b]`` (the last ``window`` of
    them when ``window > 0``): softmax of the scaled scores, then the
    weighted sum of values, into ``out[b, h * head_dim:]``. Heads in parallel."""
    for job in prange(x.shape[0] * num_heads):
        _attend_one(job, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
                    scale, out)


@jit_kernel
def attend_serial(x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window, scale,
                  out):
    """:func:`attend` on the calling thread (the same bits): for short pasts,
    where a parallel region costs more than it saves."""
    for job in range(x.shape[0] * num_heads):
        _attend_one(job, x, num_heads, num_kv_heads, head_dim, kbuf, vbuf, positions, window,
                    scale, out)


@jit_kernel
def gated(gate, up, activation, out):
    """``act(gate[b]) * up[b]`` (SiLU or tanh GELU)."""
    c = np.float32(math.sqrt(2.0 / math.pi))
    for b in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[b, i]
            if activation == ACT_SILU:
                a = g / (np.float32(1.0) + np.float32(math.exp(-g)))
            else:
                inner = c * (g + np.float32(0.044715) * g * g * g)
                a = np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner)))
            out[b, i] = a * up[b, i]


@jit_kernel
def add_into(x, y):
    """``x += y``."""
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[b, i] += y[b, i]


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
