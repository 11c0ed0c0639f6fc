"""A GGUF file's header: its metadata and tensor table, read without its data.

:func:`read_header` walks the header (magic, version, key/value pairs, tensor
infos) and checks that every length, count and tensor extent fits in the
file before anything is allocated for it, so that a truncated file or one
whose header lies (an array of 2**60 strings, a tensor past the end) is a
:class:`GGUFFormatError` and not a ``MemoryError`` or a crash later.
Metadata arrays of more than :data:`EAGER_ELEMENTS` elements (the
vocabulary, its scores, types and merges) are not decoded until a caller
asks for them: the check of an architecture, a weight type or the geometry
reads only the few scalars it needs. On Gemma 3's 262,144-token vocabulary
``gguf.GGUFReader`` took 51 s (on a busy 2-core machine) to parse the
header, because it builds objects for every element of every array; this
walk takes a fraction of a second (see :mod:`pagedkv_np.models.gguf.importer`).

Format (little-endian; ggml's ``gguf.md``): ``b"GGUF"``, uint32 version
(2 or 3), uint64 tensor count, uint64 key/value count; each pair is a string
key, a uint32 value type and the value (a string is a uint64 length and
UTF-8 bytes; an array a uint32 element type, a uint64 count and the
elements); each tensor info is a string name, a uint32 dimension count, that
many uint64 dimensions (fastest-varying first), a uint32 ggml type and a
uint64 offset into the data section, which starts at the next multiple of
``general.alignment`` (default 32) after the infos.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConfigError, UnsupportedModelError

try:
    import gguf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("reading GGUF files needs gguf: pip install 'pagedkv-np[models]'") from exc

__all__ = ["GGUFFormatError", "GGUFHeader", "TensorInfo", "Metadata", "read_header",
           "EAGER_ELEMENTS"]

#: metadata arrays longer than this are decoded when first asked for
EAGER_ELEMENTS = 256
_MAGIC = b"GGUF"
_MAX_DIMS = 4                       # GGML_MAX_DIMS
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype)
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
            4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"),
            10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8")}
_BOOL = 7
_U64 = struct.Struct("<Q")
# plain element types of tensors (the rest are ggml blocks, read as bytes)
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFFormatError(UnsupportedModelError):
    """The file is not a readable GGUF file (truncated, corrupt, or its
    metadata contradicts its tensors); the message says what is wrong."""


@dataclass(frozen=True)
class _Array:
    """A metadata array left in the file: ``count`` elements of ``etype`` in
    bytes ``start:end``."""

    etype: int
    count: int
    start: int
    end: int


class Metadata(Mapping):
    """Metadata values by key, as Python values (arrays as lists). Long
    arrays are read from the file when first looked up, then kept."""

    def __init__(self, path: str, values: dict[str, Any]) -> None:
        self._path = path
        self._values = values

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, _Array):
            with open(self._path, "rb") as f:
                f.seek(value.start)
                raw = f.read(value.end - value.start)
            if len(raw) != value.end - value.start:
                raise GGUFFormatError(f"{self._path!r}: metadata {key} is cut short")
            value = _Reader(raw, self._path).array_elements(value.etype, value.count, key)
            self._values[key] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def length(self, key: str) -> int | None:
        """Elements of the array ``key`` without reading it (None: not an array)."""
        value = self._values.get(key)
        if isinstance(value, _Array):
            return value.count
        return len(value) if isinstance(value, list) else None


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    Attributes
    ----------
    name : str
    shape : tuple of int
        ggml order: the fastest-varying dimension first (``[in, out]`` for a
        matrix of ``out`` rows), as ``gguf.ReaderTensor.shape``.
    tensor_type : gguf.GGMLQuantizationType or int
        An int when ggml type id is unknown to the ``gguf`` package.
    offset : int
        Of the first byte, from the start of the file.
    n_bytes : int
        0 for a type whose size is unknown.
    """

    path: str
    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        t = self.tensor_type
        return t.name if isinstance(t, gguf.GGMLQuantizationType) else f"unknown type {t}"

    @property
    def data(self) -> np.ndarray:
        """The tensor read from the file (a copy), shaped as ``gguf.ReaderTensor.data``:
        plain types in NumPy order (``shape`` reversed), blocks as uint8
        ``[..., rows, bytes per row]``."""
        dims = tuple(reversed(self.shape))
        try:
            raw = np.fromfile(self.path, dtype=np.uint8, count=self.n_bytes, offset=self.offset)
        except OSError as exc:
            raise GGUFFormatError(f"{self.path!r}: tensor {self.name!r} cannot be read: "
                                  f"{exc}") from None
        if raw.size != self.n_bytes:
            raise GGUFFormatError(f"{self.path!r}: tensor {self.name!r} is cut short "
                                  f"(the file is truncated)")
        plain = _PLAIN.get(self.type_name)
        if plain is not None:
            return raw.view(plain).reshape(dims)
        rows = dims[:-1] if dims else ()
        return raw.reshape(*rows, -1)


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_header` found."""

    path: str
    version: int
    metadata: Metadata
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int


class _Reader:
    """Little-endian values from a buffer, every read bounds-checked."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path!r} is not a readable GGUF file (truncated or "
                               f"corrupt): {what} at byte {self.pos}")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.size - self.pos:
            raise self.fail(f"{what} runs past the end of the file ({nbytes:,} bytes)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def strings(self, count: int, what: str, decode: bool) -> list[str]:
        """``count`` strings (an empty list when not ``decode``: only skipped);
        one tight loop, bounds checked once at the end, as vocabularies are long."""
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        out: list[str] = []
        append = out.append
        try:
            if decode:
                for _ in range(count):
                    n = unpack(buf, pos)[0]
                    pos += 8
                    append(str(buf[pos:pos + n], "utf-8"))
                    pos += n
            else:
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
        except struct.error:
            raise self.fail(f"{what} runs past the end of the file") from None
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None
        if pos > self.size:
            raise self.fail(f"{what} runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, lazy: bool) -> Any:
        if vtype in _SCALARS:
            value = self.scalar(_SCALARS[vtype][0], what)
            return bool(value) if vtype == _BOOL else value
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has an unknown value type {vtype}")
        etype = self.scalar("<I", what)
        count = self.scalar("<Q", what)
        if etype not in _SCALARS and etype not in (_STRING, _ARRAY):
            raise self.fail(f"{what} is an array of an unknown value type {etype}")
        # every element takes at least one byte (a string eight): bound the count first
        least = _SCALARS[etype][0] if etype in _SCALARS else "<Q"
        self.need(count * struct.calcsize(least), what)
        if not lazy or count <= EAGER_ELEMENTS or etype == _ARRAY:
            return self.array_elements(etype, count, what)
        start = self.pos
        if etype == _STRING:
            self.strings(count, what, decode=False)
        else:
            self.pos += count * struct.calcsize(least)
        return _Array(etype, count, start, self.pos)

    def array_elements(self, etype: int, count: int, what: str) -> list:
        if etype in _SCALARS:
            fmt, dtype = _SCALARS[etype]
            nbytes = count * struct.calcsize(fmt)
            self.need(nbytes, what)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += nbytes
            return values.astype(bool).tolist() if etype == _BOOL else values.tolist()
        if etype == _STRING:
            return self.strings(count, what, decode=True)
        return [self.value(etype, what, lazy=False) for _ in range(count)]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (no tensor data is read).

    Raises
    ------
    ConfigError
        No such file.
    GGUFFormatError
        Not a GGUF file, a truncated or inconsistent header, or a tensor that
        does not fit in the file.
    UnsupportedModelError
        A big-endian file or a GGUF version other than 2 or 3.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"{path!r} is not a readable GGUF file (truncated or "
                                      f"corrupt): {size} bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size)
    except FileNotFoundError:
        raise ConfigError(f"Invalid path: no file {path!r}") from None
    except IsADirectoryError:
        raise ConfigError(f"Invalid path: {path!r} is a directory") from None


def _parse(path: str, buf: Any, size: int) -> GGUFHeader:
    r = _Reader(buf, path)
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFFormatError(f"{path!r} is not a readable GGUF file (truncated or corrupt): "
                              f"it starts with {bytes(buf[:4])!r}, not {_MAGIC!r}")
    r.pos = 4
    version = r.scalar("<I", "version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
            raise UnsupportedModelError(f"{path!r}: big-endian GGUF files are not supported")
        raise UnsupportedModelError(f"{path!r}: GGUF version {version} is not supported "
                                    "(2 or 3 are)")
    num_tensors = r.scalar("<Q", "tensor count")
    num_kv = r.scalar("<Q", "metadata count")
    # a pair takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 4 + 8
    r.need(num_kv * 13 + num_tensors * 24, "the metadata and tensor counts")
    values: dict[str, Any] = {}
    for _ in range(num_kv):
        key = r.string("a metadata key")
        if key in values:
            raise r.fail(f"metadata {key} appears twice")
        vtype = r.scalar("<I", f"metadata {key}")
        values[key] = r.value(vtype, f"metadata {key}", lazy=True)
    alignment = values.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path!r}: metadata general.alignment is {alignment!r}, "
                              "expected a power of two")
    infos = []
    for _ in range(num_tensors):
        name = r.string("a tensor name")
        ndims = r.scalar("<I", f"tensor {name!r}")
        if not 1 <= ndims <= _MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {ndims} dimensions")
        dims = tuple(r.scalar("<Q", f"tensor {name!r}") for _ in range(ndims))
        type_id = r.scalar("<I", f"tensor {name!r}")
        offset = r.scalar("<Q", f"tensor {name!r}")
        infos.append((name, dims, type_id, offset))
    data_offset = -(-r.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"{path!r}: tensor {name!r} appears twice")
        try:
            qtype: Any = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            qtype, block, type_size = type_id, 0, 0
        n_bytes = 0
        if block:
            if dims[0] % block:
                raise GGUFFormatError(f"{path!r}: tensor {name!r} has rows of {dims[0]} "
                                      f"values, not whole {qtype.name} blocks of {block}")
            n_bytes = math.prod(dims) // block * type_size
        start = data_offset + offset
        if offset % alignment or start + n_bytes > size:
            raise GGUFFormatError(
                f"{path!r} is not a readable GGUF file (truncated or corrupt): tensor "
                f"{name!r} ({n_bytes:,} bytes at {start:,}) does not fit in the file of "
                f"{size:,} bytes")
        tensors[name] = TensorInfo(path, name, dims, qtype, start, n_bytes)
    return GGUFHeader(path, version, Metadata(path, values), tensors, data_offset, size)
