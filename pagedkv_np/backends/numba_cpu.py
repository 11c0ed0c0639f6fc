"""The Numba CPU backend: compiled kernels, threads for large moves.

Importing this module imports Numba; without Numba it raises ImportError,
which the registry turns into :class:`~pagedkv_np.errors.BackendUnavailable`.

Each operation picks one of two kernels by the bytes it writes:

* below :data:`PARALLEL_MIN_BYTES` a serial kernel runs on the calling thread:
  a decode step's write (a few hundred KiB) takes less time than waking
  Numba's thread pool adds;
* from :data:`PARALLEL_MIN_BYTES` a ``parallel=True`` kernel splits the work
  into chunks over Numba's threads (``numba.set_num_threads`` /
  ``NUMBA_NUM_THREADS``; this module never changes the count), unless that
  count is below :data:`PARALLEL_MIN_THREADS`. Threads help only when cores
  are idle: on a machine busy with other work, waking the pool's threads can
  cost milliseconds, and ``numba.set_num_threads(1)`` is the remedy.

Independently, the kernels may write with non-temporal (streaming) stores,
which skip the read-for-ownership of each destination line: a store that
misses the cache costs one memory transfer instead of two, while a store that
would have hit it costs a transfer it did not need.

* :meth:`~NumbaBackend.write` always streams (:data:`WRITE_STREAM_MIN_BYTES`
  is 0): its destinations are new positions, which nothing has read since the
  store was allocated and which are therefore not in the cache.
* gather and copy_pages stream from :data:`STREAM_MIN_BYTES`: below it,
  ordinary stores keep the output in the cache for the model that reads it
  next; above it, the output would not fit there anyway.

The values come from ``scripts/bench_numba.py --only thresholds``, which times
every variant against the bytes moved; figures quoted below are from a 2-core
machine with 1 MiB of L2 per core and 32 MiB of L3.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError as exc:  # the registry reports this as BackendUnavailable
    raise ImportError(
        f"the numba backend needs Numba, which failed to import ({exc}); "
        f"install it with: pip install 'numba>=0.59'") from exc

from ..layout import OutputLayout, StoreLayout
from ..quant import group_size
from . import _numba_kernels as _k
from . import _numba_quant as _q
from .base import Backend

__all__ = ["NumbaBackend", "PARALLEL_MIN_BYTES", "PARALLEL_MIN_THREADS", "STREAM_MIN_BYTES",
           "WRITE_STREAM_MIN_BYTES"]

#: Bytes written (K plus V) from which the parallel kernels are used. At
#: 256 KiB the serial kernels were faster (write 14-21 us against 22-25,
#: gather 8 against 11-13), at 512 KiB the parallel ones (write 31-32 us
#: against 36-37, gather 10-11 against 16). A decode write of 32 tokens of
#: 8 x 128 float32 is 256 KiB.
PARALLEL_MIN_BYTES = 512 << 10

#: Numba threads needed for the parallel kernels: with one, they would only
#: add the thread pool's overhead to the serial work.
PARALLEL_MIN_THREADS = 2

#: Bytes written (K plus V) from which gather and copy_pages bypass the
#: cache: about the size of the L3. In parallel, a 4 MiB gather took 66-77 us
#: with ordinary stores and 190-230 us streaming, a 16 MiB one 0.5-0.9 ms
#: against 0.8-0.9 ms, a 32 MiB one 1.8-2.3 ms against 1.6-1.7 ms.
STREAM_MIN_BYTES = 32 << 20

#: The same for write: every size, since a write's destination is cold.
#: Writing random cold slots, streaming took 5-6 us against 10 at 64 KiB and
#: 14-21 us against 39-44 at 256 KiB.
WRITE_STREAM_MIN_BYTES = 0

_UINT16 = np.dtype(np.uint16)


def _typed(x: np.ndarray) -> np.ndarray:
    """``x`` as the kernels take it: float32 and int8 as they are, 16-bit
    floats as ``uint16`` (a view: Numba cannot type float16 or bfloat16
    arrays)."""
    return x if x.itemsize != 2 else x.view(_UINT16)


_FLOAT16 = np.dtype(np.float16)


def _bits_and_kind(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x`` as the quantized kernels take it (float32 as it is, 16-bit
    types as ``uint16`` views) and what it holds."""
    if x.itemsize == 4:
        return x, _q.KIND_F32
    return x.view(_UINT16), _q.KIND_F16 if x.dtype == _FLOAT16 else _q.KIND_BF16


def _parallel(nbytes: int) -> bool:
    return nbytes >= PARALLEL_MIN_BYTES and numba.get_num_threads() >= PARALLEL_MIN_THREADS


def _flags(nbytes: int, layout: StoreLayout, out_layout: OutputLayout | None = None) -> int:
    flags = _k.HND if layout is StoreLayout.HND else 0
    if out_layout is OutputLayout.BHTD:
        flags |= _k.BHTD
    if nbytes >= STREAM_MIN_BYTES:
        flags |= _k.STREAM
    return flags


class NumbaBackend(Backend):
    """CPU backend with Numba kernels; bit-exact with the NumPy reference.

    The kernels take float32 arrays as they are and float16/bfloat16 ones as
    ``uint16`` views (no copies), and move runs of bytes that are contiguous on
    both sides, never values: results are bit-exact, NaN payloads included.
    They compile lazily on first use, once for float32 and once for both
    16-bit types, and are cached on disk (see :mod:`pagedkv_np.backends.jit`);
    :func:`pagedkv_np.warmup` compiles them ahead. ``k``/``v`` given to
    :meth:`write` may have any strides.
    """

    name = "numba"

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when usable, else the reason it is not."""
        # set in numba.config's globals at run time, so unknown to mypy
        if numba.config.DISABLE_JIT:  # type: ignore[attr-defined]
            return "NUMBA_DISABLE_JIT is set, and this backend needs compiled kernels"
        return None

    def _write(self, k_cache, v_cache, layer, slot_mapping, k, v, layout):
        # Runs once per layer per decode step: a few attribute lookups, and no
        # views at all for float32.
        nbytes = 2 * k.nbytes
        flags = _k.HND if layout is StoreLayout.HND else 0
        if nbytes >= WRITE_STREAM_MIN_BYTES:
            flags |= _k.STREAM
        if k.itemsize == 2:
            k, v = k.view(_UINT16), v.view(_UINT16)
            k_cache, v_cache = k_cache.view(_UINT16), v_cache.view(_UINT16)
        kernel = _k.write_parallel if _parallel(nbytes) else _k.write_serial
        kernel(k_cache, v_cache, layer, slot_mapping, k, v, flags)

    def _gather(self, k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out,
                layout, out_layout):
        nbytes = 2 * k_out.nbytes
        kernel = _k.gather_parallel if _parallel(nbytes) else _k.gather_serial
        kernel(_typed(k_cache), _typed(v_cache), layer, page_table, seq_lens,
               _typed(k_out), _typed(v_out), _flags(nbytes, layout, out_layout))

    def _copy_pages(self, k_cache, v_cache, src_pages, dst_pages, layout):
        # every layer's page, K and V
        nbytes = 2 * src_pages.shape[0] * (k_cache.nbytes // k_cache.shape[1])
        kernel = _k.copy_pages_parallel if _parallel(nbytes) else _k.copy_pages_serial
        kernel(_typed(k_cache), _typed(v_cache), src_pages, dst_pages, _flags(nbytes, layout))

    def _write_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, slot_mapping, k, v,
                         layout):
        (k_bits, kind), (v_bits, _) = _bits_and_kind(k), _bits_and_kind(v)
        nbytes = 2 * k.nbytes
        kernel = _q.write_q_parallel if _parallel(nbytes) else _q.write_q_serial
        kernel(k_cache, v_cache, k_scale, v_scale, layer, slot_mapping, k_bits, v_bits, kind,
               layout is StoreLayout.HND, group_size(k_cache.shape[4]),
               nbytes >= WRITE_STREAM_MIN_BYTES)

    def _gather_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, page_table,
                          seq_lens, k_out, v_out, layout, out_layout):
        (k_bits, kind), (v_bits, _) = _bits_and_kind(k_out), _bits_and_kind(v_out)
        nbytes = 2 * k_out.nbytes
        kernel = _q.gather_q_parallel if _parallel(nbytes) else _q.gather_q_serial
        kernel(k_cache, v_cache, k_scale, v_scale, layer, page_table, seq_lens, k_bits, v_bits,
               kind, layout is StoreLayout.HND, out_layout is OutputLayout.BHTD,
               group_size(k_cache.shape[4]), nbytes >= STREAM_MIN_BYTES)

    def warmup_quantized(self, layout: StoreLayout, out_layout: OutputLayout) -> None:
        """Run the int8 store's kernels once on tiny arrays: serial and
        parallel, every K/V dtype in and out, contiguous and strided input."""
        from ..layout import SUPPORTED_DTYPES

        num_pages, page_size, num_heads, head_dim = 4, 2, 2, 32
        shape = layout.shape(1, num_pages, page_size, num_heads, head_dim)
        codes = np.zeros(shape, np.int8)
        scales = np.zeros((*shape[:4], 1), np.float32)
        slots = np.arange(3, dtype=np.int32)
        page_table = np.array([[0, 1]], dtype=np.int32)
        seq_lens = np.array([3], dtype=np.int32)
        out_shape = out_layout.shape(1, 4, num_heads, head_dim)
        hnd, bhtd = layout is StoreLayout.HND, out_layout is OutputLayout.BHTD
        for dtype in SUPPORTED_DTYPES.values():
            contiguous = np.zeros((3, num_heads, head_dim), dtype)
            strided = np.zeros((num_heads, 3, head_dim), dtype).transpose(1, 0, 2)
            for x in (contiguous, strided):
                bits, kind = _bits_and_kind(x)
                for write in (_q.write_q_serial, _q.write_q_parallel):
                    write(codes, codes.copy(), scales, scales.copy(), 0, slots, bits, bits,
                          kind, hnd, head_dim, True)
            out, kind = _bits_and_kind(np.zeros(out_shape, dtype))
            for gather in (_q.gather_q_serial, _q.gather_q_parallel):
                gather(codes, codes, scales, scales, 0, page_table, seq_lens, out, out.copy(),
                       kind, hnd, bhtd, head_dim, False)

    def warmup(self, dtype: np.dtype, layout: StoreLayout, out_layout: OutputLayout) -> None:
        """Run every kernel once on tiny arrays of ``dtype``, compiling each
        variant a process can meet: serial and parallel, contiguous and strided
        ``k``/``v``."""
        dtype = np.dtype(dtype)
        num_pages, page_size, num_heads, head_dim = 4, 2, 2, 8
        shape = layout.shape(1, num_pages, page_size, num_heads, head_dim)
        k_cache, v_cache = (_typed(np.zeros(shape, dtype)) for _ in range(2))
        slots = np.arange(3, dtype=np.int32)
        heads_first = np.zeros((num_heads, 3, head_dim), dtype)
        inputs = (heads_first.transpose(1, 0, 2),  # a [B, H, T, D] model output, per token
                  np.zeros((3, num_heads, head_dim), dtype))
        page_table = np.array([[0, 1]], dtype=np.int32)
        seq_lens = np.array([3], dtype=np.int32)
        out_shape = out_layout.shape(1, 4, num_heads, head_dim)
        k_out, v_out = (_typed(np.zeros(out_shape, dtype)) for _ in range(2))
        src_pages, dst_pages = np.array([0], np.int32), np.array([2], np.int32)
        flags = _flags(0, layout, out_layout)
        for write in (_k.write_serial, _k.write_parallel):
            for x in inputs:
                write(k_cache, v_cache, 0, slots, _typed(x), _typed(x), flags)
        for gather in (_k.gather_serial, _k.gather_parallel):
            gather(k_cache, v_cache, 0, page_table, seq_lens, k_out, v_out, flags)
        for copy in (_k.copy_pages_serial, _k.copy_pages_parallel):
            copy(k_cache, v_cache, src_pages, dst_pages, flags)
