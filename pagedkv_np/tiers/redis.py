"""The Redis tier: pages as keys under a namespace on a Redis or Valkey server.

A chain's pages are read in one pipelined round trip and written the same
way. Values are the entries of :mod:`pagedkv_np.tiers.base` (format version
and CRC inside), so a server shared with other data, or a value overwritten
by anything else, is caught before use.

When the server cannot be reached the call fails once (within the read
timeout), and for ``retry_interval`` seconds after that the tier raises
:class:`~pagedkv_np.tiers.base.TierUnavailable` without trying: admission
then goes on without it. The next call after the pause tries again, and the
client opens a fresh connection, so a restarted server is used again.

Eviction on the server is the server's: give it ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (or a ``ttl`` here).
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any
from collections.abc import Sequence

from ..errors import ConfigError, DTypeError
from ..checks import is_int
from .base import Tier, TierUnavailable

_redis_lib: Any
try:
    import redis as _redis_lib
except ImportError:   # checked when a tier is made
    _redis_lib = None

__all__ = ["RedisTier"]

_SCHEMES = ("redis://", "rediss://", "unix://")


def _check_url(url: str) -> str:
    """The URL with its password hidden (for messages); raises ConfigError
    for a URL the client would misread."""
    if not url.startswith(_SCHEMES):
        raise ConfigError(f"Invalid redis_url: {url!r} does not start with one of "
                          f"{', '.join(_SCHEMES)}")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"Invalid redis_url: {url!r} has a port that is not a number "
                          "in [1, 65535]")
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"Invalid redis_url: {url!r} names no socket path")
    else:
        if not parts.hostname:
            raise ConfigError(f"Invalid redis_url: {url!r} names no host")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ConfigError(f"Invalid redis_url: the database {db!r} of {url!r} is not a "
                              "number")
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _require_redis() -> Any:
    if _redis_lib is None:
        raise ImportError("the Redis tier needs the redis client: pip install 'pagedkv-np[redis]'")
    return _redis_lib


class RedisTier(Tier):
    """Pages on a Redis (or Valkey) server.

    Parameters
    ----------
    url : str
        ``redis://[[user]:password@]host:port/db``, ``rediss://`` for TLS, or
        ``unix:///path/to/socket``.
    namespace : str
        Prefix of every key (``namespace:hex``).
    timeout : float
        Seconds a connect or a reply may take.
    retry_interval : float
        Seconds the tier is skipped after a failed call.
    ttl : int, optional
        Seconds an entry lives (none by default).
    client_options : dict, optional
        Passed to ``redis.Redis.from_url``: ``password``, ``username``,
        ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
        ``ssl_cert_reqs`` and the rest of the official client's options.
    """

    name = "redis"

    def __init__(self, url: str, *, namespace: str = "pagedkv", timeout: float = 1.0,
                 retry_interval: float = 1.0, ttl: int | None = None,
                 client_options: dict | None = None) -> None:
        super().__init__()
        if not isinstance(url, str):
            raise DTypeError(f"Invalid redis_url: expected a str, got {type(url).__name__}")
        shown = _check_url(url)
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError("Invalid namespace: expected a non-empty str")
        for name, value in (("timeout", timeout), ("retry_interval", retry_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"Invalid {name}: expected seconds > 0, got {value!r}")
        if ttl is not None and (not is_int(ttl) or ttl < 1):
            raise ConfigError(f"Invalid ttl: expected an integer >= 1, got {ttl!r}")
        ttl = None if ttl is None else int(ttl)
        if client_options is not None and not isinstance(client_options, dict):
            raise DTypeError("Invalid client_options: expected a dict")
        lib = _require_redis()
        options = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        options.update(client_options or {})
        try:
            self.client = lib.Redis.from_url(url, **options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Invalid redis_url: {shown!r} ({exc})") from None
        self.url = shown
        self.prefix = namespace.encode("utf-8") + b":"
        self.retry_interval = float(retry_interval)
        self.ttl = ttl
        self._retry_at = 0.0
        self._errors: tuple = (lib.ConnectionError, lib.TimeoutError, OSError)

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self.prefix + k.hex().encode("ascii") for k in keys]

    def _call(self, fill: Any) -> list:
        """Run a pipeline filled by ``fill(pipe)``; pause the tier on a
        connection failure."""
        if time.monotonic() < self._retry_at:
            raise TierUnavailable(f"{self.url} failed less than {self.retry_interval} s ago")
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        try:
            return pipe.execute()
        except self._errors:
            self._retry_at = time.monotonic() + self.retry_interval
            self.client.connection_pool.disconnect()
            raise

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        return [bool(n) for n in self._call(lambda p: [p.exists(n) for n in names])]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        names = self._names(keys)
        bound = self.max_entry_bytes
        if bound is None:
            return list(self._call(lambda p: [p.get(n) for n in names]))
        # at most one byte past an entry's size crosses the network: a larger
        # value under a key (someone else's, or a hostile one) comes back
        # cut, so the entry check rejects it and the key is written anew
        replies = self._call(lambda p: [p.getrange(n, 0, bound) for n in names])
        return [r or None for r in replies]

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        names = self._names([k for k, _ in items])
        ttl = self.ttl
        replies = self._call(lambda p: [p.set(n, blob, ex=ttl)
                                        for n, (_, blob) in zip(names, items)])
        return [bool(r) for r in replies]

    def discard(self, keys: Sequence[bytes]) -> None:
        names = self._names(keys)
        if names:
            self._call(lambda p: p.delete(*names))

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, namespace={self.prefix[:-1].decode()!r})"
