"""Store and output layouts, and the dtypes a store may hold.

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
from typing import Any, NamedTuple, TypeVar
from collections.abc import Sequence

import numpy as np

from .checks import describe, shown
from .errors import DTypeError, LayoutError, ShapeError

try:  # ml_dtypes is a hard dependency, but keep import errors readable.
    import ml_dtypes

    _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the requirements
    _BFLOAT16 = None

__all__ = [
    "StoreDims",
    "StoreLayout",
    "OutputLayout",
    "SUPPORTED_DTYPES",
    "resolve_dtype",
    "bits_view_dtype",
    "store_shape",
    "check_array",
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


class StoreDims(NamedTuple):
    """The sizes of a K (or V) store, whatever its layout."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


# StoreLayout.dims of the shapes seen lately (a process has a few stores).
_STORE_DIMS: dict[tuple, StoreDims] = {}
_STORE_DIMS_MAX = 64


class StoreLayout(_Layout):
    """Axis order of the K/V store (see the module docstring)."""

    NHD = "NHD"
    HND = "HND"

    # Methods and properties are not members: an Enum makes members only of
    # plain class attributes, never of functions or descriptors.

    def shape(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[int, int, int, int, int]:
        """The 5-D shape of a K (or V) store in this layout.

        Returns
        -------
        tuple of 5 ints
            ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` for
            NHD, ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]``
            for HND.
        """
        if self is StoreLayout.NHD:
            return (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        return (num_layers, num_pages, num_kv_heads, page_size, head_dim)

    def dims(self, shape: Sequence[int]) -> StoreDims:
        """The sizes behind a 5-D store ``shape`` in this layout (the inverse
        of :meth:`shape`).

        Raises
        ------
        ShapeError
            If ``shape`` does not have 5 entries.
        """
        key = (self, shape)
        found = _STORE_DIMS.get(key) if type(shape) is tuple else None
        if found is not None:   # the per-layer calls ask for the same few stores
            return found
        if len(shape) != 5:
            raise ShapeError(
                f"Invalid store shape: expected 5 dimensions, got {list(shape)}")
        num_layers, num_pages, a, b, head_dim = shape
        if self is StoreLayout.NHD:
            dims = StoreDims(num_layers, num_pages, a, b, head_dim)
        else:
            dims = StoreDims(num_layers, num_pages, b, a, head_dim)
        if type(shape) is tuple and all(type(x) is int for x in shape):
            if len(_STORE_DIMS) >= _STORE_DIMS_MAX:
                _STORE_DIMS.clear()
            _STORE_DIMS[key] = dims
        return dims

    @property
    def offset_axis(self) -> int:
        """Axis of the within-page token offset in the 5-D store (2 for NHD,
        3 for HND)."""
        return 2 if self is StoreLayout.NHD else 3

    @property
    def head_axis(self) -> int:
        """Axis of the KV head in the 5-D store (3 for NHD, 2 for HND)."""
        return 3 if self is StoreLayout.NHD else 2


class OutputLayout(_Layout):
    """Axis order of gathered K/V (see the module docstring)."""

    BTHD = "BTHD"
    BHTD = "BHTD"

    def shape(
        self, num_seqs: int, num_positions: int, num_kv_heads: int, head_dim: int,
    ) -> tuple[int, int, int, int]:
        """The 4-D shape of one layer's gathered K (or V) in this layout.

        Returns
        -------
        tuple of 4 ints
            ``[num_seqs, num_positions, num_kv_heads, head_dim]`` for BTHD,
            ``[num_seqs, num_kv_heads, num_positions, head_dim]`` for BHTD.
        """
        if self is OutputLayout.BTHD:
            return (num_seqs, num_positions, num_kv_heads, head_dim)
        return (num_seqs, num_kv_heads, num_positions, head_dim)

    @property
    def t_axis(self) -> int:
        """Axis of the position in the 4-D output (1 for BTHD, 2 for BHTD)."""
        return 1 if self is OutputLayout.BTHD else 2

    def num_positions(self, shape: Sequence[int]) -> int:
        """The number of positions of a 4-D output ``shape`` in this layout."""
        return shape[1 if self is OutputLayout.BTHD else 2]

    @property
    def store_layout(self) -> StoreLayout:
        """The store layout that a gather into this layout reads in whole
        runs: NHD for BTHD, HND for BHTD (the other pairings transpose every
        page they gather)."""
        return StoreLayout.NHD if self is OutputLayout.BTHD else StoreLayout.HND


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
    """Shape of the K (or V) store for ``layout`` (see :meth:`StoreLayout.shape`)."""
    return StoreLayout.parse(layout).shape(num_layers, num_pages, page_size,
                                           num_kv_heads, head_dim)


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
