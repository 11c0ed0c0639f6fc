"""The error a request is answered with: :class:`APIError`, OpenAI's
``{"error": {"message", "type", "code", "param"}}``.

Its own module so that every part of the wire format (:mod:`.protocol`,
:mod:`.tools`) can raise it without importing the others.
"""

from __future__ import annotations

import numbers
from typing import Any

from ..errors import PagedKVError

__all__ = ["APIError", "json_type"]


class APIError(PagedKVError, ValueError):
    """A request the server answers with an OpenAI error object.

    Attributes
    ----------
    status : int
        HTTP status code.
    type, code, param : str or None
        The ``error`` object's fields (``param``: the offending field).
    headers : dict
        Extra response headers (``Retry-After`` for a full queue).
    """

    def __init__(self, message: str, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in words ("an array", "null"...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Integral):
        return "an integer"
    if isinstance(value, numbers.Real):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
