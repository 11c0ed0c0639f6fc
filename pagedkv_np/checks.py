"""Argument checks shared by every module: integers, indices, and how a
value is shown in an error message."""

from __future__ import annotations

import numbers
from typing import Any

from .errors import ConfigError, DTypeError, PageIdError

__all__ = ["describe", "shown", "is_int", "check_int", "check_index", "check_positive_int",
           "check_nonneg_int"]


def describe(x: Any) -> str:
    """A short description of ``x`` for error messages."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None:
        return f"{type(x).__name__} of shape {list(shape)} and dtype {dtype}"
    return f"{type(x).__name__}"


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, shortened: an int too long for
    Python's int -> str limit is described by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integral number (a Python or NumPy int), not a bool."""
    # numpy.bool_ is not a numbers.Integral; only Python's bool needs ruling out.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if :func:`is_int`, else raise.

    Raises
    ------
    DTypeError
        If ``value`` is not an integer (a bool is not one).
    """
    if type(value) is int:   # the common case, before the slower ABC check
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise DTypeError(f"Invalid {name}: expected an integer, got {type(value).__name__}")


def check_index(value: Any, name: str, bound: int,
                error: type[Exception] = PageIdError) -> int:
    """Return ``value`` as an int if it is an integer with ``0 <= value < bound``.

    Raises
    ------
    DTypeError
        If ``value`` is not an integer.
    error
        (:class:`PageIdError` unless given) if it is out of range.
    """
    index = check_int(value, name)
    if not 0 <= index < bound:
        raise error(f"Invalid {name}: expected 0 <= {name} < {bound}, got {shown(index)}")
    return index


def check_positive_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 1, else raise."""
    number = check_int(value, name)
    if number < 1:
        raise ConfigError(f"Invalid {name}: expected an integer >= 1, got {shown(value)}")
    return number


def check_nonneg_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is an integer >= 0, else raise."""
    number = check_int(value, name)
    if number < 0:
        raise ConfigError(f"Invalid {name}: expected an integer >= 0, got {shown(value)}")
    return number
