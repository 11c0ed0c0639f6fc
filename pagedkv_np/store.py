"""The preallocated K/V store.

Two arrays, K and V, each of shape
``[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
``[num_layers, num_pages, num_kv_heads, page_size, head_dim]`` (HND), allocated
once, zero-filled, and never reallocated: page ids stay valid for the life of
the store. The store owns the arrays; moving data in and out is the backend's
job.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .backends.base import Backend
from .errors import AllocationError, ConfigError, DTypeError
from .layout import StoreLayout, resolve_dtype
from .checks import check_positive_int, shown
from .quant import resolve_quant

__all__ = ["KVStore"]


def _dims(shape: tuple) -> str:
    return "[" + ", ".join(shown(n) for n in shape) + "]"


class KVStore:
    """K and V arrays for every layer and page.

    Parameters
    ----------
    num_layers, page_size, num_kv_heads, head_dim : int
        Sizes, each >= 1.
    num_pages : int, optional
        Pages per layer. Give this or ``memory_bytes``.
    memory_bytes : int, optional
        Budget for K and V together; ``num_pages`` is the largest count that
        fits (at least 1, else :class:`ConfigError`).
    dtype : {"float32", "float16", "bfloat16", "int8"}
        ``"int8"`` keeps int8 codes in ``k``/``v`` and their float32 scales
        in ``k_scale``/``v_scale`` (see :mod:`pagedkv_np.quant`).
    layout : {"NHD", "HND"}
    backend : Backend
        Allocates the arrays (host or device memory).
    """

    def __init__(
        self,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_pages: int | None = None,
        memory_bytes: int | None = None,
        dtype: Any = "float32",
        layout: str | StoreLayout = "NHD",
        backend: Any,
    ) -> None:
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.page_size = check_positive_int(page_size, "page_size")
        self.num_kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.quant = resolve_quant(dtype)  # the int8 format, None for a float store
        self.dtype = self.quant.code_dtype if self.quant is not None else resolve_dtype(dtype)
        self.layout = StoreLayout.parse(layout)
        if (num_pages is None) == (memory_bytes is None):
            raise ConfigError("give exactly one of num_pages and memory_bytes")
        if num_pages is None:
            budget = check_positive_int(memory_bytes, "memory_bytes")
            num_pages = budget // self.bytes_per_page(
                self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype)
            if num_pages < 1:
                raise ConfigError(
                    f"Invalid memory_bytes: {budget} bytes hold no page; one page of K and V "
                    f"over all layers needs {self.bytes_per_page(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype)}")  # noqa: E501
        self.num_pages = check_positive_int(num_pages, "num_pages")
        if self.num_pages > np.iinfo(np.int32).max // self.page_size:
            raise ConfigError(
                "Invalid num_pages: num_pages * page_size must fit in int32 slot ids")
        if not isinstance(backend, Backend):
            raise DTypeError(f"Invalid backend: expected a Backend (see get_backend), "
                             f"got {type(backend).__name__}")
        self.shape = self.layout.shape(self.num_layers, self.num_pages, self.page_size,
                                       self.num_kv_heads, self.head_dim)
        nbytes = 2 * self.dtype.itemsize * int(np.prod(self.shape, dtype=object))
        if nbytes > sys.maxsize:
            raise ConfigError(f"Invalid num_pages: a store of shape {_dims(self.shape)} needs "
                              f"{shown(nbytes)} bytes for K and V, more than an array can hold")
        try:
            self.k = backend.zeros(self.shape, self.dtype)
            self.v = backend.zeros(self.shape, self.dtype)
        except MemoryError as exc:
            self.k = self.v = None   # the first one, if made, goes now
            raise AllocationError(
                f"Invalid num_pages: a store of shape {_dims(self.shape)} ({nbytes} bytes for "
                f"K and V) could not be allocated ({exc})") from None
        self.k_scale: Any = None
        self.v_scale: Any = None
        if self.quant is not None:  # the page geometry of k and v, a scale per group
            scale_shape = self.layout.shape(self.num_layers, self.num_pages, self.page_size,
                                            self.num_kv_heads,
                                            self.quant.num_groups(self.head_dim))
            self.k_scale = backend.zeros(scale_shape, self.quant.scale_dtype)
            self.v_scale = backend.zeros(scale_shape, self.quant.scale_dtype)
        self.backend = backend

    def copy_pages(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
        """Copy whole pages, every layer, K and V (and their scales), through
        the backend; ``src_pages``/``dst_pages`` are int32 [n], checked by
        the caller."""
        # the arrays were checked when they were made, the pages by the caller
        self.backend.copy_pages(self.k, self.v, src_pages, dst_pages, layout=self.layout,
                                check_indices=False, check_store=False)
        if self.quant is not None:
            self.backend.copy_pages(self.k_scale, self.v_scale, src_pages, dst_pages,
                                    layout=self.layout, check_indices=False, check_store=False)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int,
                       head_dim: int, dtype: Any) -> int:
        """Bytes of K plus V (and their scales) for one page id across all layers."""
        fmt = resolve_quant(dtype)
        if fmt is None:
            row = head_dim * resolve_dtype(dtype).itemsize
        else:
            row = (head_dim * fmt.code_dtype.itemsize
                   + fmt.num_groups(head_dim) * fmt.scale_dtype.itemsize)
        return 2 * num_layers * page_size * num_kv_heads * row

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V together (with their scales)."""
        scales = 0 if self.quant is None else self.k_scale.nbytes + self.v_scale.nbytes
        return int(self.k.nbytes + self.v.nbytes + scales)

    def __repr__(self) -> str:
        return (f"KVStore(shape={list(self.shape)}, dtype={self.dtype}, "
                f"layout={self.layout.value}, nbytes={self.nbytes})")
