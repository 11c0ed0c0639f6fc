"""The tier arguments of a cache: checked, and the tiers they name opened.

Kept apart from :mod:`pagedkv_np.tiers.manager` so that every rule about
``disk_cache``, ``disk_cache_bytes``, ``redis_url``, ``model_id``,
``hash_secret`` and ``tier_options`` is in one place.
"""

from __future__ import annotations

import os
import threading
from stat import S_ISREG
from typing import Any

from ..errors import ConfigError, DTypeError
from .base import Tier
from .fingerprint import save_deferred

__all__ = ["open_tiers", "SECRET_FILE"]

SECRET_FILE = "secret"


def _disk_secret(directory: str) -> bytes:
    """The secret kept in the disk tier's directory (made on first use), so
    that a restarted process finds its pages.

    It is written whole or not at all (a temporary file, flushed, then
    linked to its name only if no other process made one meanwhile), so a
    start that fails part way leaves no secret rather than a broken one. An
    empty file (left by a failed start of an earlier version) is replaced.

    Raises
    ------
    ConfigError
        The secret cannot be written (a full disk, a read-only directory),
        or what holds its name is not a regular file of 32 bytes.
    """
    from .disk import read_regular, write_whole
    path = os.path.join(directory, SECRET_FILE)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"Invalid disk_cache: cannot open {directory!r} ({exc})") from None
    try:
        for _ in range(3):     # a file that another process removes meanwhile: look again
            try:
                st = os.stat(SECRET_FILE, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError as exc:
                raise ConfigError(f"Invalid disk_cache: cannot read {path!r} ({exc})") from None
            if st is not None and (st.st_size != 0 or not S_ISREG(st.st_mode)):
                secret = read_regular(dir_fd, SECRET_FILE, 32)
                if secret is None or len(secret) != 32:
                    raise ConfigError(f"Invalid disk_cache: {path!r} does not hold a 32-byte "
                                      "secret (a regular file; remove it to start afresh, "
                                      "which makes the pages there unreachable)")
                return secret
            secret = os.urandom(32)
            try:
                write_whole(dir_fd, SECRET_FILE, secret, f"{os.getpid()}.{threading.get_ident()}",
                            replace=st is not None, sync=True)
            except FileExistsError:
                continue       # another process made it first: use that one
            except OSError as exc:
                raise ConfigError(f"Invalid disk_cache: cannot write the secret {path!r} "
                                  f"({exc})") from None
            return secret
        raise ConfigError(f"Invalid disk_cache: {path!r} keeps changing")
    finally:
        os.close(dir_fd)


def open_tiers(disk_cache: Any = None, disk_cache_bytes: Any = None, redis_url: Any = None,
               model_id: Any = None, hash_secret: Any = None,
               tier_options: Any = None) -> tuple[list[Tier], bytes | None]:
    """Check the tier arguments of a cache and open its tiers.

    Returns the tiers (nearest first; empty when none is asked for) and the
    hash secret to use: ``hash_secret`` if given, else, with a disk tier,
    the secret kept in its directory.

    Raises
    ------
    ConfigError, DTypeError
        A bad directory, size, URL or option, a missing ``model_id``, or a
        Redis tier without ``hash_secret`` (processes sharing a server must
        agree on it).
    ImportError
        ``redis_url`` without the redis client installed.
    """
    from .disk import DEFAULT_DISK_BYTES, DiskTier
    if disk_cache is None and redis_url is None:
        if disk_cache_bytes is not None:
            raise ConfigError("Invalid disk_cache_bytes: given without disk_cache")
        return [], hash_secret
    if tier_options is None:
        tier_options = {}
    if not isinstance(tier_options, dict):
        raise DTypeError(f"Invalid tier_options: expected a dict, got "
                         f"{type(tier_options).__name__}")
    unknown = set(tier_options) - {"queue_size", "read_timeout", "redis"}
    if unknown:
        raise ConfigError(f"Invalid tier_options: unknown option(s) {sorted(unknown)}; "
                          "expected queue_size, read_timeout, redis")
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError("Invalid model_id: a cache with disk_cache or redis_url needs a "
                          "non-empty str naming the model (its fingerprint), so that pages "
                          "of different models never mix")
    if redis_url is not None and hash_secret is None:
        raise ConfigError("Invalid hash_secret: processes sharing a Redis tier must give "
                          "the same hash_secret")
    tiers: list[Tier] = []
    try:
        if disk_cache is not None:
            disk = DiskTier(disk_cache, DEFAULT_DISK_BYTES if disk_cache_bytes is None
                            else disk_cache_bytes)
            tiers.append(disk)
            save_deferred(disk.directory)     # the model's digest, kept for a restart
            if hash_secret is None:
                hash_secret = _disk_secret(disk.directory)
        elif disk_cache_bytes is not None:
            raise ConfigError("Invalid disk_cache_bytes: given without disk_cache")
        if redis_url is not None:
            from .redis import RedisTier
            redis_options = tier_options.get("redis", {})
            if not isinstance(redis_options, dict):
                raise DTypeError("Invalid tier_options['redis']: expected a dict of "
                                 "RedisTier options")
            try:
                tiers.append(RedisTier(redis_url, **redis_options))
            except TypeError as exc:
                raise DTypeError(f"Invalid tier_options['redis']: {exc}") from None
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers, hash_secret
