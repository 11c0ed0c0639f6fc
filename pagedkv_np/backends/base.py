"""The interface every array backend implements, with its input checks.

A backend is a set of stateless operations over the K/V store arrays and
int32 index arrays. :class:`Backend` holds the public, validating methods;
a concrete backend implements only the private ``_write``, ``_gather`` and
``_copy_pages``, which may assume that every index is in range and that every
array has the documented shape and dtype. No kernel is ever reached through
this class with an index that could address memory outside its array.

Index arrays (``slot_mapping``, ``page_table``, ``seq_lens``, page lists) are
host NumPy int32 arrays for every backend: they are checked on the host and a
device backend uploads them itself.

Every caller, the cache included, goes through the public methods, so a
backend that overrides one (CuPy's, to pick the device and take host or DLPack
inputs) sees every call. Three keywords let a caller that has done part of the
work say so:

* ``check_indices=False`` skips the O(n) range checks on index arrays (shapes
  and dtypes are still checked);
* ``check_store=False`` skips the checks of the store arrays themselves;
* ``prepared=`` passes :meth:`Backend.prepare`'s form of a plan's index
  arrays, which a device backend uploads once per plan instead of once a call.

The cache sets all three for the stores it made and the plans it built and
checked itself, once per step; everyone else should leave the checks on.

Float stores and int8 stores have methods of their own (``write`` /
``write_quantized``, ``gather`` / ``gather_quantized``) on purpose: an int8
store is four arrays, not two (codes and per-group scales), its gather takes
an output dtype that a float gather must refuse, and each pair validates a
different dtype contract. One method with optional scales would make every
float call carry and check two ``None`` arguments and every kernel branch on
them, and would let a float store be written with scales by mistake.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DTypeError, ShapeError
from ..layout import SUPPORTED_DTYPES, OutputLayout, StoreLayout, check_array, resolve_dtype
from ..checks import check_index
from .array_checks import (SCALE_DTYPE, STORE_DTYPES, check_kv_store, check_quant_store,
                           gather_outputs)
from ..memory import LAZY_MIN_BYTES, lazy_zeros
from .checks import (CACHE_LINE, aligned_array, check_page_pairs, check_page_table,
                     check_slot_mapping)
from .prepared import PreparedIndices

__all__ = ["Backend", "PreparedIndices", "INDEX_DTYPE", "CACHE_LINE", "aligned_array",
           "check_slot_mapping", "check_page_table", "check_page_pairs"]

INDEX_DTYPE = np.dtype(np.int32)


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


class Backend:
    """Base class of the array backends.

    Subclasses set :attr:`name`, :attr:`array_types` (the accepted array
    classes for K/V data) and implement ``_write``, ``_gather``,
    ``_copy_pages`` and the array helpers ``zeros``/``to_numpy``/``asarray``.
    """

    name: str = "abstract"
    array_types: tuple[type, ...] = (np.ndarray,)

    # ----------------------------------------------------------- array helpers
    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A zero-filled array of this backend, starting on a cache line; a
        large one's memory is committed as it is written (:mod:`pagedkv_np.memory`)."""
        if _nbytes(shape, dtype) >= LAZY_MIN_BYTES:
            return lazy_zeros(shape, dtype)     # page aligned
        return aligned_array(np.zeros, shape, dtype)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An uninitialised array of this backend (``_gather`` writes every
        element of its outputs, data or zero, so it needs no zero fill),
        starting on a cache line."""
        if _nbytes(shape, dtype) >= LAZY_MIN_BYTES:
            return lazy_zeros(shape, dtype)
        return aligned_array(np.empty, shape, dtype)

    def asarray(self, x: Any) -> Any:
        """``x`` as an array of this backend (no copy when already one)."""
        return np.asarray(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        """``x`` as a host NumPy array."""
        return np.asarray(x)

    @staticmethod
    def may_share_memory(a: Any, b: Any) -> bool:
        """Whether two arrays' memory ranges overlap (a cheap bounds test)."""
        return np.may_share_memory(a, b)

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_index(x: Any, name: str, ndim: int) -> None:
        check_array(x, name, ndim=ndim, dtype=INDEX_DTYPE)

    def check_sources(self, sources: tuple[Any, Any], stores: tuple[Any, ...]) -> None:
        """Refuse K/V data that shares memory with a store array: a kernel
        that writes rows in its own order would read rows it had already
        overwritten (a cheap bounds test, which may also refuse views that
        interleave without touching)."""
        share = self.may_share_memory
        k, v = sources
        if len(stores) == 2:   # a float store: the per-layer case, without loops
            a, b = stores
            if not (share(k, a) or share(k, b) or share(v, a) or share(v, b)):
                return
        for name, x in (("k", k), ("v", v)):
            for store in stores:
                if share(x, store):
                    raise ShapeError(f"Invalid {name}: it shares memory with the store; "
                                     f"pass a copy")

    # ------------------------------------------------------------- public ops
    def prepare(self, plan: Any) -> PreparedIndices:
        """The index arrays of ``plan`` as this backend's kernels take them.

        Pass the result as ``prepared=`` to every write and gather through
        that plan, beside the plan's own arrays. The CPU backends use the host
        arrays as they are; a device backend keeps one upload of each per plan.

        Parameters
        ----------
        plan : Plan
            Or any object with ``slot_mapping``, ``page_table`` and
            ``seq_lens`` host int32 arrays that will not change.
        """
        return PreparedIndices(plan)

    @staticmethod
    def _kernel_indices(prepared: PreparedIndices | None, host: np.ndarray) -> Any:
        """``host`` as the kernels take it: through ``prepared`` when given."""
        if prepared is None:
            return host
        if not isinstance(prepared, PreparedIndices):
            raise DTypeError(f"Invalid prepared: expected the result of prepare(plan), "
                             f"got {type(prepared).__name__}")
        return prepared.get(host)

    def write(
        self,
        k_cache: Any,
        v_cache: Any,
        layer: int,
        slot_mapping: np.ndarray,
        k: Any,
        v: Any,
        *,
        layout: str | StoreLayout = StoreLayout.NHD,
        check_indices: bool = True,
        check_store: bool = True,
        prepared: PreparedIndices | None = None,
    ) -> None:
        """Write the K/V of ``N`` tokens into their slots of one layer.

        Parameters
        ----------
        k_cache, v_cache : array, shape [num_layers, num_pages, *page, head_dim]
            The store, written in place; a page is ``[page_size, num_kv_heads]``
            rows (NHD) or ``[num_kv_heads, page_size]`` (HND).
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        slot_mapping : ndarray, shape [N], dtype int32
            ``page_id * page_size + offset`` for each token; ``-1`` skips it.
        k, v : array, shape [N, num_kv_heads, head_dim], dtype of the store
            Any strides.
        layout : {"NHD", "HND"}
            Layout of the store.
        check_indices, check_store : bool
            Set to False only by a caller that checked the index arrays, or
            owns a store it checked, already (the cache does, once per plan
            and once per store).
        prepared : PreparedIndices, optional
            :meth:`prepare` of the plan ``slot_mapping`` belongs to.
        """
        if type(layout) is not StoreLayout:
            layout = StoreLayout.parse(layout)
        if check_store:
            dims = check_kv_store(self, k_cache, v_cache, layout)
        else:
            dims = layout.dims(k_cache.shape)
        num_layers, num_pages, page_size, num_kv_heads, head_dim = dims
        if type(layer) is not int or not 0 <= layer < num_layers:
            layer = check_index(layer, "layer", num_layers)
        if check_indices or prepared is None:
            self._check_index(slot_mapping, "slot_mapping", 1)
        # prepare() checked its arrays; get() refuses any other
        slots = slot_mapping if prepared is None else self._kernel_indices(prepared, slot_mapping)
        n = slot_mapping.shape[0]
        for name, x in (("k", k), ("v", v)):
            check_array(x, name, shape=(n, num_kv_heads, head_dim), dtype=k_cache.dtype,
                        array_type=self.array_types)
        self.check_sources((k, v), (k_cache, v_cache))
        if check_indices:
            check_slot_mapping(slot_mapping, num_pages * page_size)
        if n:
            self._write(k_cache, v_cache, layer, slots, k, v, layout)

    def gather(
        self,
        k_cache: Any,
        v_cache: Any,
        layer: int,
        page_table: np.ndarray,
        seq_lens: np.ndarray,
        *,
        layout: str | StoreLayout = StoreLayout.NHD,
        out_layout: str | OutputLayout = OutputLayout.BTHD,
        out: tuple[Any, Any] | None = None,
        num_positions: int | None = None,
        check_indices: bool = True,
        check_store: bool = True,
        prepared: PreparedIndices | None = None,
    ) -> tuple[Any, Any]:
        """Gather each sequence's K/V of one layer into contiguous arrays.

        Parameters
        ----------
        page_table : ndarray, shape [B, max_pages], dtype int32
            Page ids of each sequence in order; entries past a sequence's
            last page may be -1.
        seq_lens : ndarray, shape [B], dtype int32
            Tokens of each sequence, ``0 <= seq_lens[b] <= max_pages * page_size``.
        out_layout : {"BTHD", "BHTD"}
            ``[B, T, num_kv_heads, head_dim]`` or ``[B, num_kv_heads, T, head_dim]``.
        out : pair of arrays, optional
            C-contiguous, writeable K and V buffers in ``out_layout`` with
            ``T >= max(seq_lens)``; allocated when omitted.
        num_positions : int, optional
            ``T`` of freshly allocated buffers (default ``max(seq_lens)``).
        check_indices, check_store, prepared
            As in :meth:`write` (``prepared`` of the plan ``page_table`` and
            ``seq_lens`` belong to).

        Returns
        -------
        k, v : arrays in ``out_layout``
            Positions ``t >= seq_lens[b]`` are zero.
        """
        layout = StoreLayout.parse(layout)
        out_layout = OutputLayout.parse(out_layout, "out_layout")
        if check_store:
            dims = check_kv_store(self, k_cache, v_cache, layout)
        else:
            dims = layout.dims(k_cache.shape)
        num_layers, num_pages, page_size, num_kv_heads, head_dim = dims
        layer = check_index(layer, "layer", num_layers)
        self._check_gather_indices(page_table, seq_lens, num_pages, page_size, check_indices)
        num_seqs = page_table.shape[0]
        k_out, v_out = gather_outputs(self, out, out_layout, seq_lens, num_kv_heads, head_dim,
                                      k_cache.dtype, num_positions, (k_cache, v_cache))
        if num_seqs:
            self._gather(k_cache, v_cache, layer, self._kernel_indices(prepared, page_table),
                         self._kernel_indices(prepared, seq_lens), k_out, v_out,
                         layout, out_layout)
        return k_out, v_out

    def _check_gather_indices(self, page_table: Any, seq_lens: Any, num_pages: int,
                              page_size: int, check_indices: bool) -> None:
        self._check_index(page_table, "page_table", 2)
        check_array(seq_lens, "seq_lens", shape=(page_table.shape[0],), dtype=INDEX_DTYPE)
        if check_indices:
            check_page_table(page_table, seq_lens, num_pages, page_size)

    def copy_pages(
        self,
        k_cache: Any,
        v_cache: Any,
        src_pages: np.ndarray,
        dst_pages: np.ndarray,
        *,
        layout: str | StoreLayout = StoreLayout.NHD,
        check_indices: bool = True,
        check_store: bool = True,
    ) -> None:
        """Copy whole pages, every layer, K and V: ``dst_pages[i] <- src_pages[i]``.

        Parameters
        ----------
        src_pages, dst_pages : ndarray, shape [n], dtype int32
            Distinct destinations, none of which is also a source.
        check_indices, check_store : bool
            As in :meth:`write`.
        """
        layout = StoreLayout.parse(layout)
        if check_store:
            check_kv_store(self, k_cache, v_cache, layout, codes=True)
        num_pages = k_cache.shape[1]
        self._check_index(src_pages, "src_pages", 1)
        check_array(dst_pages, "dst_pages", shape=src_pages.shape, dtype=INDEX_DTYPE)
        if check_indices:
            check_page_pairs(src_pages, dst_pages, num_pages)
        if src_pages.size:
            self._copy_pages(k_cache, v_cache, src_pages, dst_pages, layout)

    # --------------------------------------------------------- int8 stores
    def write_quantized(
        self,
        k_cache: Any,
        v_cache: Any,
        k_scale: Any,
        v_scale: Any,
        layer: int,
        slot_mapping: np.ndarray,
        k: Any,
        v: Any,
        *,
        layout: str | StoreLayout = StoreLayout.NHD,
        check_indices: bool = True,
        check_store: bool = True,
        prepared: PreparedIndices | None = None,
    ) -> None:
        """Quantize the K/V of ``N`` tokens into their slots of an int8 store.

        Parameters
        ----------
        k_cache, v_cache : array, shape as in :meth:`write`, dtype int8
            The codes, written in place.
        k_scale, v_scale : array, dtype float32
            The scales: the shape of the codes with ``head_dim`` replaced by
            ``head_dim // group_size(head_dim)`` (see :mod:`pagedkv_np.quant`).
        slot_mapping : ndarray, shape [N], dtype int32
            As in :meth:`write`.
        k, v : array, shape [N, num_kv_heads, head_dim], float32, float16 or bfloat16
            The same dtype for both; any strides.
        check_indices, check_store, prepared
            As in :meth:`write`.
        """
        layout = StoreLayout.parse(layout)
        if check_store:
            dims = check_quant_store(self, k_cache, v_cache, k_scale, v_scale, layout)
        else:
            dims = layout.dims(k_cache.shape)
        num_layers, num_pages, page_size, num_kv_heads, head_dim = dims
        if type(layer) is not int or not 0 <= layer < num_layers:
            layer = check_index(layer, "layer", num_layers)
        self._check_index(slot_mapping, "slot_mapping", 1)
        n = slot_mapping.shape[0]
        check_array(k, "k", shape=(n, num_kv_heads, head_dim), array_type=self.array_types)
        if k.dtype not in STORE_DTYPES:
            raise DTypeError(f"Invalid dtype of k: expected one of {sorted(SUPPORTED_DTYPES)}, "
                             f"got {k.dtype}")
        check_array(v, "v", shape=k.shape, dtype=k.dtype, array_type=self.array_types)
        self.check_sources((k, v), (k_cache, v_cache, k_scale, v_scale))
        if check_indices:
            check_slot_mapping(slot_mapping, num_pages * page_size)
        slots = self._kernel_indices(prepared, slot_mapping)
        if n:
            self._write_quantized(k_cache, v_cache, k_scale, v_scale, layer, slots, k, v,
                                  layout)

    def gather_quantized(
        self,
        k_cache: Any,
        v_cache: Any,
        k_scale: Any,
        v_scale: Any,
        layer: int,
        page_table: np.ndarray,
        seq_lens: np.ndarray,
        *,
        layout: str | StoreLayout = StoreLayout.NHD,
        out_layout: str | OutputLayout = OutputLayout.BTHD,
        out: tuple[Any, Any] | None = None,
        num_positions: int | None = None,
        dtype: Any = None,
        check_indices: bool = True,
        check_store: bool = True,
        prepared: PreparedIndices | None = None,
    ) -> tuple[Any, Any]:
        """Dequantize each sequence's K/V of one layer of an int8 store into
        contiguous arrays; the arguments are those of :meth:`gather` and
        :meth:`write_quantized`.

        Parameters
        ----------
        dtype : {"float32", "float16", "bfloat16"}, optional
            dtype of the output: that of ``out`` when given (``dtype``, if
            also given, must match), else float32.
        check_indices, check_store, prepared
            As in :meth:`gather`.

        Returns
        -------
        k, v : arrays in ``out_layout``
            Positions ``t >= seq_lens[b]`` are zero.
        """
        layout = StoreLayout.parse(layout)
        out_layout = OutputLayout.parse(out_layout, "out_layout")
        if check_store:
            dims = check_quant_store(self, k_cache, v_cache, k_scale, v_scale, layout)
        else:
            dims = layout.dims(k_cache.shape)
        num_layers, num_pages, page_size, num_kv_heads, head_dim = dims
        layer = check_index(layer, "layer", num_layers)
        self._check_gather_indices(page_table, seq_lens, num_pages, page_size, check_indices)
        num_seqs = page_table.shape[0]
        if dtype is not None:
            dtype = resolve_dtype(dtype)
        elif out is None:
            dtype = SCALE_DTYPE
        k_out, v_out = gather_outputs(self, out, out_layout, seq_lens, num_kv_heads, head_dim,
                                      dtype, num_positions, (k_cache, v_cache, k_scale, v_scale))
        if num_seqs:
            self._gather_quantized(k_cache, v_cache, k_scale, v_scale, layer,
                                   self._kernel_indices(prepared, page_table),
                                   self._kernel_indices(prepared, seq_lens), k_out, v_out,
                                   layout, out_layout)
        return k_out, v_out

    # ------------------------------------------------ implemented by backends
    def _write(self, k_cache, v_cache, layer, slot_mapping, k, v, layout):  # pragma: no cover
        """Write every token whose slot is not -1. Index arrays arrive in the
        kernels' form (:meth:`prepare`'s, or the host arrays) here and below."""
        raise NotImplementedError

    def _gather(self, k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out,
                layout, out_layout):  # pragma: no cover
        """Fill every element of ``k_out``/``v_out``: data below each
        sequence's length, zero at and past it."""
        raise NotImplementedError

    def _copy_pages(self, k_cache, v_cache, src_pages, dst_pages, layout):  # pragma: no cover
        raise NotImplementedError

    def _write_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, slot_mapping, k, v,
                         layout):  # pragma: no cover
        """Quantize every token whose slot is not -1 (see :mod:`pagedkv_np.quant`)."""
        raise NotImplementedError

    def _gather_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, page_table,
                          seq_lens, k_out, v_out, layout, out_layout):  # pragma: no cover
        """Fill every element of ``k_out``/``v_out`` (of their own dtype):
        dequantized data below each sequence's length, zero at and past it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pagedkv_np backend {self.name!r}>"
