"""pagedkv_np: a paged K/V cache with prefix reuse, NumPy arrays in and out."""

from .backends.warmup import warmup
from .backends import available_backends, get_backend, register_backend
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
from .store import KVStore

__version__ = "0.1.0"
from .cache import CacheStats, PagedKVCache, Sequence
from .plan import Plan
from .compat import CacheView, PagedCache
