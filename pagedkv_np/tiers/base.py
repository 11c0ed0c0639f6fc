"""The tier interface, the page format and the keys of pages below RAM.

A tier is a key/value store of serialized pages with batched
``contains`` / ``get`` / ``put`` (and ``discard`` for entries that failed
verification). Serialization is separate from transport: a tier moves
opaque bytes, :func:`encode_page` and :func:`decode_page` make and check
them, and the cache side (:mod:`pagedkv_np.tiers.manager`) verifies every
decoded page against the request before serving it.

An entry, byte by byte::

    "PKVT" | version u16 | 0 u16 | meta length u32 | payload length u64
    meta:    key, digest, parent digest, tokens, format description
             (each as u32 length + bytes)
    payload: K, V (and their int8 scales) of every layer of the page
    crc32 u32 of everything before it

The CRC detects a truncated, bit-flipped or overwritten entry. It is not a
signature: a tier must be writable only by processes trusted with the
cache's secret (see the README's section on storage tiers).

Keys cannot mix: :func:`page_key` is a BLAKE2b keyed with the cache's hash
secret over the page's chained digest (itself keyed and salted), the salt
again, and a scope naming the format version, the model fingerprint, the
page size, the store dtype and layout and every array's shape. Two caches
share an entry only when all of those agree.
"""

from __future__ import annotations

import abc
import hashlib
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..errors import PagedKVError

__all__ = ["FORMAT_VERSION", "Tier", "TierStats", "TierUnavailable", "CorruptPage",
           "PageFormat", "PageRecord", "encode_page", "decode_page", "page_key", "tier_scope"]

FORMAT_VERSION = 1
MAGIC = b"PKVT"
_HEAD = struct.Struct("<4sHHIQ")
_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")


class CorruptPage(PagedKVError, ValueError):
    """An entry is not a page of this format (bad magic, version, lengths or CRC)."""


class TierUnavailable(PagedKVError, ConnectionError):
    """A tier cannot be reached now (it is retried after a pause)."""


class TierStats:
    """Counters of one tier; every field only grows.

    ``hits``/``misses`` count pages asked for at admission, ``rejected``
    entries that failed verification (never served), ``drops`` pages not
    written (the write queue was full, or an entry larger than the tier),
    ``errors`` failed transport calls (the tier is skipped meanwhile).
    """

    FIELDS = ("hits", "misses", "rejected", "bytes_read", "bytes_written", "pages_written",
              "drops", "errors", "num_reads", "read_seconds", "num_writes", "write_seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                self._values[name] += n

    def __getattr__(self, name: str) -> float:
        values = self.__dict__.get("_values")
        if values is None or name not in values:
            raise AttributeError(name)
        return values[name]

    def as_dict(self) -> dict[str, float]:
        """The counters, with the mean read and write latency in milliseconds."""
        with self._lock:
            d = dict(self._values)
        d["read_ms"] = 1e3 * d["read_seconds"] / d["num_reads"] if d["num_reads"] else 0.0
        d["write_ms"] = 1e3 * d["write_seconds"] / d["num_writes"] if d["num_writes"] else 0.0
        return d


class Tier(abc.ABC):
    """A store of serialized pages under opaque byte keys.

    Implementations raise on a failed transport call (the caller counts it
    and goes on without the tier) and may raise :class:`TierUnavailable`
    without trying while they wait to retry. They never check entries:
    that is :func:`decode_page`'s job.
    """

    name = "tier"
    #: Entries larger than this are neither stored nor read (None: no bound
    #: but the tier's own); the cache sets it to the size of its entries, so
    #: that whatever else sits under a key is never read whole.
    max_entry_bytes: int | None = None

    def __init__(self) -> None:
        self.stats = TierStats()

    @abc.abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has an entry."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The entry of each key, None where there is none (one round trip)."""

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Store ``(key, entry)`` pairs; returns which were stored."""

    def discard(self, keys: Sequence[bytes]) -> None:
        """Remove entries (that failed verification); missing keys are ignored."""

    def close(self) -> None:
        """Release connections and handles."""


@dataclass(frozen=True)
class PageFormat:
    """The arrays one page holds across every layer, as the store lays them out.

    ``parts`` lists ``(shape, dtype)`` of K and V (and, for an int8 store,
    their scales) with the page axis taken out: ``[num_layers, page_size,
    num_kv_heads, head_dim]`` for NHD, ``[num_layers, num_kv_heads,
    page_size, head_dim]`` for HND.
    """

    page_size: int
    layout: str
    dtype: str
    parts: tuple[tuple[tuple[int, ...], np.dtype], ...]

    @classmethod
    def from_store(cls, store: Any) -> PageFormat:
        arrays = [store.k, store.v]
        if store.k_scale is not None:
            arrays += [store.k_scale, store.v_scale]
        parts = tuple(((a.shape[0], *a.shape[2:]), np.dtype(a.dtype)) for a in arrays)
        return cls(store.page_size, store.layout.value, np.dtype(store.dtype).name, parts)

    @property
    def descr(self) -> str:
        """A text naming every field of the format (part of keys and entries)."""
        parts = ";".join(f"{'x'.join(map(str, s))}:{d.name}" for s, d in self.parts)
        return f"v{FORMAT_VERSION};ps={self.page_size};{self.layout};{self.dtype};{parts}"

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * d.itemsize for s, d in self.parts)

    def entry_nbytes(self, key_size: int, digest_size: int) -> int:
        """Bytes of an entry of this format (see :func:`encode_page`), with
        keys of ``key_size`` and digests of ``digest_size`` bytes."""
        meta = 5 * _LEN.size + key_size + 2 * digest_size + 8 * self.page_size + len(self.descr)
        return _HEAD.size + meta + self.nbytes + _CRC.size

    def split(self, payload: memoryview) -> list[np.ndarray]:
        """Read-only arrays over ``payload`` (length :attr:`nbytes`), one per part."""
        out, offset = [], 0
        for shape, dtype in self.parts:
            n = int(np.prod(shape)) * dtype.itemsize
            out.append(np.frombuffer(payload[offset:offset + n], dtype=dtype).reshape(shape))
            offset += n
        return out


@dataclass(frozen=True)
class PageRecord:
    """A decoded entry: what it claims, and its payload (not yet split)."""

    key: bytes
    digest: bytes
    parent_digest: bytes
    tokens: bytes
    descr: str
    payload: memoryview


def _field(b: bytes) -> bytes:
    return _LEN.pack(len(b)) + b


def encode_page(key: bytes, digest: bytes, parent_digest: bytes, tokens: bytes, descr: str,
                arrays: Sequence[np.ndarray]) -> memoryview:
    """Serialize one page (``arrays`` in :attr:`PageFormat.parts` order, any
    strides)."""
    meta = b"".join(_field(f) for f in (key, digest, parent_digest, tokens,
                                         descr.encode("ascii")))
    payload_len = sum(a.nbytes for a in arrays)
    buf = bytearray(_HEAD.size + len(meta) + payload_len + _CRC.size)
    _HEAD.pack_into(buf, 0, MAGIC, FORMAT_VERSION, 0, len(meta), payload_len)
    offset = _HEAD.size
    buf[offset:offset + len(meta)] = meta
    offset += len(meta)
    for a in arrays:      # one (strided) copy of each array, straight into the entry
        dst = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=offset)
        dst.reshape(a.shape)[...] = a
        offset += a.nbytes
    _CRC.pack_into(buf, offset, zlib.crc32(memoryview(buf)[:offset]))
    return memoryview(buf)   # no copy into bytes; files and the redis client take it


def decode_page(blob: Any) -> PageRecord:
    """Parse and check an entry; raises :class:`CorruptPage` when it is not
    one of this format whose CRC holds."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptPage(f"entry is {type(blob).__name__}, not bytes")
    view = memoryview(blob)
    if len(view) < _HEAD.size + _CRC.size:
        raise CorruptPage(f"entry of {len(view)} bytes is shorter than a header")
    magic, version, _, meta_len, payload_len = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptPage("entry does not start with the page magic")
    if version != FORMAT_VERSION:
        raise CorruptPage(f"entry has format version {version}, expected {FORMAT_VERSION}")
    end = _HEAD.size + meta_len + payload_len
    if end + _CRC.size != len(view):
        raise CorruptPage(f"entry is {len(view)} bytes, its header says {end + _CRC.size}")
    (crc,) = _CRC.unpack_from(view, end)
    if zlib.crc32(view[:end]) != crc:
        raise CorruptPage("entry fails its CRC")
    fields, offset = [], _HEAD.size
    for _ in range(5):
        if offset + _LEN.size > _HEAD.size + meta_len:
            raise CorruptPage("entry metadata is cut short")
        (n,) = _LEN.unpack_from(view, offset)
        offset += _LEN.size
        fields.append(bytes(view[offset:offset + n]))
        offset += n
    if offset != _HEAD.size + meta_len:
        raise CorruptPage("entry metadata has a wrong length")
    key, digest, parent, tokens, descr = fields
    return PageRecord(key, digest, parent, tokens, descr.decode("ascii", "replace"),
                      view[offset:end])


def tier_scope(model_id: str, fmt: PageFormat) -> bytes:
    """Digest of what must agree for two caches to share entries: the format
    version, the model fingerprint and the page format."""
    h = hashlib.blake2b(digest_size=32, person=b"pagedkv-scope")
    for part in (model_id.encode("utf-8"), fmt.descr.encode("ascii")):
        h.update(_field(part))
    return h.digest()


def page_key(secret: bytes, scope: bytes, salt_bytes: bytes, digest: bytes) -> bytes:
    """The 20-byte key of a page: keyed BLAKE2b over scope, salt and chained digest."""
    h = hashlib.blake2b(key=secret, digest_size=20, person=b"pagedkv-page")
    h.update(scope)
    h.update(_field(salt_bytes))
    h.update(digest)
    return h.digest()
