"""Conversion and checking of token id sequences."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import DTypeError, ShapeError

__all__ = ["as_tokens"]

_INT64_MAX = np.iinfo(np.int64).max


def as_tokens(tokens: Any, name: str = "tokens", allow_empty: bool = True) -> np.ndarray:
    """``tokens`` as a new 1-D int64 array of non-negative ids.

    Accepts a list, tuple or integer ndarray. The result never shares memory
    with ``tokens``: a caller may reuse its buffer as soon as the call that
    took it returns, and what was checked is what is kept. Raises
    :class:`DTypeError` for non-integer ids (floats, bools, strings) and
    :class:`ShapeError` for nested or empty (unless ``allow_empty``) input.
    """
    if (type(tokens) is np.ndarray and tokens.dtype == np.int64 and tokens.ndim == 1
            and 0 < tokens.shape[0] <= 64):
        # the decode-step case, kept cheap: a few int64 ids, copied first so
        # that what is checked is what is returned
        ids = np.array(tokens, dtype="<i8")
        if min(ids.tolist()) < 0:
            raise DTypeError(f"Invalid {name}: token ids must be >= 0, got {min(ids.tolist())}")
        return ids
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise DTypeError(f"Invalid {name}: expected a sequence of integer token ids, "
                         f"got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        arr = tokens.copy()   # checked and converted as it is now
    else:
        try:
            seq = list(tokens)
        except TypeError:
            raise DTypeError(f"Invalid {name}: expected a sequence of integer token ids, "
                             f"got {type(tokens).__name__}") from None
        if not seq:
            arr = np.empty(0, dtype=np.int64)
        elif any(isinstance(t, (list, tuple, np.ndarray)) for t in seq):
            raise ShapeError(f"Invalid shape of {name}: expected a flat sequence of token ids, "
                             "got nested sequences")
        elif not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
                     for t in seq):
            bad = next(t for t in seq if not isinstance(t, (int, np.integer))
                       or isinstance(t, (bool, np.bool_)))
            raise DTypeError(f"Invalid {name}: token ids must be integers, got "
                             f"{type(bad).__name__} {bad!r}")
        else:
            try:
                arr = np.asarray(seq, dtype=np.int64)
            except OverflowError:
                raise DTypeError(f"Invalid {name}: a token id does not fit in int64") from None
    if arr.ndim != 1:
        raise ShapeError(f"Invalid shape of {name}: expected 1 dimension, got {list(arr.shape)}")
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise DTypeError(f"Invalid dtype of {name}: expected integer token ids, got {arr.dtype}")
    if arr.size == 0:
        if not allow_empty:
            raise ShapeError(f"Invalid {name}: expected at least one token, got none")
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
        raise DTypeError(f"Invalid {name}: a token id does not fit in int64")
    if int(arr.min()) < 0:
        raise DTypeError(f"Invalid {name}: token ids must be >= 0, got {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype="<i8")   # arr is ours: no second copy needed
