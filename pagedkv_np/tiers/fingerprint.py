"""Model fingerprints: which model a page's K/V came from.

A fingerprint is the model's geometry plus a digest of its weights, so a
page is never served to another model, or to the same graph with other
weights. Hashing the weights of a real model takes a while, so the digest
of a file is computed once per ``(path, size, mtime)`` and kept, in this
process and, when given a directory (the disk tier's), in a small file
there that a restarted process reads back.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any
from collections.abc import Iterable

__all__ = ["model_fingerprint", "weights_digest", "files_digest", "save_deferred"]

_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()
_deferred: dict[str, dict[str, str]] = {}
MEMO_FILE = "fingerprints.json"


def _read_memo(memo_dir: str) -> dict:
    try:
        with open(os.path.join(memo_dir, MEMO_FILE), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _write_memo(memo_dir: str, entries: dict) -> None:
    saved = _read_memo(memo_dir)
    saved.update(entries)
    path = os.path.join(memo_dir, MEMO_FILE)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(saved, f)
        os.replace(tmp, path)
    except OSError:
        pass   # a cache of a cache: computed again next time


def _remember(memo_dir: str, name: str, digest: str) -> None:
    """Keep a digest in ``memo_dir``; until that directory exists (the disk
    tier makes it a moment later), hold it for :func:`save_deferred`."""
    if os.path.isdir(memo_dir):
        if _read_memo(memo_dir).get(name) != digest:
            _write_memo(memo_dir, {name: digest})
    else:
        with _memo_lock:
            _deferred.setdefault(memo_dir, {})[name] = digest


def save_deferred(directory: str) -> None:
    """Write the digests held for ``directory`` now that it exists."""
    with _memo_lock:
        entries = _deferred.pop(os.path.abspath(directory), None)
    if entries:
        _write_memo(os.path.abspath(directory), entries)


def _file_digest(path: str, memo_dir: str | None) -> str:
    st = os.stat(path)
    ident = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    name = "|".join(map(str, ident))
    with _memo_lock:
        digest = _memo.get(ident)
    if digest is None and memo_dir is not None:
        found = _read_memo(memo_dir).get(name)
        digest = found if isinstance(found, str) else None
    if digest is None:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        digest = h.hexdigest()
    with _memo_lock:
        _memo[ident] = digest
    if memo_dir is not None:
        _remember(memo_dir, name, digest)
    return digest


def files_digest(paths: Iterable[str], memo_dir: str | None = None) -> str:
    """BLAKE2b over the digests of ``paths`` (in the order given)."""
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        h.update(_file_digest(path, memo_dir).encode("ascii"))
    return h.hexdigest()


def _external_files(proto: Any, model_path: str) -> list[str]:
    """Files holding an ONNX model's external tensors (``proto`` loaded
    without them), sorted."""
    base = os.path.dirname(os.path.abspath(model_path))
    found = set()
    graph = getattr(proto, "graph", None)
    for tensor in getattr(graph, "initializer", ()):
        for entry in getattr(tensor, "external_data", ()):
            if entry.key == "location":
                found.add(os.path.join(base, entry.value))
    return sorted(p for p in found if os.path.isfile(p))


def weights_digest(source: Any, proto: Any, memo_dir: Any = None) -> str:
    """A digest of every byte of an ONNX model: its file and its external
    tensors' files (or its serialized bytes).

    Parameters
    ----------
    source : str or bytes
        The model's path, or its serialized bytes.
    proto : onnx.ModelProto or None
        The model as loaded without external data (names the external files).
    memo_dir : str, optional
        Where to keep file digests across processes (ignored unless a path).
    """
    memo_dir = (os.path.abspath(os.fspath(memo_dir))
                if isinstance(memo_dir, (str, os.PathLike)) and os.fspath(memo_dir) else None)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return hashlib.blake2b(bytes(source), digest_size=16).hexdigest()
    path = os.fspath(source)
    return files_digest([path, *_external_files(proto, path)], memo_dir)


def model_fingerprint(weights: str, io: Any) -> str:
    """The ``model_id`` of a decoder: the geometry its model I/O reports
    (family, layers, K/V heads, head size, dtype, vocabulary) and
    :func:`weights_digest`."""
    geometry = {name: str(getattr(io, name, None)) for name in
                ("family", "num_layers", "num_kv_heads", "head_dim", "dtype", "vocab_size")}
    return json.dumps(geometry, sort_keys=True) + "|" + weights
