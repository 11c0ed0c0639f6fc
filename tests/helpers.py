"""Reference functions shared by the test modules and ``scripts/fuzz.py``.

* :func:`prefix_codes`, :func:`kv_of` and :func:`kv_rows` give the K/V a
  model would write for a token sequence: position ``p`` is a function of
  ``tokens[:p + 1]`` and the layer, as in a real model, where K at ``p``
  depends on every earlier token. A page served under another prefix, or
  gathered from another layer, therefore shows up as a data mismatch, not
  only in the bookkeeping. The values are arbitrary bit patterns (NaN and
  inf included), so compare them with :func:`bits`.
* :func:`deep_state` snapshots everything an object of the library holds,
  for "a failed call changed nothing" checks that do not name internals.

Plain module (no fixtures), so that ``scripts/fuzz.py`` can import it with
``tests/`` on ``sys.path`` as pytest does.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import itertools
import types

import numpy as np

_MASK = (1 << 64) - 1

# The backends built into the package, in the order tests run over them (the
# ``cache_backend`` fixture of conftest.py, which skips an unavailable one).
CACHE_BACKENDS = ("numpy", "numba", "cupy")


# ----------------------------------------------------------- K/V of a prefix
def prefix_codes(tokens) -> np.ndarray:
    """uint64 [n]: code[p] depends on tokens[0..p] (order and values)."""
    h, out = 0xCBF29CE484222325, []
    for t in tokens:
        h = ((h ^ int(t)) * 0x100000001B3) & _MASK
        h ^= h >> 29
        out.append(h)
    return np.array(out, dtype=np.uint64)


def kv_of(codes: np.ndarray, layer: int, num_kv_heads: int, head_dim: int,
          dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the positions whose prefix codes are ``codes``.

    Parameters
    ----------
    codes : np.ndarray
        shape [n], dtype uint64, from :func:`prefix_codes`.
    layer : int
        The layer; each layer gets its own disjoint set of lanes.
    num_kv_heads, head_dim : int
        Shape of one position's K (and V).
    dtype : numpy dtype
        Any 2- or 4-byte dtype (float16, bfloat16, float32).

    Returns
    -------
    k, v : np.ndarray
        shape [n, num_kv_heads, head_dim], dtype ``dtype``: K from the high
        bits of a 64-bit mix, V from its low bits.
    """
    dtype = np.dtype(dtype)
    uint = {2: np.uint16, 4: np.uint32}[dtype.itemsize]
    lanes = np.arange(num_kv_heads * head_dim, dtype=np.uint64).reshape(num_kv_heads, head_dim)
    offset = np.uint64(layer * num_kv_heads * head_dim + 1)
    grid = (codes[:, None, None] * np.uint64(0x9E3779B97F4A7C15)
            + (lanes + offset) * np.uint64(0xBF58476D1CE4E5B9))
    k = (grid >> np.uint64(64 - 8 * dtype.itemsize)).astype(uint)
    v = grid.astype(uint)  # the low bits: a cast from uint64 wraps
    return k.view(dtype), v.view(dtype)


def kv_rows(tokens, lo: int, hi: int, layer: int, num_kv_heads: int, head_dim: int,
            dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """K and V, each [hi - lo, num_kv_heads, head_dim] of ``dtype``, of
    positions ``lo .. hi - 1`` of ``tokens`` (see :func:`kv_of`)."""
    codes = prefix_codes(list(tokens)[:hi])[lo:hi]
    return kv_of(codes, layer, num_kv_heads, head_dim, dtype)


def common_prefix(a, b) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def bits(x: np.ndarray) -> np.ndarray:
    """``x`` as unsigned integers of its width, for bit-exact comparisons."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ------------------------------------------------------------------ snapshot
def deep_state(x, _stack: frozenset = frozenset()):
    """A comparable copy of everything ``x`` holds.

    Objects of pagedkv_np are walked attribute by attribute (slots and
    ``__dict__``), so the snapshot follows the library's internals without
    naming them; arrays are reduced to a digest of their bytes; locks are
    skipped, functions kept by name and foreign objects (sessions, random
    generators) by identity.
    """
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return x
    if isinstance(x, (bytearray, memoryview)):
        return bytes(x)
    if isinstance(x, np.ndarray):
        data = np.ascontiguousarray(x).view(np.uint8).tobytes()
        return ("ndarray", x.dtype.str, x.shape, x.flags.writeable,
                hashlib.sha256(data).hexdigest())
    if isinstance(x, (np.generic, enum.Enum, itertools.count)):
        return repr(x)
    if isinstance(x, (list, tuple, collections.deque)):
        return tuple(deep_state(v, _stack) for v in x)
    if isinstance(x, dict):
        return {repr(k): deep_state(v, _stack) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return tuple(sorted(map(repr, x)))
    module = type(x).__module__ or ""
    if module in ("_thread", "threading"):
        return "lock"
    if isinstance(x, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return ("callable", getattr(x, "__qualname__", repr(x)))
    if not module.startswith("pagedkv_np"):
        return ("foreign", type(x).__name__, id(x))
    if id(x) in _stack:
        return ("cycle", type(x).__name__)
    inner = _stack | {id(x)}
    names = [n for c in type(x).__mro__ for n in getattr(c, "__slots__", ())]
    names += list(getattr(x, "__dict__", {}))
    state = {"__type__": type(x).__name__}
    for name in names:
        if hasattr(x, name):
            state[name] = deep_state(getattr(x, name), inner)
    return state


def full_recompute_logits(session, tokens) -> np.ndarray:
    """Last-position logits of ``tokens`` run whole through an onnxruntime
    decoder ``session`` with an empty past: the no-cache reference of the
    engine tests."""
    n = len(tokens)
    feeds = {"input_ids": np.array([list(tokens)], np.int64),
             "attention_mask": np.ones((1, n), np.int64)}
    for arg in session.get_inputs():
        if arg.name == "position_ids":
            feeds[arg.name] = np.arange(n, dtype=np.int64)[None]
        elif arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
        elif arg.name == "num_logits_to_keep":   # 0: every position
            feeds[arg.name] = np.zeros(1, np.int64)
    return session.run(["logits"], feeds)[0][0, -1]


# ------------------------------------------------------ a model folder's graph
class FolderSession:
    """onnxruntime's session of a model folder's ``model.onnx`` whose ``run``
    also answers ``"logits"`` for a graph that leaves its LM head to the
    engine (``hidden`` output, ``lm_head.npz``): the engine's own
    :class:`~pagedkv_np.onnxruntime.head.BlockHead` over the hidden states,
    so that a test's NumPy reference checks the head too."""

    def __init__(self, folder) -> None:
        import pathlib

        import onnxruntime as ort

        from pagedkv_np.models.head_file import HEAD_FILE
        from pagedkv_np.onnxruntime.head import BlockHead

        folder = pathlib.Path(folder)
        self.session = ort.InferenceSession(str(folder / "model.onnx"),
                                            providers=["CPUExecutionProvider"])
        names = {o.name for o in self.session.get_outputs()}
        self.head = BlockHead(folder / HEAD_FILE) if "logits" not in names else None

    def get_inputs(self):
        return self.session.get_inputs()

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, names, feeds):
        if self.head is None or "logits" not in names:
            return self.session.run(names, feeds)
        asked = ["hidden" if n == "logits" else n for n in names]
        outs = self.session.run(asked, feeds)
        return [self.head(o) if n == "logits" else o for n, o in zip(names, outs)]
