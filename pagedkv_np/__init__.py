"""pagedkv_np: a paged K/V cache with prefix reuse, NumPy arrays in and out.

The public names below are imported on first use (PEP 562), not when the
package is: ``import pagedkv_np`` alone loads no NumPy, Numba or ml_dtypes
(whose import takes 2-4 s on a 2-core machine), so that ``pagedkv --help``
and ``pagedkv --version`` answer at once. ``from pagedkv_np import X`` works
as with eager imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "warmup": ".backends.warmup",
    "available_backends": ".backends",
    "get_backend": ".backends",
    "register_backend": ".backends",
    "AllocationError": ".errors",
    "BackendUnavailable": ".errors",
    "ConfigError": ".errors",
    "DTypeError": ".errors",
    "LayoutError": ".errors",
    "OutOfPages": ".errors",
    "PagedKVError": ".errors",
    "PageIdError": ".errors",
    "PageStateError": ".errors",
    "RequestFailed": ".errors",
    "SequenceError": ".errors",
    "ShapeError": ".errors",
    "StalePlanError": ".errors",
    "OutputLayout": ".layout",
    "StoreLayout": ".layout",
    "KVStore": ".store",
    "CacheStats": ".cache",
    "PagedKVCache": ".cache",
    "Sequence": ".cache",
    "Plan": ".plan",
    "CacheView": ".compat",
    "PagedCache": ".compat",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from .backends import available_backends, get_backend, register_backend
    from .backends.warmup import warmup
    from .cache import CacheStats, PagedKVCache, Sequence
    from .compat import CacheView, PagedCache
    from .errors import (
        AllocationError,
        BackendUnavailable,
        ConfigError,
        DTypeError,
        LayoutError,
        OutOfPages,
        PagedKVError,
        PageIdError,
        PageStateError,
        RequestFailed,
        SequenceError,
        ShapeError,
        StalePlanError,
    )
    from .layout import OutputLayout, StoreLayout
    from .plan import Plan
    from .store import KVStore


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv_np' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
