"""Compiling the Numba kernels ahead of use (:func:`warmup`).

Its own module, apart from :mod:`pagedkv_np.backends.jit` (the kernels' compile
policy, which the kernel modules import): it drives the Numba backend, so
keeping it in ``_jit`` would make ``_jit`` and the backend import each other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from .numba_cpu import NumbaBackend

__all__ = ["warmup"]

logger = logging.getLogger(__name__)


def warmup(
    dtypes: Iterable[Any] = ("float32", "float16", "bfloat16"),
    layouts: Iterable[str] = ("NHD", "HND"),
    out_layouts: Iterable[str] = ("BTHD", "BHTD"),
) -> float:
    """Compile the Numba kernels ahead of use by running them on tiny arrays.

    Covers the serial and the parallel variant of write (contiguous and
    strided ``k``/``v``), gather and copy_pages. Compiled code goes to the disk
    cache, so a later process that calls this starts in well under a second.

    Parameters
    ----------
    dtypes : iterable of {"float32", "float16", "bfloat16", "int8"}
        Store dtypes to compile for; float16 and bfloat16 share one kernel.
        ``"int8"`` compiles the int8 store's kernels, for every K/V dtype.
    layouts : iterable of {"NHD", "HND"}
    out_layouts : iterable of {"BTHD", "BHTD"}

    Returns
    -------
    float
        Seconds spent.

    Raises
    ------
    BackendUnavailable
        Numba cannot be imported.
    DTypeError, LayoutError
        An unknown dtype or layout.
    """
    from . import get_backend
    from ..layout import OutputLayout, StoreLayout, resolve_dtype
    from ..quant import resolve_quant

    start = time.perf_counter()
    # the registry types it as a Backend; "numba" is the NumbaBackend
    backend = cast("NumbaBackend", get_backend("numba"))
    dtypes = list(dtypes)
    quantized = [d for d in dtypes if resolve_quant(d) is not None]
    dtypes = [resolve_dtype(d) for d in dtypes if resolve_quant(d) is None]
    store_layouts = [StoreLayout.parse(x) for x in layouts]
    output_layouts = [OutputLayout.parse(x, "out_layouts") for x in out_layouts]
    from ..log import long_wait
    from .jit import cache_dir

    where = cache_dir()
    # measured with nothing cached, every dtype and layout: 42 s on 2 idle cores,
    # 185 s on 2 cores shared with other work; 0.3 s from the disk cache
    reuse = (f"under a second once they are cached in {where}" if where
             else "again in every process: no writable cache")
    with long_wait(logger, "compiling the Numba kernels",
                   f"about 40 s on 2 idle cores when nothing is cached, minutes on a busy "
                   f"machine; {reuse}"):
        for layout in store_layouts:
            for out_layout in output_layouts:
                for dtype in dtypes:
                    backend.warmup(dtype, layout, out_layout)
                if quantized:
                    backend.warmup_quantized(layout, out_layout)
    return time.perf_counter() - start
