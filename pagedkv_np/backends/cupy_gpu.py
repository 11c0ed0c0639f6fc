"""The GPU backend: the store lives in device memory, CUDA kernels move the data.

Each operation is one kernel launch on CuPy's current stream, with K and V
moved together. The kernels (``kernels/*.cu``, see
:mod:`pagedkv_np.backends._cuda_sources`) copy bits in words of 16, 8, 4 or 2
bytes; this module picks the widest word that divides a row (``head_dim``
elements) and every address and stride involved, so float32, float16 and
bfloat16 share the same code and results match the NumPy reference bit for
bit.

Index arrays arrive as host int32 arrays (checked by
:class:`~pagedkv_np.backends.base.Backend`) and are uploaded per call. K/V
inputs may be CuPy arrays, host NumPy arrays (uploaded), or any CUDA array
exposing ``__cuda_array_interface__`` or ``__dlpack__`` (a PyTorch CUDA
tensor, say), which is used in place without a copy.

Importing this module never fails: without CuPy, or without a GPU,
:meth:`CupyBackend.availability` says why and what to install.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np

from ..errors import BackendUnavailable, DTypeError, ShapeError
from ..layout import OutputLayout, StoreLayout, describe
from ..quant import group_size
from ._cuda_sources import get_kernel
from .base import Backend

try:
    import cupy
except Exception as exc:  # ImportError, or a broken CUDA install failing on import
    cupy = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

__all__ = ["CupyBackend", "LaunchPlan", "plan_write", "plan_gather", "plan_copy_pages",
           "plan_write_quantized", "plan_gather_quantized"]

_INSTALL_HINT = "install it with: pip install 'pagedkv-np[cuda]'"

# Threads per block, as PAGEDKV_BLOCK_THREADS in kernels/pagedkv_common.cuh
# (the kernels' __launch_bounds__).
_BLOCK_THREADS = 256
_MAX_BLOCK_Z = 64
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_INT32_MAX = 2**31 - 1
# DLPack device types of CUDA memory: kDLCUDA, kDLCUDAManaged.
_DLPACK_CUDA_DEVICES = (2, 13)
# Word sizes with an entry point in every kernel file, widest first.
_WORD_BYTES = (16, 8, 4, 2)


def _nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; raises when CuPy cannot load the library. CuPy wheels
    do not ship it: it comes from the CUDA toolkit or nvidia-cuda-nvrtc."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:  # another CuPy layout: let the first compile tell
        return (0, 0)
    return nvrtc.getVersion()


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def word_bytes(itemsize: int, row_bytes: int, addresses: tuple[int, ...] = (),
               strides: tuple[int, ...] = ()) -> int:
    """The widest word (16, 8, 4 or 2 bytes, never narrower than an element)
    that divides ``row_bytes`` and every address and byte stride."""
    for word in _WORD_BYTES:
        if word < itemsize:
            break
        if row_bytes % word == 0 and all(x % word == 0 for x in (*addresses, *strides)):
            return word
    return itemsize


def block_shape(row_words: int, num_heads: int) -> tuple[int, int, int]:
    """Threads per block as (x, y, z): x over the words of a row, y over heads,
    z over tokens or positions; powers of two, at most 256 in all.

    x stops at a warp, so a row wider than 32 words is walked in steps of 32
    and the rest of the block covers more heads and tokens; short rows and
    few heads leave room for many tokens per block (prefill) while a single
    token still spreads over heads and words (decode). z stops at 64, CUDA's
    limit for that axis; the smaller blocks that leaves (tiny rows, one head)
    still fill an SM, which holds 32 blocks.
    """
    x = min(32, _pow2_ceil(row_words))
    y = min(_pow2_ceil(num_heads), _BLOCK_THREADS // x)
    return x, y, min(_MAX_BLOCK_Z, _BLOCK_THREADS // (x * y))


def _i32(value: int, name: str) -> np.int32:
    if value > _INT32_MAX:
        raise ShapeError(f"Invalid {name}: {value} does not fit the kernels' int32 counts")
    return np.int32(value)


def _store_dims(store_shape: tuple[int, ...], layout: StoreLayout) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) of a store of ``store_shape``."""
    _, _, a, b, head_dim = store_shape
    page_size, num_heads = (a, b) if layout is StoreLayout.NHD else (b, a)
    return page_size, num_heads, head_dim


def _store_strides(page_size: int, num_heads: int, row_bytes: int,
                   layout: StoreLayout) -> tuple[int, int, int]:
    """Byte strides of (page, offset in page, head) within one layer of a
    C-contiguous store, from its shape (never from ``.strides``, which a
    contiguous array may hold arbitrary for axes of length 1)."""
    page = page_size * num_heads * row_bytes
    if layout is StoreLayout.NHD:
        return page, num_heads * row_bytes, row_bytes
    return page, row_bytes, page_size * row_bytes


def row_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """Byte strides of the token and head axes of K/V input [N, H, D]; an
    axis of length 1 gets 0, as its index is always 0."""
    return (0 if shape[0] == 1 else int(strides[0]), 0 if shape[1] == 1 else int(strides[1]))


class LaunchPlan(NamedTuple):
    """One kernel launch, worked out on the host without touching a device.

    ``scalars`` are the kernel's arguments after its pointer arguments, as
    NumPy scalars of the exact C widths (int32/int64).
    """

    file_name: str
    entry_point: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    scalars: tuple[Any, ...]


def plan_write(layout: StoreLayout, store_shape: tuple[int, ...], itemsize: int,
               num_tokens: int, addresses: tuple[int, int, int, int],
               k_strides: tuple[int, int], v_strides: tuple[int, int]) -> LaunchPlan | None:
    """Launch of ``paged_write``; ``None`` when there is nothing to move.

    Parameters
    ----------
    layout : StoreLayout
    store_shape : tuple of 5 ints
        Shape of the C-contiguous store.
    itemsize : int
        Bytes per element (2 or 4).
    num_tokens : int
        Length of ``slot_mapping``.
    addresses : tuple of 4 ints
        Device addresses of K's layer, V's layer, k and v.
    k_strides, v_strides : tuple of 2 ints
        Byte strides of the token and head axes of k and v (rows contiguous),
        as :func:`row_strides` gives them.

    The kernel's pointer arguments, in order: K layer, V layer, k, v,
    slot_mapping.
    """
    page_size, num_heads, head_dim = _store_dims(store_shape, layout)
    if num_tokens == 0 or num_heads * head_dim == 0:
        return None
    row_bytes = head_dim * itemsize
    in_strides = (*k_strides, *v_strides)
    word = word_bytes(itemsize, row_bytes, addresses, in_strides)
    row_words = row_bytes // word
    block = block_shape(row_words, num_heads)
    grid = (min(_ceil_div(num_tokens, block[2]), _MAX_GRID_X),
            min(_ceil_div(num_heads, block[1]), _MAX_GRID_YZ), 1)
    scalars = (_i32(num_tokens, "slot_mapping length"), np.int32(num_heads),
               np.int32(row_words), np.int32(page_size),
               *(np.int64(s // word) for s in _store_strides(page_size, num_heads, row_bytes,
                                                             layout)),
               *(np.int64(s // word) for s in in_strides))
    return LaunchPlan("paged_write.cu", f"paged_write_b{word}", grid, block, scalars)


def plan_gather(layout: StoreLayout, out_layout: OutputLayout, store_shape: tuple[int, ...],
                itemsize: int, num_seqs: int, max_pages: int, num_positions: int,
                addresses: tuple[int, int, int, int]) -> LaunchPlan | None:
    """Launch of ``paged_gather``; ``None`` when the output is empty.

    ``addresses`` are those of K's layer, V's layer and the two C-contiguous
    outputs ([num_seqs, num_positions, H, D] for BTHD, [num_seqs, H,
    num_positions, D] for BHTD). The kernel's pointer arguments, in order:
    K layer, V layer, k_out, v_out, page_table ([num_seqs, max_pages],
    C-contiguous), seq_lens.
    """
    page_size, num_heads, head_dim = _store_dims(store_shape, layout)
    if num_seqs * num_positions * num_heads * head_dim == 0:
        return None
    row_bytes = head_dim * itemsize
    if out_layout is OutputLayout.BTHD:
        out_strides = (num_positions * num_heads * row_bytes, num_heads * row_bytes, row_bytes)
    else:
        out_strides = (num_heads * num_positions * row_bytes, row_bytes,
                       num_positions * row_bytes)
    word = word_bytes(itemsize, row_bytes, addresses)
    row_words = row_bytes // word
    block = block_shape(row_words, num_heads)
    grid = (min(_ceil_div(num_positions, block[2]), _MAX_GRID_X),
            min(num_seqs, _MAX_GRID_YZ),
            min(_ceil_div(num_heads, block[1]), _MAX_GRID_YZ))
    scalars = (_i32(num_seqs, "page_table rows"), _i32(max_pages, "page_table columns"),
               _i32(num_positions, "out positions"), np.int32(num_heads),
               np.int32(row_words), np.int32(page_size),
               *(np.int64(s // word) for s in _store_strides(page_size, num_heads, row_bytes,
                                                             layout)),
               *(np.int64(s // word) for s in out_strides))
    return LaunchPlan("paged_gather.cu", f"paged_gather_b{word}", grid, block, scalars)


def plan_copy_pages(store_shape: tuple[int, ...], itemsize: int, num_pairs: int,
                    addresses: tuple[int, int]) -> LaunchPlan | None:
    """Launch of ``copy_pages``; ``None`` when there is nothing to copy.

    ``addresses`` are those of the whole K and V stores. The kernel's pointer
    arguments, in order: K store, V store, src_pages, dst_pages.
    """
    num_layers, num_pages = store_shape[:2]
    page_bytes = int(np.prod(store_shape[2:])) * itemsize
    if num_pairs == 0 or num_layers * page_bytes == 0:
        return None
    word = word_bytes(itemsize, page_bytes, addresses)
    page_words = page_bytes // word
    threads = min(_BLOCK_THREADS, 32 * _ceil_div(page_words, 32))
    grid = (min(_ceil_div(page_words, threads), _MAX_GRID_X),
            min(num_pairs, _MAX_GRID_YZ), min(num_layers, _MAX_GRID_YZ))
    scalars = (_i32(num_pairs, "src_pages length"), np.int32(num_layers),
               np.int64(num_pages * page_words), np.int64(page_words))
    return LaunchPlan("copy_pages.cu", f"copy_pages_b{word}", grid, (threads, 1, 1), scalars)


def _kind_suffix(dtype: Any) -> str:
    """Entry point suffix of paged_quant.cu for K/V of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 4:
        return "f32"
    return "f16" if dtype == np.dtype(np.float16) else "bf16"


def _store_rows(page_size: int, num_heads: int, layout: StoreLayout) -> tuple[int, int, int]:
    """Strides in store rows (one head's head_dim codes, or its scales) of a
    page, an offset in a page and a head, within one layer."""
    if layout is StoreLayout.NHD:
        return page_size * num_heads, num_heads, 1
    return page_size * num_heads, 1, page_size


def plan_write_quantized(layout: StoreLayout, store_shape: tuple[int, ...], dtype: Any,
                         num_tokens: int, group: int, k_strides: tuple[int, int],
                         v_strides: tuple[int, int]) -> LaunchPlan | None:
    """Launch of ``paged_write_q``; ``None`` when there is nothing to move.

    Parameters
    ----------
    store_shape : tuple of 5 ints
        Shape of the C-contiguous int8 code store.
    dtype : numpy dtype
        dtype of k and v (float32, float16 or bfloat16).
    group : int
        Values per scale (see :func:`pagedkv_np.quant.group_size`).
    k_strides, v_strides : tuple of 2 ints
        Byte strides of the token and head axes of k and v (rows contiguous).

    The kernel's pointer arguments, in order: K codes' layer, V codes' layer,
    K scales' layer, V scales' layer, k, v, slot_mapping.
    """
    page_size, num_heads, head_dim = _store_dims(store_shape, layout)
    num_groups = head_dim // group
    work = num_tokens * num_heads * num_groups
    if work == 0:
        return None
    itemsize = np.dtype(dtype).itemsize
    grid = (min(_ceil_div(work, _BLOCK_THREADS), _MAX_GRID_X), 1, 1)
    scalars = (_i32(num_tokens, "slot_mapping length"), np.int32(num_heads),
               np.int32(head_dim), np.int32(group), np.int32(page_size),
               *(np.int64(r) for r in _store_rows(page_size, num_heads, layout)),
               *(np.int64(s // itemsize) for s in (*k_strides, *v_strides)))
    return LaunchPlan("paged_quant.cu", f"paged_write_q_{_kind_suffix(dtype)}", grid,
                      (_BLOCK_THREADS, 1, 1), scalars)


def plan_gather_quantized(layout: StoreLayout, out_layout: OutputLayout,
                          store_shape: tuple[int, ...], dtype: Any, num_seqs: int,
                          max_pages: int, num_positions: int, group: int) -> LaunchPlan | None:
    """Launch of ``paged_gather_q`` into C-contiguous outputs of ``dtype``;
    ``None`` when the output is empty. The kernel's pointer arguments, in
    order: K codes' layer, V codes' layer, K scales' layer, V scales' layer,
    k_out, v_out, page_table ([num_seqs, max_pages], C-contiguous), seq_lens.
    """
    page_size, num_heads, head_dim = _store_dims(store_shape, layout)
    work = num_seqs * num_positions * num_heads * head_dim
    if work == 0:
        return None
    grid = (min(_ceil_div(work, _BLOCK_THREADS), _MAX_GRID_X), 1, 1)
    scalars = (_i32(num_seqs, "page_table rows"), _i32(max_pages, "page_table columns"),
               _i32(num_positions, "out positions"), np.int32(num_heads), np.int32(head_dim),
               np.int32(group), np.int32(page_size),
               np.int32(out_layout is OutputLayout.BHTD),
               *(np.int64(r) for r in _store_rows(page_size, num_heads, layout)))
    return LaunchPlan("paged_quant.cu", f"paged_gather_q_{_kind_suffix(dtype)}", grid,
                      (_BLOCK_THREADS, 1, 1), scalars)


class CupyBackend(Backend):
    """CUDA implementation of :class:`~pagedkv_np.backends.base.Backend`.

    Arrays of the store and of gathered output are ``cupy.ndarray`` on one
    device; every kernel runs on the device that holds the store, on CuPy's
    current stream, and returns without synchronising. Work on another
    library's stream (PyTorch's, say) must be ordered by the caller.
    """

    name = "cupy"
    array_types: tuple[type, ...] = (cupy.ndarray,) if cupy is not None else ()

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when CuPy imports and sees a CUDA GPU, else the reason."""
        if cupy is None:
            return f"CuPy is not installed or failed to import ({_IMPORT_ERROR}); {_INSTALL_HINT}"
        try:
            found = cupy.cuda.is_available()
        except Exception as exc:  # a driver that fails to answer counts as none
            return f"no CUDA GPU was found: {exc}"
        if not found:
            return ("no CUDA GPU was found (cupy.cuda.is_available() is False): check the "
                    "NVIDIA driver and CUDA_VISIBLE_DEVICES")
        try:
            _nvrtc_version()
        except Exception as exc:  # the kernels could not be compiled
            return (f"NVRTC, CUDA's run-time compiler, was not found ({exc}); install it with: "
                    "pip install nvidia-cuda-nvrtc (or 'cupy-cuda13x[ctk]')")
        return None

    def __init__(self) -> None:
        reason = self.availability()
        if reason is not None:
            raise BackendUnavailable(f"backend 'cupy' is unavailable: {reason}")

    @staticmethod
    def _may_share_memory(a: Any, b: Any) -> bool:
        return cupy.may_share_memory(a, b)

    # ----------------------------------------------------------- array helpers
    def zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A zero-filled ``cupy.ndarray`` on the current device."""
        return self._alloc(cupy.zeros, shape, dtype)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An uninitialised ``cupy.ndarray`` on the current device."""
        return self._alloc(cupy.empty, shape, dtype)

    @staticmethod
    def _alloc(make, shape, dtype) -> Any:
        try:
            return make(shape, dtype=dtype)
        except TypeError as exc:  # CuPy before 14 has no bfloat16
            raise DTypeError(
                f"Invalid dtype: CuPy {cupy.__version__} cannot hold {np.dtype(dtype)} "
                "arrays (bfloat16 needs CuPy >= 14)") from exc

    def asarray(self, x: Any) -> Any:
        """``x`` as a ``cupy.ndarray``: in place for device arrays, uploaded
        for host arrays."""
        if isinstance(x, cupy.ndarray):
            return x
        device = self._as_device_array(x, "x")
        return device if device is not None else cupy.asarray(np.asarray(x))

    def to_numpy(self, x: Any) -> np.ndarray:
        """``x`` as a host NumPy array (a device-to-host copy)."""
        if isinstance(x, cupy.ndarray):
            return x.get()
        device = self._as_device_array(x, "x")
        return device.get() if device is not None else np.asarray(x)

    @staticmethod
    def _as_device_array(x: Any, name: str) -> Any:
        """A ``cupy.ndarray`` viewing ``x`` in place when ``x`` is a CUDA
        array of another library, else ``None`` (host arrays included)."""
        if isinstance(x, (cupy.ndarray, np.ndarray)):
            return x if isinstance(x, cupy.ndarray) else None
        try:
            # A property that raises (PyTorch does for bfloat16) means "not
            # through this interface"; DLPack may still work.
            has_cai = hasattr(x, "__cuda_array_interface__")
        except Exception:
            has_cai = False
        if has_cai:
            try:
                return cupy.asarray(x)
            except (TypeError, ValueError):
                pass
        if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
            try:
                if x.__dlpack_device__()[0] not in _DLPACK_CUDA_DEVICES:
                    return None  # host memory: not a device array
                return cupy.from_dlpack(x)
            except Exception as exc:
                raise DTypeError(
                    f"Invalid {name}: expected a CUDA array, got {describe(x)} ({exc})") from exc
        return None

    def _input(self, x: Any, name: str) -> Any:
        """K/V data: a device array in place, or a host array uploaded."""
        device = self._as_device_array(x, name)
        if device is not None:
            return device
        if isinstance(x, np.ndarray):
            return cupy.asarray(x)
        return x  # not an array: the base class check names it

    def _output(self, x: Any, name: str) -> Any:
        """An ``out`` buffer: a device array in place; host arrays refused,
        since results written to an uploaded copy would never reach them."""
        if isinstance(x, np.ndarray) and not isinstance(x, cupy.ndarray):
            raise DTypeError(
                f"Invalid {name}: expected a device array (cupy.ndarray or a CUDA array), "
                "got a host numpy.ndarray")
        device = self._as_device_array(x, name)
        return device if device is not None else x

    @staticmethod
    def _on_store_device(k_cache: Any, others: dict[str, Any]) -> Any:
        """A context that makes the store's GPU current (kernels run and new
        arrays are made there), after checking that ``others`` live there too."""
        if not isinstance(k_cache, cupy.ndarray):
            return contextlib.nullcontext()  # the base class check rejects it
        device_id = k_cache.device.id
        for name, x in others.items():
            if isinstance(x, cupy.ndarray) and x.device.id != device_id:
                raise DTypeError(
                    f"Invalid {name}: on GPU {x.device.id}, the store is on GPU {device_id}")
        return k_cache.device

    # ------------------------------------------------------------- public ops
    def write(self, k_cache: Any, v_cache: Any, layer: int, slot_mapping: np.ndarray,
              k: Any, v: Any, *, layout: str | StoreLayout = StoreLayout.NHD,
              check_indices: bool = True, check_store: bool = True) -> None:
        """As :meth:`Backend.write`; ``k`` and ``v`` may also be host NumPy
        arrays (uploaded) or CUDA arrays of other libraries (used in place)."""
        k, v = self._input(k, "k"), self._input(v, "v")
        with self._on_store_device(k_cache, {"v_cache": v_cache, "k": k, "v": v}):
            super().write(k_cache, v_cache, layer, slot_mapping, k, v, layout=layout,
                          check_indices=check_indices, check_store=check_store)

    def gather(self, k_cache: Any, v_cache: Any, layer: int, page_table: np.ndarray,
               seq_lens: np.ndarray, *, layout: str | StoreLayout = StoreLayout.NHD,
               out_layout: str | OutputLayout = OutputLayout.BTHD,
               out: tuple[Any, Any] | None = None, num_positions: int | None = None,
               check_indices: bool = True) -> tuple[Any, Any]:
        """As :meth:`Backend.gather`; ``out`` may also hold CUDA arrays of
        other libraries, written in place (the returned pair views them)."""
        others = {"v_cache": v_cache}
        if isinstance(out, (tuple, list)) and len(out) == 2:
            out = (self._output(out[0], "out[0]"), self._output(out[1], "out[1]"))
            others.update({"out[0]": out[0], "out[1]": out[1]})
        with self._on_store_device(k_cache, others):
            return super().gather(k_cache, v_cache, layer, page_table, seq_lens, layout=layout,
                                  out_layout=out_layout, out=out, num_positions=num_positions,
                                  check_indices=check_indices)

    def write_quantized(self, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                        layer: int, slot_mapping: np.ndarray, k: Any, v: Any, *,
                        layout: str | StoreLayout = StoreLayout.NHD,
                        check_indices: bool = True) -> None:
        """As :meth:`Backend.write_quantized`; ``k`` and ``v`` as in :meth:`write`."""
        k, v = self._input(k, "k"), self._input(v, "v")
        others = {"v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale, "k": k, "v": v}
        with self._on_store_device(k_cache, others):
            super().write_quantized(k_cache, v_cache, k_scale, v_scale, layer, slot_mapping,
                                    k, v, layout=layout, check_indices=check_indices)

    def gather_quantized(self, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                         layer: int, page_table: np.ndarray, seq_lens: np.ndarray, *,
                         layout: str | StoreLayout = StoreLayout.NHD,
                         out_layout: str | OutputLayout = OutputLayout.BTHD,
                         out: tuple[Any, Any] | None = None, num_positions: int | None = None,
                         dtype: Any = None, check_indices: bool = True) -> tuple[Any, Any]:
        """As :meth:`Backend.gather_quantized`; ``out`` as in :meth:`gather`."""
        others = {"v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale}
        if isinstance(out, (tuple, list)) and len(out) == 2:
            out = (self._output(out[0], "out[0]"), self._output(out[1], "out[1]"))
            others.update({"out[0]": out[0], "out[1]": out[1]})
        with self._on_store_device(k_cache, others):
            return super().gather_quantized(
                k_cache, v_cache, k_scale, v_scale, layer, page_table, seq_lens, layout=layout,
                out_layout=out_layout, out=out, num_positions=num_positions, dtype=dtype,
                check_indices=check_indices)

    def copy_pages(self, k_cache: Any, v_cache: Any, src_pages: np.ndarray,
                   dst_pages: np.ndarray, *, layout: str | StoreLayout = StoreLayout.NHD,
                   check_indices: bool = True) -> None:
        """As :meth:`Backend.copy_pages`."""
        with self._on_store_device(k_cache, {"v_cache": v_cache}):
            super().copy_pages(k_cache, v_cache, src_pages, dst_pages, layout=layout,
                               check_indices=check_indices)

    # ------------------------------------------------------------------ kernels
    @staticmethod
    def _launch(plan: LaunchPlan, *arrays: Any) -> None:
        kernel = get_kernel(plan.file_name, plan.entry_point)
        kernel(plan.grid, plan.block, (*arrays, *plan.scalars))

    def _write(self, k_cache, v_cache, layer, slot_mapping, k, v, layout):
        itemsize = k_cache.dtype.itemsize
        # Rows must be contiguous for the word loop; other strides are free.
        k, v = (x if x.shape[2] <= 1 or x.strides[2] == itemsize else cupy.ascontiguousarray(x)
                for x in (k, v))
        k_layer, v_layer = k_cache[layer], v_cache[layer]
        plan = plan_write(layout, k_cache.shape, itemsize, slot_mapping.shape[0],
                          (k_layer.data.ptr, v_layer.data.ptr, k.data.ptr, v.data.ptr),
                          row_strides(k.shape, k.strides), row_strides(v.shape, v.strides))
        if plan is not None:
            slots = cupy.asarray(np.ascontiguousarray(slot_mapping))
            self._launch(plan, k_layer, v_layer, k, v, slots)

    def _gather(self, k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out,
                layout, out_layout):
        t_axis = 1 if out_layout is OutputLayout.BTHD else 2
        k_layer, v_layer = k_cache[layer], v_cache[layer]
        plan = plan_gather(layout, out_layout, k_cache.shape, k_cache.dtype.itemsize,
                           page_table.shape[0], page_table.shape[1], k_out.shape[t_axis],
                           (k_layer.data.ptr, v_layer.data.ptr, k_out.data.ptr, v_out.data.ptr))
        if plan is not None:
            table = cupy.asarray(np.ascontiguousarray(page_table))
            lens = cupy.asarray(np.ascontiguousarray(seq_lens))
            self._launch(plan, k_layer, v_layer, k_out, v_out, table, lens)

    def _copy_pages(self, k_cache, v_cache, src_pages, dst_pages, layout):
        plan = plan_copy_pages(k_cache.shape, k_cache.dtype.itemsize, src_pages.shape[0],
                               (k_cache.data.ptr, v_cache.data.ptr))
        if plan is not None:
            src = cupy.asarray(np.ascontiguousarray(src_pages))
            dst = cupy.asarray(np.ascontiguousarray(dst_pages))
            self._launch(plan, k_cache, v_cache, src, dst)

    def _write_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, slot_mapping, k, v,
                         layout):
        itemsize = k.dtype.itemsize
        k, v = (x if x.shape[2] <= 1 or x.strides[2] == itemsize else cupy.ascontiguousarray(x)
                for x in (k, v))
        plan = plan_write_quantized(layout, k_cache.shape, k.dtype, slot_mapping.shape[0],
                                    group_size(k_cache.shape[4]),
                                    row_strides(k.shape, k.strides),
                                    row_strides(v.shape, v.strides))
        if plan is not None:
            slots = cupy.asarray(np.ascontiguousarray(slot_mapping))
            self._launch(plan, k_cache[layer], v_cache[layer], k_scale[layer], v_scale[layer],
                         k, v, slots)

    def _gather_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, page_table,
                          seq_lens, k_out, v_out, layout, out_layout):
        t_axis = 1 if out_layout is OutputLayout.BTHD else 2
        plan = plan_gather_quantized(layout, out_layout, k_cache.shape, k_out.dtype,
                                     page_table.shape[0], page_table.shape[1],
                                     k_out.shape[t_axis], group_size(k_cache.shape[4]))
        if plan is not None:
            table = cupy.asarray(np.ascontiguousarray(page_table))
            lens = cupy.asarray(np.ascontiguousarray(seq_lens))
            self._launch(plan, k_cache[layer], v_cache[layer], k_scale[layer], v_scale[layer],
                         k_out, v_out, table, lens)

