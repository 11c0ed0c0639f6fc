"""The exception hierarchy of pagedkv_np.

Every error raised on purpose by the library derives from :class:`PagedKVError`
and also from the built-in exception a caller would expect (``ValueError`` for a
bad value, ``TypeError`` for a bad dtype, ``IndexError`` for an out-of-range
page id, ``MemoryError`` for an exhausted pool, ``ImportError`` for a missing
optional dependency), so that generic ``except`` clauses keep working.

An operation that raises one of these errors has changed nothing: the pool, the
prefix index and the K/V store are exactly as they were before the call. The
one exception is :class:`RequestFailed`, which reports a generation request
that the engine ended because a step of it failed.
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "ConfigError",
    "ShapeError",
    "DTypeError",
    "LayoutError",
    "PageIdError",
    "PageStateError",
    "OutOfPages",
    "SequenceError",
    "StalePlanError",
    "BackendUnavailable",
    "AllocationError",
    "RequestFailed",
]


class PagedKVError(Exception):
    """Base class of every error that pagedkv_np raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A constructor or configuration argument is out of its valid range."""


class ShapeError(PagedKVError, ValueError):
    """An array has the wrong shape, strides or number of dimensions."""


class DTypeError(PagedKVError, TypeError):
    """An array has the wrong dtype, or a value is not of the expected type."""


class LayoutError(PagedKVError, ValueError):
    """An unknown store layout (NHD/HND) or output layout (BTHD/BHTD)."""


class PageIdError(PagedKVError, IndexError):
    """A page id, slot or index is outside the valid range."""


class PageStateError(PagedKVError, ValueError):
    """A page is not in the state the operation needs (e.g. a double free)."""


class OutOfPages(PagedKVError, MemoryError):
    """The pool cannot supply the pages asked for; nothing was allocated.

    Attributes
    ----------
    num_needed : int
        Pages the operation asked for.
    num_available : int
        Pages that could have been supplied (free plus evictable).
    """

    def __init__(self, num_needed: int, num_available: int, what: str = "pages"):
        self.num_needed = int(num_needed)
        self.num_available = int(num_available)
        super().__init__(
            f"out of pages: {what} needs {self.num_needed} page(s), "
            f"only {self.num_available} available (free + evictable)"
        )


class SequenceError(PagedKVError, ValueError):
    """A sequence is released, belongs to another cache, or is used past its
    reserved length."""


class StalePlanError(PagedKVError, ValueError):
    """A plan was built before the cache last changed its page mapping, or by
    another cache; build a new one with ``cache.plan``."""


class BackendUnavailable(PagedKVError, ImportError):
    """An array backend was asked for whose library (or device) is missing."""


class AllocationError(PagedKVError, MemoryError):
    """An array could not be allocated: the memory it needs is not available.

    Unlike :class:`OutOfPages` (the pool is exhausted), this is the host or
    device allocator refusing a store or a gather buffer.
    """


class RequestFailed(PagedKVError, RuntimeError):
    """A generation request was ended because a step of it failed (the model
    call, a page write or gather, sampling).

    The original error is ``__cause__``; the other requests were not affected.

    Attributes
    ----------
    request_id : int
    """

    def __init__(self, request_id: int, cause: BaseException):
        self.request_id = request_id
        super().__init__(f"request {request_id} failed: {type(cause).__name__}: {cause}")
        self.__cause__ = cause

    def __reduce__(self):
        return (type(self), (self.request_id, self.__cause__))
