"""The GPU backend: the store lives in device memory, CUDA kernels move the data.

Each operation is one kernel launch on CuPy's current stream, with K and V
moved together. The kernels (``kernels/*.cu``, see
:mod:`pagedkv_np.backends._cuda_sources`) copy bits in words of 16, 8, 4 or 2
bytes; :mod:`pagedkv_np.backends.cuda_launch` picks the widest word that
divides a row (``head_dim`` elements) and every address and stride involved,
so float32, float16 and bfloat16 share the same code and results match the
NumPy reference bit for bit.

Index arrays arrive as host int32 arrays (checked by
:class:`~pagedkv_np.backends.base.Backend`) and are uploaded per call, unless
the caller passes :meth:`CupyBackend.prepare`'s form of its plan: that one
uploads each of the plan's arrays once per device, on first use, and every
later layer reuses the copy (the cache does this for every plan it builds). K/V
inputs may be CuPy arrays, host NumPy arrays (uploaded), or any CUDA array
exposing ``__cuda_array_interface__`` or ``__dlpack__`` (a PyTorch CUDA
tensor, say), which is used in place without a copy.

Importing this module never fails: without CuPy, or without a GPU,
:meth:`CupyBackend.availability` says why and what to install.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, DTypeError
from ..layout import OutputLayout, StoreLayout
from ..checks import describe
from ..quant import group_size
from ._cuda_sources import get_kernel
from .cuda_launch import (LaunchPlan, block_shape, plan_copy_pages, plan_gather,
                          plan_gather_quantized, plan_write, plan_write_quantized,
                          row_strides, word_bytes)
from .base import Backend
from .prepared import PreparedIndices

try:
    import cupy
except Exception as exc:  # ImportError, or a broken CUDA install failing on import
    cupy = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

# the launch geometry is re-exported: tests and scripts/bench_gpu.py take it from here
__all__ = ["CupyBackend", "DeviceIndices", "LaunchPlan", "block_shape", "row_strides", "word_bytes",
           "plan_write", "plan_gather", "plan_copy_pages", "plan_write_quantized",
           "plan_gather_quantized"]

_INSTALL_HINT = "install it with: pip install 'pagedkv-np[cuda]'"

# DLPack device types of CUDA memory: kDLCUDA, kDLCUDAManaged.
_DLPACK_CUDA_DEVICES = (2, 13)


class DeviceIndices(PreparedIndices):
    """A plan's index arrays with one device copy of each per GPU, made when
    a kernel on that GPU first needs it (the store's GPU is current then)."""

    __slots__ = ("_copies",)

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self._copies: dict[tuple[int, int], Any] = {}

    def kernel_form(self, host: Any) -> Any:
        key = (id(host), cupy.cuda.runtime.getDevice())
        copy = self._copies.get(key)
        if copy is None:   # the plan holds ``host``, so its id names it while this lives
            copy = self._copies[key] = cupy.asarray(np.ascontiguousarray(host))
        return copy


def _device_index(x: Any) -> Any:
    """An index array on the current device: a prepared copy as it is, a
    host array uploaded."""
    return x if isinstance(x, cupy.ndarray) else cupy.asarray(np.ascontiguousarray(x))


def _nvrtc_version() -> tuple[int, int]:
    """NVRTC's version; raises when CuPy cannot load the library. CuPy wheels
    do not ship it: it comes from the CUDA toolkit or nvidia-cuda-nvrtc."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:  # another CuPy layout: let the first compile tell
        return (0, 0)
    return nvrtc.getVersion()


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
    def may_share_memory(a: Any, b: Any) -> bool:
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
    def prepare(self, plan: Any) -> PreparedIndices:
        """As :meth:`Backend.prepare`: the plan's arrays, uploaded once per
        GPU when a kernel there first needs them."""
        return DeviceIndices(plan)

    def write(self, k_cache: Any, v_cache: Any, layer: int, slot_mapping: np.ndarray,
              k: Any, v: Any, *, layout: str | StoreLayout = StoreLayout.NHD,
              check_indices: bool = True, check_store: bool = True,
              prepared: PreparedIndices | None = None) -> None:
        """As :meth:`Backend.write`; ``k`` and ``v`` may also be host NumPy
        arrays (uploaded) or CUDA arrays of other libraries (used in place)."""
        k, v = self._input(k, "k"), self._input(v, "v")
        with self._on_store_device(k_cache, {"v_cache": v_cache, "k": k, "v": v}):
            super().write(k_cache, v_cache, layer, slot_mapping, k, v, layout=layout,
                          check_indices=check_indices, check_store=check_store,
                          prepared=prepared)

    def gather(self, k_cache: Any, v_cache: Any, layer: int, page_table: np.ndarray,
               seq_lens: np.ndarray, *, layout: str | StoreLayout = StoreLayout.NHD,
               out_layout: str | OutputLayout = OutputLayout.BTHD,
               out: tuple[Any, Any] | None = None, num_positions: int | None = None,
               check_indices: bool = True, check_store: bool = True,
               prepared: PreparedIndices | None = None) -> tuple[Any, Any]:
        """As :meth:`Backend.gather`; ``out`` may also hold CUDA arrays of
        other libraries, written in place (the returned pair views them)."""
        others = {"v_cache": v_cache}
        if isinstance(out, (tuple, list)) and len(out) == 2:
            out = (self._output(out[0], "out[0]"), self._output(out[1], "out[1]"))
            others.update({"out[0]": out[0], "out[1]": out[1]})
        with self._on_store_device(k_cache, others):
            return super().gather(k_cache, v_cache, layer, page_table, seq_lens, layout=layout,
                                  out_layout=out_layout, out=out, num_positions=num_positions,
                                  check_indices=check_indices, check_store=check_store,
                                  prepared=prepared)

    def write_quantized(self, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                        layer: int, slot_mapping: np.ndarray, k: Any, v: Any, *,
                        layout: str | StoreLayout = StoreLayout.NHD,
                        check_indices: bool = True, check_store: bool = True,
                        prepared: PreparedIndices | None = None) -> None:
        """As :meth:`Backend.write_quantized`; ``k`` and ``v`` as in :meth:`write`."""
        k, v = self._input(k, "k"), self._input(v, "v")
        others = {"v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale, "k": k, "v": v}
        with self._on_store_device(k_cache, others):
            super().write_quantized(k_cache, v_cache, k_scale, v_scale, layer, slot_mapping,
                                    k, v, layout=layout, check_indices=check_indices,
                                    check_store=check_store, prepared=prepared)

    def gather_quantized(self, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any,
                         layer: int, page_table: np.ndarray, seq_lens: np.ndarray, *,
                         layout: str | StoreLayout = StoreLayout.NHD,
                         out_layout: str | OutputLayout = OutputLayout.BTHD,
                         out: tuple[Any, Any] | None = None, num_positions: int | None = None,
                         dtype: Any = None, check_indices: bool = True,
                         check_store: bool = True,
                         prepared: PreparedIndices | None = None) -> tuple[Any, Any]:
        """As :meth:`Backend.gather_quantized`; ``out`` as in :meth:`gather`."""
        others = {"v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale}
        if isinstance(out, (tuple, list)) and len(out) == 2:
            out = (self._output(out[0], "out[0]"), self._output(out[1], "out[1]"))
            others.update({"out[0]": out[0], "out[1]": out[1]})
        with self._on_store_device(k_cache, others):
            return super().gather_quantized(
                k_cache, v_cache, k_scale, v_scale, layer, page_table, seq_lens, layout=layout,
                out_layout=out_layout, out=out, num_positions=num_positions, dtype=dtype,
                check_indices=check_indices, check_store=check_store, prepared=prepared)

    def copy_pages(self, k_cache: Any, v_cache: Any, src_pages: np.ndarray,
                   dst_pages: np.ndarray, *, layout: str | StoreLayout = StoreLayout.NHD,
                   check_indices: bool = True, check_store: bool = True) -> None:
        """As :meth:`Backend.copy_pages`."""
        with self._on_store_device(k_cache, {"v_cache": v_cache}):
            super().copy_pages(k_cache, v_cache, src_pages, dst_pages, layout=layout,
                               check_indices=check_indices, check_store=check_store)

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
            self._launch(plan, k_layer, v_layer, k, v, _device_index(slot_mapping))

    def _gather(self, k_cache, v_cache, layer, page_table, seq_lens, k_out, v_out,
                layout, out_layout):
        k_layer, v_layer = k_cache[layer], v_cache[layer]
        plan = plan_gather(layout, out_layout, k_cache.shape, k_cache.dtype.itemsize,
                           page_table.shape[0], page_table.shape[1],
                           out_layout.num_positions(k_out.shape),
                           (k_layer.data.ptr, v_layer.data.ptr, k_out.data.ptr, v_out.data.ptr))
        if plan is not None:
            self._launch(plan, k_layer, v_layer, k_out, v_out, _device_index(page_table),
                         _device_index(seq_lens))

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
            self._launch(plan, k_cache[layer], v_cache[layer], k_scale[layer], v_scale[layer],
                         k, v, _device_index(slot_mapping))

    def _gather_quantized(self, k_cache, v_cache, k_scale, v_scale, layer, page_table,
                          seq_lens, k_out, v_out, layout, out_layout):
        plan = plan_gather_quantized(layout, out_layout, k_cache.shape, k_out.dtype,
                                     page_table.shape[0], page_table.shape[1],
                                     out_layout.num_positions(k_out.shape),
                                     group_size(k_cache.shape[4]))
        if plan is not None:
            self._launch(plan, k_cache[layer], v_cache[layer], k_scale[layer], v_scale[layer],
                         k_out, v_out, _device_index(page_table), _device_index(seq_lens))

