"""Large host buffers whose memory is committed only where they are written.

NumPy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
on every allocation of 4 MiB or more, so a buffer written only in part
(the page pool, laid out layer by layer, or a decode buffer sized for the
longest sequence) holds a 2 MiB page for each region touched. Measured with
SmolLM2-135M on this machine (``madvise`` THP mode): a 4,500-token prompt
and 16 tokens after it peaked at 967 MiB resident, 807 MiB with NumPy's
huge pages off (``NUMPY_MADVISE_HUGEPAGE=0``), at the same prefill time.

:func:`lazy_zeros` allocates from an anonymous mapping instead: zero-filled
by the kernel, page aligned (so on a cache line), committed 4 KiB at a time,
and marked ``MADV_NOHUGEPAGE`` where the platform has it. The mapping is
released when the array (and every view of it) is gone. Small buffers,
where a huge page cannot be wasted, come from NumPy as before.

:func:`release` hands such a buffer's memory back before then: once its
contents have been copied elsewhere (a prompt's K/V into the page pool,
layer after layer), it stops counting against the process while views of
it still exist, and reads zero from then on.

:func:`trim_heap` hands the C heap's free memory back to the kernel: loading
a model frees much of what it read (the ONNX graph's weights, copied into
the engine's own layouts) in the middle of the heap, where ``free`` keeps
it (SmolLM2-135M: 44 MiB of 345 resident after
:class:`~pagedkv_np.onnxruntime.OrtDecoder` was built).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Any

import numpy as np

__all__ = ["LAZY_MIN_BYTES", "lazy_zeros", "release", "trim_heap"]

#: Buffers at least this large come from :func:`lazy_zeros`' mapping
#: (NumPy's own huge-page threshold is 4 MiB).
LAZY_MIN_BYTES = 1 << 20


def lazy_zeros(shape: Any, dtype: Any) -> np.ndarray:
    """A zero-filled, C-contiguous, writeable array of ``shape`` and ``dtype``
    whose memory is committed as it is written (see the module docstring).

    Raises
    ------
    MemoryError
        The mapping cannot be made (as ``np.zeros`` raises it).
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in np.atleast_1d(np.asarray(shape, dtype=np.int64)))
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < LAZY_MIN_BYTES:
        return np.zeros(shape, dtype)
    try:
        region = mmap.mmap(-1, nbytes)
    except (OSError, OverflowError) as exc:     # as np.zeros reports it
        raise MemoryError(f"cannot map {nbytes:,} bytes for an array of shape {shape}: "
                          f"{exc}") from exc
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        region.madvise(advice)
    return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)


def _mapping(arr: np.ndarray) -> mmap.mmap | None:
    """The mapping :func:`lazy_zeros` made ``arr`` (or the array it views) from."""
    base: Any = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def release(arr: np.ndarray) -> bool:
    """Give back the memory of a :func:`lazy_zeros` buffer (``arr`` or any
    view of it: the whole mapping goes); it then reads zero, and memory is
    committed again where it is written.

    Returns whether memory was handed back: False for a buffer that NumPy
    allocated (a small one), which is freed with its last reference, or
    where the platform cannot (no ``MADV_REMOVE``).
    """
    region = _mapping(arr)
    advice = getattr(mmap, "MADV_REMOVE", None)
    if region is None or advice is None or region.closed:
        return False
    region.madvise(advice)      # a shared mapping: its pages leave the shmem object too
    return True


def trim_heap() -> bool:
    """Return the C heap's free pages to the kernel (glibc's ``malloc_trim``);
    False where the C library has no such call (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
