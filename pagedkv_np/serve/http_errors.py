"""How failures become HTTP responses, and how every response is counted.

- :func:`api_error` turns what the engine reported for a request into an
  :class:`~pagedkv_np.serve.protocol.APIError`: a full queue is ``429`` with
  ``Retry-After``, a stopped engine ``503``, input the engine's own checks
  refused ``400``, anything else ``500``.
- :data:`EXCEPTION_HANDLERS` answer what a route raises: an ``APIError`` as
  itself, Starlette's 404 and 405 in OpenAI's shape, a client that left while
  sending its body with ``499`` (nobody reads it; counted and logged in one
  line, since it is not a server error), anything else ``500``.
- :class:`Metered` counts responses by route and status
  (``pagedkv_http_requests_total``) and, when asked, logs one access line
  per request: method, path, status, milliseconds, and the prompt and
  generated tokens a route noted in ``scope[USAGE_KEY]``.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import Iterable

from ..errors import PagedKVError
from .engine_loop import EngineStopped, QueueFull
from .protocol import APIError

try:
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pagedkv_np.serve needs starlette and uvicorn: "
                      "pip install 'pagedkv-np[serve]'") from exc

__all__ = ["CLIENT_CLOSED", "EXCEPTION_HANDLERS", "Metered", "USAGE_KEY", "api_error",
           "error_response", "shutdown_error"]

#: the scope key of a dict where routes note ``prompt_tokens`` and
#: ``completion_tokens`` for the access log
USAGE_KEY = "pagedkv.usage"

#: the status of a request whose client has gone (nginx's "client closed
#: request"); no client ever sees it
CLIENT_CLOSED = 499
# seconds a client told "queue full" is asked to wait
_RETRY_AFTER = "1"
_log = logging.getLogger("pagedkv_np.serve")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_json(), status_code=err.status, headers=err.headers)


def api_error(exc: BaseException) -> APIError:
    """The HTTP face of an error the engine reported for a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(str(exc), status=429, type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": _RETRY_AFTER})
    if isinstance(exc, EngineStopped):
        return APIError(f"The server is not accepting requests: {exc}", status=503,
                        type="server_error", code="unavailable")
    if isinstance(exc, PagedKVError) and isinstance(exc, (ValueError, TypeError)):
        return APIError(str(exc))   # input the engine's own checks refused
    return APIError(f"The request failed in the engine: {type(exc).__name__}: {exc}",
                    status=500, type="server_error", code="engine_error")


def shutdown_error() -> APIError:
    return APIError("The server shut down before the request finished", status=503,
                    type="server_error", code="shutdown")


async def _handle_api_error(request: Request, exc: Exception) -> Response:
    return error_response(api_error(exc))


async def _handle_client_gone(request: Request, exc: Exception) -> Response:
    client = request.client
    _log.info("%s left before sending its whole request (%s %s): %d",
              f"{client.host}:{client.port}" if client else "a client", request.method,
              request.url.path, CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


async def _handle_http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    if status == 404:
        err = APIError(f"Invalid URL ({request.method} {request.url.path})", status=404,
                       code="not_found")
    elif status == 405:
        err = APIError(f"Method {request.method} not allowed on {request.url.path}",
                       status=405, code="method_not_allowed")
    else:
        err = APIError(str(getattr(exc, "detail", exc)), status=status)
    return error_response(err)


async def _handle_crash(request: Request, exc: Exception) -> Response:
    return error_response(APIError(f"Internal server error: {type(exc).__name__}: {exc}",
                                   status=500, type="server_error", code="internal_error"))


EXCEPTION_HANDLERS: dict[Any, Any] = {
    APIError: _handle_api_error, HTTPException: _handle_http_error,
    ClientDisconnect: _handle_client_gone, Exception: _handle_crash}


class Metered:
    """ASGI wrapper that counts HTTP responses by route and status (a path
    outside ``routes`` counts as ``"other"``, ``/v1/models/ID`` as
    ``/v1/models/{model}``) and, with ``access_log``, logs each request in
    one line."""

    def __init__(self, app: Any, counter: Any, routes: Iterable[str],
                 access_log: bool = False) -> None:
        self.app = app
        self.counter = counter
        self.routes = frozenset(routes)
        self.access_log = access_log

    def route(self, path: str) -> str:
        if path in self.routes:
            return path
        return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.route(scope.get("path", ""))
        start = time.perf_counter()
        status = [0]
        usage: dict = {}
        scope[USAGE_KEY] = usage

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                self.counter.labels(route, str(status[0])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            if self.access_log:
                _log.info("%s %s %d %.1f ms prompt_tokens=%s completion_tokens=%s",
                          scope.get("method", "-"), scope.get("path", "")[:200],
                          status[0] or CLIENT_CLOSED, 1000 * (time.perf_counter() - start),
                          usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"))
