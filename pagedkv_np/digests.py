"""Content digests of files, hashed once and remembered: the one memo that every
cache keyed by a file's bytes uses (GGUF model folders, tier fingerprints).

:func:`file_digest` is the SHA-256 of a file's bytes. Hashing a model on
every load costs seconds, so a digest is remembered, in this process and in
``<memo_dir>/digests/`` (one small JSON file per path, written atomically),
under the file's **identity**: its path, device, inode, size, mtime and
ctime in nanoseconds, and a digest of three 64 KiB samples (start, middle,
end). A memo whose identity differs is ignored and the file is hashed again.

Why these fields: a memo keyed by (path, size, mtime) alone served the old
digest for a different file of the same size whose mtime had been restored
(``cp -p``, ``rsync -t``, ``tar x``, ``os.utime``): a stale model folder, and
K/V pages of another model from the tiers. Those tools can restore mtime but
not ctime: the kernel sets ctime to the current time on every write, rename,
``chmod`` or ``utime``, and no system call sets it back; a file replaced by
another gets a new inode or, written in place, a new ctime. The samples
cover filesystems whose ctime is coarse or missing (FAT's 10 ms to 2 s, some
FUSE and network mounts) for files that differ where they look.

Measured on this 2-core machine under load (2026-12-01): SHA-256 of the
253 MB Gemma 3 270M GGUF at 0.44 GB/s (SHA-NI) against BLAKE2b's 0.15-0.19
GB/s (1.4-2.3 s), SmolLM2's 98 MB file in 0.53-0.73 s with BLAKE2b; a stat
5-18 us; the three samples well under a millisecond. So hashing every load
would cost 0.6-2.3 s per 250 MB (and seconds per GB-sized model); the
identity costs a stat and three small reads, and is never stale under the
copies above. The alternative of trusting the samples alone (no full hash)
was rejected: two fine-tunes of one model differ everywhere but can agree
on three 64 KiB windows of, e.g., a shared embedding.

A file that changes while it is hashed (its identity differs afterwards) is
hashed, but not remembered. A memo directory that does not exist yet (the
disk tier makes its own a moment later) holds digests in this process until
:func:`save_deferred` is called for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from typing import Any

__all__ = ["file_digest", "save_deferred", "MEMO_SUBDIR", "ALGORITHM"]

#: the hash of file contents (hashlib name)
ALGORITHM = "sha256"
#: where a memo directory keeps its digests
MEMO_SUBDIR = "digests"
_CHUNK = 1 << 22
_SAMPLE = 1 << 16

_memo: dict[tuple, str] = {}
_deferred: dict[str, dict[str, dict]] = {}
_lock = threading.Lock()


def _sample(f: Any, size: int) -> str:
    """Digest of three windows of an open file: its start, middle and end."""
    h = hashlib.new(ALGORITHM)
    for offset in sorted({0, max(size // 2 - _SAMPLE // 2, 0), max(size - _SAMPLE, 0)}):
        f.seek(offset)
        h.update(f.read(_SAMPLE))
    return h.hexdigest()[:32]


def _identity(abspath: str, st: os.stat_result, sample: str) -> dict[str, Any]:
    return {"path": abspath, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sample": sample}


def _memo_file(memo_dir: str, abspath: str) -> str:
    name = hashlib.sha256(abspath.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(memo_dir, MEMO_SUBDIR, f"{name}.json")


def _load(memo_dir: str, ident: dict[str, Any]) -> str | None:
    try:
        with open(_memo_file(memo_dir, ident["path"]), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("identity") != ident:
        return None
    digest = saved.get(ALGORITHM)
    return digest if isinstance(digest, str) else None


def _write(memo_dir: str, ident: dict[str, Any], digest: str) -> None:
    """Write one memo atomically; a failure only costs a hash later."""
    target = _memo_file(memo_dir, ident["path"])
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".partial")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"identity": ident, ALGORITHM: digest}, f)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def _remember(memo_dir: str, ident: dict[str, Any], digest: str) -> None:
    if os.path.isdir(memo_dir):
        if _load(memo_dir, ident) != digest:
            _write(memo_dir, ident, digest)
    else:
        with _lock:
            _deferred.setdefault(memo_dir, {})[ident["path"]] = {"identity": ident,
                                                                   ALGORITHM: digest}


def save_deferred(memo_dir: str | os.PathLike) -> None:
    """Write the digests held for ``memo_dir`` now that it exists."""
    key = os.path.abspath(os.fspath(memo_dir))
    with _lock:
        entries = _deferred.pop(key, {})
    for entry in entries.values():
        _write(key, entry["identity"], entry[ALGORITHM])


def file_digest(path: str | os.PathLike, memo_dir: str | os.PathLike | None = None, *,
                save: bool = True) -> str:
    """SHA-256 hex digest of a file's bytes, remembered under its identity.

    Parameters
    ----------
    path : str or path
    memo_dir : str or path, optional
        A directory whose ``digests/`` keeps digests across processes: read
        first, and written when ``save`` (held until :func:`save_deferred`
        while the directory does not exist).
    save : bool
        Whether to write the memo (a caller that writes it only after a
        successful import passes False, then calls again).

    Raises
    ------
    OSError
        The file cannot be opened or read (``FileNotFoundError`` for none).
    """
    abspath = os.path.abspath(os.fspath(path))
    memo = None if memo_dir is None else os.path.abspath(os.fspath(memo_dir))
    with open(abspath, "rb") as f:
        st = os.fstat(f.fileno())
        ident = _identity(abspath, st, _sample(f, st.st_size))
        key = tuple(ident.values())
        with _lock:
            digest = _memo.get(key)
        if digest is None and memo is not None:
            digest = _load(memo, ident)
        if digest is None:
            f.seek(0)
            h = hashlib.new(ALGORITHM)
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
            digest = h.hexdigest()
            after = os.fstat(f.fileno())
            if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != \
                    (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                return digest          # changed while hashed: not remembered
    with _lock:
        _memo[key] = digest
    if memo is not None and save:
        _remember(memo, ident, digest)
    return digest
