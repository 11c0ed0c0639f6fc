"""The disk tier: one file per page in a directory that outlives the process.

Why files and not SQLite: for pages of a real model (737 KB for
SmolLM2-135M at 16 tokens a page, float32) files written whole and renamed
into place wrote 2-9x and read 1.4-3.4x faster than BLOBs in an SQLite
table in WAL mode on these machines, over five runs (``scripts/bench_tiers.py
store``), and a rename is as atomic as a transaction for one entry.

How it stays correct with several processes on one directory, and after a
``kill -9``:

- an entry is written to a temporary name unique to the process and thread,
  then ``os.replace``-d onto its key's name, so a reader sees a whole entry
  or none; two writers of one key both write whole entries, the last wins;
- temporary files left by a killed writer are never read, and are removed
  by the next trim once they are a minute old;
- whatever a file holds is checked by :func:`~pagedkv_np.tiers.base.decode_page`
  and the cache before use, so a torn or flipped entry is dropped, never
  served (entries are not fsynced for that reason: a power cut costs
  misses, never a wrong page).

How it stays inside its directory, whatever else writes there: every path
is walked from a descriptor of ``pages-v1/``, one component at a time and
with ``O_NOFOLLOW``, so a symbolic link is never followed (a linked shard
directory is replaced by a real one before a write); only a regular file
of at most one entry's size is read, opened with ``O_NONBLOCK`` and checked
by ``fstat`` first, so a FIFO, a device, a socket or a directory at an
entry's name is a miss that neither blocks nor reads without end.

The directory is bounded in bytes with LRU eviction: a read touches the
file's modification time, and a trim (in the writer thread, when this
process's running estimate passes the bound or every ``TRIM_EVERY`` puts,
which also catches other processes' writes) lists the entries and deletes
the least recently used until the total is at most 90% of the bound.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import ConfigError, DTypeError
from ..checks import check_positive_int
from .base import Tier

__all__ = ["DiskTier", "DEFAULT_DISK_BYTES", "read_regular", "write_whole"]

DEFAULT_DISK_BYTES = 4 << 30
TRIM_EVERY = 64
STALE_TMP_SECONDS = 60.0
_SUFFIX = ".page"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def read_regular(dir_fd: int, name: str, max_bytes: int, touch: bool = False) -> bytes | None:
    """The bytes of the regular file ``name`` in the directory ``dir_fd``.

    None when there is no such file of at most ``max_bytes``: missing,
    unreadable, a symbolic link, a FIFO, a device, a socket, a directory or
    larger. Never follows a link, never blocks on a FIFO or a device, reads
    at most the size ``fstat`` gave. ``touch`` sets its modification time.
    """
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return None           # not even opened: opening a device can act on it
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)         # what was opened, if replaced since the stat
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        parts, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:         # truncated meanwhile: the entry's checks reject it
                break
            parts.append(chunk)
            left -= len(chunk)
        if touch:
            try:
                os.utime(fd)      # most recently used
            except OSError:       # a read-only file system
                pass
        return parts[0] if len(parts) == 1 else b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_whole(dir_fd: int, name: str, data: bytes | memoryview, tag: str,
                replace: bool = True, sync: bool = False) -> None:
    """Make ``name`` in the directory ``dir_fd`` hold ``data``, whole or not at all.

    ``data`` goes to ``name.<tag>.tmp`` beside it first, then is renamed
    over ``name`` (``replace``) or linked to it only if there is none (else
    :class:`FileExistsError`). ``sync`` flushes the file before the rename
    and the directory after it. Raises OSError, with nothing left behind,
    when a write fails (a full disk, a link where the temporary file goes).
    """
    tmp = f"{name}.{tag}.tmp"
    try:
        fd = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:   # left by a killed process whose pid and thread id were ours
        os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                        follow_symlinks=False)
            except FileExistsError:
                raise
            except OSError:       # no hard links here: a rename is the next best thing
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if not replace:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
    if sync:
        os.fsync(dir_fd)


def _open_dir(name: str, dir_fd: int | None = None, create: bool = False) -> int | None:
    """A descriptor of the directory ``name``, never through a symbolic link.

    None when it is missing or not a directory. With ``create``, a missing
    one is made and a symbolic link there is replaced by a real directory
    (the link is ours to remove: it is inside the tier's own directory).
    """
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if not create or not stat.S_ISLNK(
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return None
        os.unlink(name, dir_fd=dir_fd)
    try:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    except FileExistsError:
        pass
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


class DiskTier(Tier):
    """Pages as files under ``directory/pages-v1/``.

    Parameters
    ----------
    directory : str or path
        Created if missing (with its parents); must be writable.
    max_bytes : int
        Bound on the bytes of all entries together.
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_DISK_BYTES
                 ) -> None:
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)):
            raise DTypeError(f"Invalid disk_cache: expected a directory path, got "
                             f"{type(directory).__name__}")
        self.max_bytes = check_positive_int(max_bytes, "disk_cache_bytes")
        self.directory = os.path.abspath(os.fspath(directory))
        self.root = os.path.join(self.directory, "pages-v1")
        if not os.fspath(directory):
            raise ConfigError("Invalid disk_cache: empty path")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with self._root() as root_fd:    # made, or a link there replaced
                assert root_fd is not None     # _root(create=True) raises instead
                write_whole(root_fd, ".probe", b"", self._tag())
                os.unlink(".probe", dir_fd=root_fd)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"Invalid disk_cache: {self.directory!r} is not a writable "
                              f"directory ({exc})") from None
        self._lock = threading.Lock()
        self._estimate = self._trim()
        self._num_puts = 0

    @contextmanager
    def _root(self, create: bool = True) -> Iterator[int | None]:
        """A descriptor of ``pages-v1/`` (None when missing and not ``create``)."""
        fd = _open_dir(self.root, create=create)
        if fd is None and create:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.root)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextmanager
    def _shards(self, create: bool) -> Iterator[Callable[[bytes], tuple[int | None, str]]]:
        """A function of a key giving its shard directory's descriptor (None:
        there is none, or it cannot be made) and its file name; the
        descriptors are closed on exit."""
        shards: dict[str, int | None] = {}
        with self._root(create) as root_fd:
            def locate(key: bytes) -> tuple[int | None, str]:
                h = key.hex()
                shard = h[:2]
                if shard not in shards:
                    try:
                        shards[shard] = None if root_fd is None else _open_dir(
                            shard, root_fd, create)
                    except OSError:
                        shards[shard] = None
                return shards[shard], h + _SUFFIX
            try:
                yield locate
            finally:
                for fd in shards.values():
                    if fd is not None:
                        os.close(fd)

    def _path(self, key: bytes) -> str:
        """Where the entry of ``key`` is (for a reader of the directory; the
        tier itself walks it from descriptors)."""
        h = key.hex()
        return os.path.join(self.root, h[:2], h + _SUFFIX)

    @staticmethod
    def _tag() -> str:
        return f"{os.getpid()}.{threading.get_ident()}"

    def _entry_bound(self) -> int:
        bound = self.max_entry_bytes
        return self.max_bytes if bound is None else min(bound, self.max_bytes)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        bound, out = self._entry_bound(), []
        with self._shards(create=False) as locate:
            for key in keys:
                shard_fd, name = locate(key)
                try:
                    st = None if shard_fd is None else os.stat(name, dir_fd=shard_fd,
                                                               follow_symlinks=False)
                except OSError:
                    st = None
                out.append(st is not None and stat.S_ISREG(st.st_mode)
                           and st.st_size <= bound)
        return out

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        bound, out = self._entry_bound(), []
        with self._shards(create=False) as locate:
            for key in keys:
                shard_fd, name = locate(key)
                out.append(None if shard_fd is None
                           else read_regular(shard_fd, name, bound, touch=True))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Write entries; one that cannot be written (a full disk, something
        not a directory where its shard goes) is not stored and counts in
        ``errors``."""
        stored = []
        tag, bound = self._tag(), self._entry_bound()
        with self._shards(create=True) as locate:
            for key, blob in items:
                if len(blob) > bound:
                    stored.append(False)
                    continue
                shard_fd, name = locate(key)
                try:
                    if shard_fd is None:
                        raise NotADirectoryError(errno.ENOTDIR, "no shard directory")
                    write_whole(shard_fd, name, blob, tag)
                except OSError:
                    self.stats.add(errors=1)
                    stored.append(False)
                    continue
                stored.append(True)
                with self._lock:
                    self._estimate += len(blob)
                    self._num_puts += 1
                    trim = self._estimate > self.max_bytes or self._num_puts % TRIM_EVERY == 0
                if trim:
                    total = self._trim()
                    with self._lock:
                        self._estimate = total
        return stored

    def discard(self, keys: Sequence[bytes]) -> None:
        with self._shards(create=False) as locate:
            for key in keys:
                shard_fd, name = locate(key)
                if shard_fd is not None:
                    try:
                        os.unlink(name, dir_fd=shard_fd)
                    except FileNotFoundError:
                        pass

    @property
    def num_bytes(self) -> int:
        """Bytes of the entries on disk now (lists the directory)."""
        return sum(size for _, size, _, _ in self._entries())

    def _entries(self) -> list[tuple[int, int, str, str]]:
        """(mtime_ns, size, shard, name) of every entry (a regular file in a
        shard directory that is no link); removes stale temporary files."""
        out: list[tuple[int, int, str, str]] = []
        now = time.time()
        with self._root(create=False) as root_fd:
            if root_fd is None:
                return out
            for sub in list(os.scandir(root_fd)):
                try:
                    shard_fd = _open_dir(sub.name, root_fd)
                except OSError:
                    continue
                if shard_fd is None:
                    continue
                try:
                    for entry in list(os.scandir(shard_fd)):
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if entry.name.endswith(_SUFFIX):
                            if stat.S_ISREG(st.st_mode):
                                out.append((st.st_mtime_ns, st.st_size, sub.name, entry.name))
                        elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                            try:
                                os.unlink(entry.name, dir_fd=shard_fd)
                            except OSError:
                                pass
                finally:
                    os.close(shard_fd)
        return out

    def _trim(self) -> int:
        """Delete least recently used entries down to 90% of the bound; the
        bytes left."""
        entries = self._entries()
        total = sum(size for _, size, _, _ in entries)
        if total <= self.max_bytes:
            return total
        entries.sort()
        target = int(0.9 * self.max_bytes)
        with self._root(create=False) as root_fd:
            for _, size, shard, name in entries:
                if total <= target:
                    break
                try:
                    shard_fd = None if root_fd is None else _open_dir(shard, root_fd)
                except OSError:
                    shard_fd = None
                if shard_fd is not None:
                    try:
                        os.unlink(name, dir_fd=shard_fd)
                    except FileNotFoundError:
                        pass   # another process trimmed it
                    finally:
                        os.close(shard_fd)
                total -= size
        return total

    def __repr__(self) -> str:
        return f"DiskTier({self.directory!r}, max_bytes={self.max_bytes})"
