"""Layouts, dtypes and the argument checks shared by every module.

Store layouts (one page of one layer)::

    NHD: [page_size, num_kv_heads, head_dim]   (the full store is
         [num_layers, num_pages, page_size, num_kv_heads, head_dim])
    HND: [num_kv_heads, page_size, head_dim]   (the full store is
         [num_layers, num_pages, num_kv_heads, page_size, head_dim])

Output layouts of ``gather`` (one layer, a batch of B sequences, T positions)::

    BTHD: [B, T, num_kv_heads, head_dim]
    BHTD: [B, num_kv_heads, T, head_dim]   (ONNX ``past_key_values``)
"""

from __future__ import annotations

import enum
import numbers
from typing import Any, TypeVar
from collections.abc import Sequence

import numpy as np

from .errors import ConfigError, DTypeError, LayoutError, ShapeError

try:  # ml_dtypes is a hard dependency, but keep import errors readable.
    import ml_dtypes

    _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the requirements
    _BFLOAT16 = None

__all__ = [
    "StoreLayout",
    "OutputLayout",
    "SUPPORTED_DTYPES",
    "resolve_dtype",
    "bits_view_dtype",
    "store_shape",
    "check_array",
    "check_positive_int",
    "check_nonneg_int",
    "describe",
    "shown",
]


_L = TypeVar("_L", bound="_Layout")


class _Layout(str, enum.Enum):
    @classmethod
    def parse(cls: type[_L], value: Any, name: str = "layout") -> _L:
        """The member named ``value`` (any case), else :class:`LayoutError`."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        choices = ", ".join(repr(m) for m in cls.__members__)
        raise LayoutError(f"Invalid {name}: expected one of {choices}, got {shown(value)}")


class StoreLayout(_Layout):
    """Axis order of the K/V store (see the module docstring)."""

    NHD = "NHD"
    HND = "HND"


class OutputLayout(_Layout):
    """Axis order of gathered K/V (see the module docstring)."""

    BTHD = "BTHD"
    BHTD = "BHTD"


SUPPORTED_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
}
if _BFLOAT16 is not None:
    SUPPORTED_DTYPES["bfloat16"] = _BFLOAT16

# Unsigned integer dtype of the same width: kernels move bits, never values.
_BITS: dict[int, np.dtype] = {4: np.dtype(np.uint32), 2: np.dtype(np.uint16),
                              1: np.dtype(np.uint8)}


def resolve_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """Return the NumPy dtype for ``dtype`` (a name, a NumPy dtype or type).

    Raises
    ------
    DTypeError
        If ``dtype`` is not one of float32, float16, bfloat16.
    """
    if isinstance(dtype, str):
        key = dtype.lower()
        if key in SUPPORTED_DTYPES:
            return SUPPORTED_DTYPES[key]
    else:
        try:
            dt = np.dtype(dtype)
        except (TypeError, ValueError):   # ValueError: an int too long to print
            dt = None
        if dt is not None:
            for known in SUPPORTED_DTYPES.values():
                if dt == known:
                    return known
    raise DTypeError(
        f"Invalid {name}: expected one of {sorted(SUPPORTED_DTYPES)}, got {shown(dtype)}"
    )


def bits_view_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype that holds one element of ``dtype`` bit for bit."""
    return _BITS[np.dtype(dtype).itemsize]


def store_shape(
    layout: StoreLayout,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[int, int, int, int, int]:
    """Shape of the K (or V) store for ``layout``."""
    if StoreLayout.parse(layout) is StoreLayout.NHD:
        return (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    return (num_layers, num_pages, num_kv_heads, page_size, head_dim)


def describe(x: Any) -> str:
    """A short description of ``x`` for error messages."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None:
        return f"{type(x).__name__} of shape {list(shape)} and dtype {dtype}"
    return f"{type(x).__name__}"


def check_array(
    x: Any,
    name: str,
    *,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    dtype: np.dtype | None = None,
    array_type: type[Any] | tuple[type[Any], ...] = np.ndarray,
    contiguous: bool = False,
    writeable: bool = False,
) -> None:
    """Check that ``x`` is an array of the expected kind, shape and dtype.

    ``shape`` entries of ``None`` match any length. Raises :class:`ShapeError`
    or :class:`DTypeError` naming ``name``; returns nothing.
    """
    # The common case, all as expected, costs a few attribute reads: this runs
    # on every per-layer write and gather.
    if isinstance(x, array_type) and (
            x.shape == tuple(shape) if shape is not None else ndim is None or x.ndim == ndim) \
            and (dtype is None or x.dtype == dtype) \
            and (not contiguous or x.flags.c_contiguous) \
            and (not writeable or getattr(x.flags, "writeable", True)):
        return
    if not isinstance(x, array_type):
        raise DTypeError(f"Invalid {name}: expected an array, got {describe(x)}")
    if shape is not None:
        if len(x.shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(x.shape, shape)
        ):
            want_txt = ", ".join("*" if s is None else str(s) for s in shape)
            raise ShapeError(
                f"Invalid shape of {name}: expected [{want_txt}], got {list(x.shape)}"
            )
    elif ndim is not None and x.ndim != ndim:
        raise ShapeError(
            f"Invalid shape of {name}: expected {ndim} dimensions, got {list(x.shape)}"
        )
    if dtype is not None and x.dtype != dtype:
        raise DTypeError(f"Invalid dtype of {name}: expected {dtype}, got {x.dtype}")
    if contiguous and not x.flags.c_contiguous:
        raise ShapeError(f"Invalid strides of {name}: expected a C-contiguous array")
    # Device arrays (CuPy) have no writeable flag: device memory is always writeable.
    if writeable and not getattr(x.flags, "writeable", True):
        raise ShapeError(f"Invalid {name}: the array is read-only")


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, shortened: an int too long for
    Python's int -> str limit is described by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_positive_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 1, else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DTypeError(f"Invalid {name}: expected an integer, got {type(value).__name__}")
    if value < 1:
        raise ConfigError(f"Invalid {name}: expected an integer >= 1, got {shown(value)}")
    return int(value)


def check_nonneg_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 0, else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DTypeError(f"Invalid {name}: expected an integer, got {type(value).__name__}")
    if value < 0:
        raise ConfigError(f"Invalid {name}: expected an integer >= 0, got {shown(value)}")
    return int(value)
