"""What one client may cost the server: body size, read deadlines, connections.

Three guards, each where the thing it bounds is visible:

- :class:`ServerLimits` holds the settings (``pagedkv serve --max-body-size
  --header-timeout --body-timeout --max-connections``) and checks them
  before anything loads.
- :class:`BodyLimits`, an ASGI middleware, answers a ``Content-Length`` above
  ``max_body_size`` with ``413`` before reading a byte of the body, and wraps
  ``receive`` so that a body sent without a length (chunked) is cut off at
  the same size, and a body that has not arrived ``body_timeout`` seconds
  after its headers is answered with ``408``. Once the body is complete,
  ``receive`` is the server's own again (a handler that waits for the
  client's disconnect must not time out).
- :func:`http_protocol` subclasses uvicorn's h11 protocol with a header
  deadline, which no ASGI code can see: a connection that has not sent a
  complete request head ``header_timeout`` seconds after it opened (or after
  the first byte of its next request) is answered ``408`` and closed.
  uvicorn's ``timeout_keep_alive`` closes idle keep-alive connections, but
  the first byte of a request cancels it for good.

``max_connections`` is uvicorn's ``limit_concurrency``: past that many open
connections (or running requests), a new request gets uvicorn's plain
``503``.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .protocol import APIError

try:
    import h11
    from starlette.responses import JSONResponse
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pagedkv_np.serve needs starlette and uvicorn: "
                      "pip install 'pagedkv-np[serve]'") from exc

__all__ = ["ServerLimits", "BodyLimits", "http_protocol", "body_too_large", "body_timed_out"]


@dataclass(frozen=True)
class ServerLimits:
    """How much one request or connection may hold.

    Attributes
    ----------
    max_body_size : int
        Bytes a request body may have (default 4 MiB: a full 8k-token
        context of long tokens, JSON-escaped, fits several times over).
    header_timeout : float
        Seconds a connection gets to send a request head.
    body_timeout : float
        Seconds a request gets, after its head, to send its whole body.
    max_connections : int
        Open connections (or running requests) past which a request gets
        ``503`` (uvicorn's ``limit_concurrency``).

    Raises
    ------
    ConfigError
        A size or count below 1, a timeout that is not a finite number > 0.
    """

    max_body_size: int = 4 * 1024 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 512

    def __post_init__(self) -> None:
        for name in ("max_body_size", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Invalid {name}: expected an integer >= 1, got {value!r}")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"Invalid {name}: expected a number of seconds > 0, "
                                  f"got {value!r}")


def body_too_large(max_body_size: int) -> APIError:
    return APIError(f"The request body is larger than this server accepts ({max_body_size:,} "
                    "bytes)", status=413, code="request_too_large")


def body_timed_out(body_timeout: float) -> APIError:
    return APIError(f"The request body did not arrive within {body_timeout:g} s",
                    status=408, code="request_timeout", headers={"Connection": "close"})


def _declared_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            # h11 has checked it is a decimal number
            return int(value) if value.isdigit() else None
    return None


class BodyLimits:
    """ASGI middleware: a size cap and a deadline for every request body
    (see the module docstring)."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app = app
        self.max_body_size = limits.max_body_size
        self.body_timeout = limits.body_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_body_size:
            # answered before the body is read; the connection drains the
            # rest (or is closed at the header deadline) so the client sees it
            err = body_too_large(self.max_body_size)
            await JSONResponse(err.to_json(), status_code=err.status)(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        num_received = 0
        complete = False

        async def limited() -> Any:
            nonlocal num_received, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise body_timed_out(self.body_timeout) from None
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_body_size:
                    raise body_too_large(self.max_body_size)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


def _timeout_response() -> bytes:
    err = APIError("The request head did not arrive in time", status=408,
                   code="request_timeout")
    body = json.dumps(err.to_json()).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head.

    Invariant: while the connection waits for a request head (no request
    yet, or the last one answered), a timer is armed for the cycle it waits
    after (``_armed_for``); a new request replaces ``self.cycle``, which
    disarms the timer in effect (it fires, sees another cycle, and does
    nothing).
    """

    header_timeout: float = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for: Any = ()
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting() and self._armed_for is not self.cycle:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = self.cycle
        self._timer = self.loop.call_later(self.header_timeout, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.cycle is not self._armed_for or self.transport.is_closing():
            return   # a request head arrived in time
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:   # part of a head
            self.transport.write(_timeout_response())
        self.transport.close()


def http_protocol(limits: ServerLimits) -> type:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    return type("HeaderDeadlineH11", (_HeaderDeadline,),
                {"header_timeout": float(limits.header_timeout)})
