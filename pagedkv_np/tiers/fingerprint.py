"""Model fingerprints: which model a page's K/V came from.

A fingerprint is the model's geometry plus a digest of its weights, so a
page is never served to another model, or to the same graph with other
weights. Hashing the weights of a real model takes a while, so each file's
digest comes from :func:`pagedkv_np.digests.file_digest`, remembered under
the file's identity (path, inode, size, mtime, ctime and sampled bytes) in
this process and, when given a directory (the disk tier's), in its
``digests/`` for a restarted process.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any
from collections.abc import Iterable

from ..digests import file_digest, save_deferred

__all__ = ["model_fingerprint", "weights_digest", "files_digest", "save_deferred"]


def files_digest(paths: Iterable[str], memo_dir: str | None = None) -> str:
    """SHA-256 over the digests of ``paths`` (in the order given), 32 hex digits."""
    h = hashlib.sha256()
    for path in paths:
        h.update(file_digest(path, memo_dir).encode("ascii"))
    return h.hexdigest()[:32]


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
        return hashlib.sha256(bytes(source)).hexdigest()[:32]
    path = os.fspath(source)
    return files_digest([path, *_external_files(proto, path)], memo_dir)


def model_fingerprint(weights: str, io: Any) -> str:
    """The ``model_id`` of a decoder: the geometry its model I/O reports
    (family, layers, K/V heads, head size, dtype, vocabulary) and
    :func:`weights_digest`."""
    geometry = {name: str(getattr(io, name, None)) for name in
                ("family", "num_layers", "num_kv_heads", "head_dim", "dtype", "vocab_size")}
    return json.dumps(geometry, sort_keys=True) + "|" + weights
