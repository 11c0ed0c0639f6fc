"""A catalogue of malformed calls to every public entry point.

Each case is one call with one bad argument (wrong shape, dtype, strides or
array kind, a page id out of range, a length past what was reserved, a
released or foreign sequence, an exhausted pool, a token id that is not an
integer, ...). One parametrized test runs every case against a populated
world (a :class:`PagedKVCache` with live, released, evictable and forked
state, a second cache for foreign objects, and a seed-compatible
:class:`PagedCache`) and checks the library's promise: the call raises a
subclass of :class:`PagedKVError` whose message names the bad argument, and
the pool, prefix index, K/V store and sequences are exactly as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest

import pagedkv_np as pk
from pagedkv_np.errors import (
    ConfigError,
    DTypeError,
    LayoutError,
    OutOfPages,
    PagedKVError,
    PageIdError,
    PageStateError,
    SequenceError,
    ShapeError,
    StalePlanError,
)
from pagedkv_np.pool import PagePool
from pagedkv_np.prefix import PrefixIndex

from helpers import CACHE_BACKENDS, deep_state

try:
    from pagedkv_np.onnxruntime import OrtDecoder, RequestNotFound
    from pagedkv_np.models.testmodel import build_model
except ImportError:  # the onnx extra is not installed: no OrtDecoder cases
    OrtDecoder = None

NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 16, 4, 2, 3
SECRET = b"malformed-catalogue-secret"

# Backends whose K/V arrays are host NumPy arrays: the engine runs only on
# these, and only their arrays have a read-only flag.
CPU_BACKENDS = ("numpy", "numba")


# --------------------------------------------------------------------- world
_ORT_MODEL: list[bytes] = []


def _ort_model() -> bytes:
    """The small test decoder (vocabulary 256), built once per session."""
    if not _ORT_MODEL:
        _ORT_MODEL.append(build_model().SerializeToString())
    return _ORT_MODEL[0]


def _kv(num_rows: int, seed: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_rows, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)


def _add_and_write(cache: pk.PagedKVCache, prompt, seed: int, salt=None) -> pk.Sequence:
    seq = cache.add_sequence(prompt, salt=salt)
    cache.extend(seq, list(prompt)[seq.num_cached_tokens:])
    plan = cache.plan([seq])
    for layer in range(cache.num_layers):
        n = plan.num_new_tokens
        cache.write(layer, plan, _kv(n, seed + layer), _kv(n, seed + 100 + layer))
    return seq


class World:
    """Populated caches that every case runs against (built fresh per case),
    with a float32 or an int8 store."""

    def __init__(self, backend: str, dtype: str = "float32") -> None:
        self.backend = pk.get_backend(backend)
        c = self.cache = pk.PagedKVCache(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS,
                                         HEAD_DIM, backend=backend, hash_secret=SECRET,
                                         dtype=dtype)
        self.a = _add_and_write(c, list(range(1, 11)), seed=1)          # 3 pages
        gone = _add_and_write(c, list(range(50, 59)), seed=2)
        c.release(gone)                                                   # 2 evictable pages
        self.b = _add_and_write(c, list(range(1, 9)) + [77, 78], seed=3)  # shares 2 of a's
        self.child = c.fork(self.b)                                       # shares all of b's
        self.released = _add_and_write(c, [9, 9], seed=4)
        self.stale_plan = c.plan([self.released])   # stale: its sequence is released
        c.release(self.released)
        self.unplanned = c.add_sequence([5, 5, 5])
        c.extend(self.unplanned, [5, 5, 5])                               # reserved, not planned
        # Last: a current plan with no new tokens, so nothing is pending.
        self.plan = c.plan([self.a, self.b])

        self.other = pk.PagedKVCache(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS,
                                     HEAD_DIM, backend=backend, hash_secret=SECRET, dtype=dtype)
        self.foreign_seq = _add_and_write(self.other, [1, 2, 3], seed=5)
        self.foreign_plan = self.other.plan([self.foreign_seq])

        pool = c.pool
        self.free_page = next(p for p in range(NUM_PAGES) if pool.state(p) == 0)
        self.evictable_page = pool.lru_order()[0]   # the world has evictable pages
        self.shared_page = self.a.page_ids[0]                             # ref count 3

        pc = self.pc = pk.PagedCache(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS,
                                     HEAD_DIM, backend=backend, hash_secret=SECRET)
        self.pc_pages = pc.alloc_n(3)
        self.pc_table = np.array([self.pc_pages], dtype=np.int32)
        self.pc_tokens = list(range(100, 112))
        k4 = _kv(12, 6).reshape(1, 12, NUM_KV_HEADS, HEAD_DIM)
        for layer in range(NUM_LAYERS):
            pc.write(layer, self.pc_table, 0, self.backend.asarray(k4),
                     self.backend.asarray(k4 + 1))
        pc.record_page(self.pc_pages[0], self.pc_tokens, 0)
        pc.record_page(self.pc_pages[1], self.pc_tokens, 1)
        self.pc_free_page = NUM_PAGES - 1
        self.view = pc.bind(self.pc_table)

    # Arrays for calls that need a well-formed argument next to a bad one:
    # K/V rows for PagedKVCache.write and the backend's write are host arrays
    # (every backend takes them); PagedCache data and ``out`` buffers are
    # arrays of the backend.
    def rows(self, n: int, dtype=np.float32) -> np.ndarray:
        return np.zeros((n, NUM_KV_HEADS, HEAD_DIM), dtype=dtype)

    def batch(self, b: int, t: int, dtype=np.float32) -> Any:
        return self.backend.zeros((b, t, NUM_KV_HEADS, HEAD_DIM), np.dtype(dtype))

    def out(self, b: int, t: int, dtype=np.float32, layout="BHTD"):
        shape = ((b, NUM_KV_HEADS, t, HEAD_DIM) if layout == "BHTD"
                 else (b, t, NUM_KV_HEADS, HEAD_DIM))
        return tuple(self.backend.zeros(shape, np.dtype(dtype)) for _ in "kv")

    def i32(self, *values) -> np.ndarray:
        return np.array(values, dtype=np.int32)

    def be_write(self, **kw):
        args = dict(k_cache=self.cache.store.k, v_cache=self.cache.store.v, layer=0,
                    slot_mapping=self.i32(self.free_page * PAGE_SIZE), k=self.rows(1),
                    v=self.rows(1), layout=self.cache.layout)
        store = self.cache.store
        if store.quant is not None:
            args.update(k_scale=store.k_scale, v_scale=store.v_scale)
        args.update(kw)
        layout = args.pop("layout")
        if store.quant is not None:
            return self.backend.write_quantized(
                *[args.pop(n) for n in ("k_cache", "v_cache", "k_scale", "v_scale", "layer",
                                        "slot_mapping", "k", "v")], layout=layout)
        return self.backend.write(*[args.pop(n) for n in ("k_cache", "v_cache", "layer",
                                                          "slot_mapping", "k", "v")],
                                  layout=layout)

    def be_gather(self, **kw):
        args = dict(k_cache=self.cache.store.k, v_cache=self.cache.store.v, layer=0,
                    page_table=np.array([[self.a.page_ids[0]]], np.int32),
                    seq_lens=self.i32(PAGE_SIZE), layout=self.cache.layout)
        store = self.cache.store
        if store.quant is not None:
            args.update(k_scale=store.k_scale, v_scale=store.v_scale)
        args.update(kw)
        if store.quant is not None:
            pos = [args.pop(n) for n in ("k_cache", "v_cache", "k_scale", "v_scale", "layer",
                                         "page_table", "seq_lens")]
            return self.backend.gather_quantized(*pos, **args)
        pos = [args.pop(n) for n in ("k_cache", "v_cache", "layer", "page_table", "seq_lens")]
        return self.backend.gather(*pos, **args)

    def be_copy(self, src, dst, **kw):
        return self.backend.copy_pages(self.cache.store.k, self.cache.store.v, src, dst,
                                       layout=self.cache.layout, **kw)

    def new_store(self, **kw):
        args = dict(num_pages=4, backend=self.backend)
        args.update(kw)
        sizes = [args.pop(n, d) for n, d in (("num_layers", 1), ("page_size", PAGE_SIZE),
                                             ("num_kv_heads", NUM_KV_HEADS),
                                             ("head_dim", HEAD_DIM))]
        return pk.KVStore(*sizes, **args)

    def new_cache(self, **kw):
        args = dict(num_layers=1, num_pages=4, page_size=PAGE_SIZE, num_kv_heads=1,
                    head_dim=2, backend=self.backend.name)
        args.update(kw)
        pos = [args.pop(n) for n in ("num_layers", "num_pages", "page_size", "num_kv_heads",
                                     "head_dim")]
        return pk.PagedKVCache(*pos, **args)

    def exhaust_pc(self):
        self.pc.alloc_n(self.pc.pool.num_available)

    def make_ort(self):
        """An OrtDecoder with one finished and one running request."""
        d = self.ort = OrtDecoder(_ort_model(), num_pages=16, page_size=PAGE_SIZE,
                                  max_batch_size=2, backend=self.backend.name)
        self.ort_done = d.add_request([1, 2, 3], 1)
        self.ort_running = d.add_request([4, 5, 6, 7, 8], 6)
        d.step()


# ------------------------------------------------------------------ snapshot
def snapshot(world: World) -> dict:
    """Everything a failed call must leave untouched."""
    state = {name: deep_state(getattr(world, name))
             for name in ("cache", "other", "released", "pc", "ort") if hasattr(world, name)}
    # deep_state sees a device array by identity only: the stores' contents
    # are compared as host copies too.
    host = world.backend.to_numpy
    arrays = {"pc": (world.pc.k_cache, world.pc.v_cache)}
    for name in ("cache", "other"):
        store = getattr(world, name).store
        arrays[name] = tuple(x for x in (store.k, store.v, getattr(store, "k_scale", None),
                                         getattr(store, "v_scale", None)) if x is not None)
    state["store contents"] = deep_state({name: [host(x) for x in xs]
                                          for name, xs in arrays.items()})
    return state


def _diff(before, after, path: str = "") -> list[str]:
    """Paths (attribute by attribute) where two snapshots differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in before.keys() | after.keys():
            out += _diff(before.get(key), after.get(key), f"{path}/{key}")
        return out
    return [] if before == after else [path or "/"]


# --------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[World], Any]
    error: type | tuple[type, ...]
    names: str                      # the argument the message must name
    prepare: Callable[[World], Any] | None = None   # runs before the snapshot
    dtypes: tuple[str, ...] = ("float32", "int8")   # store dtypes of the worlds it runs in
    backends: tuple[str, ...] = CACHE_BACKENDS      # backends of the worlds it runs in


_F = ("float32",)   # only meaningful for a float store
_Q = ("int8",)      # only for an int8 store
_CPU = CPU_BACKENDS  # only for host arrays (a read-only flag), or the engine


def _ro(a: np.ndarray) -> np.ndarray:
    a = a.view()
    a.flags.writeable = False
    return a


def _scale_view(w: World, which: str, t: int) -> np.ndarray:
    """A float32 [1, t, H, D] array over the memory of a scale array."""
    scales = getattr(w.cache.store, which)
    return scales.reshape(-1)[:t * NUM_KV_HEADS * HEAD_DIM].reshape(1, t, NUM_KV_HEADS, HEAD_DIM)


def _noncontig_out(w: World, t: int):
    big = w.backend.zeros((1, NUM_KV_HEADS, 2 * t, HEAD_DIM), np.dtype(np.float32))
    return big[:, :, ::2], w.backend.zeros((1, NUM_KV_HEADS, t, HEAD_DIM), np.dtype(np.float32))


C = Case
CASES: list[Case] = [
    # ---------------------------------------------------------------- PagePool
    C("pool-ctor-zero", lambda w: PagePool(0), ConfigError, "num_pages"),
    C("pool-ctor-float", lambda w: PagePool(4.0), DTypeError, "num_pages"),
    C("pool-ctor-bool", lambda w: PagePool(True), DTypeError, "num_pages"),
    C("pool-allocate-negative", lambda w: w.cache.pool.allocate(-1), ConfigError, "num"),
    C("pool-allocate-float", lambda w: w.cache.pool.allocate(1.5), DTypeError, "num"),
    C("pool-allocate-str", lambda w: w.cache.pool.allocate("2"), DTypeError, "num"),
    C("pool-allocate-exhausted",
      lambda w: w.cache.pool.allocate(w.cache.pool.num_available + 1), OutOfPages, "page"),
    C("pool-free-out-of-range", lambda w: w.cache.pool.free([NUM_PAGES]), PageIdError, "page_ids"),
    C("pool-free-negative", lambda w: w.cache.pool.free([-1]), PageIdError, "page_ids"),
    C("pool-free-free-page", lambda w: w.cache.pool.free([w.free_page]),
      PageStateError, "page_ids"),
    C("pool-free-more-than-refs", lambda w: w.cache.pool.free([w.shared_page] * 4),
      PageStateError, "page_ids"),
    C("pool-free-valid-then-invalid",
      lambda w: w.cache.pool.free([w.a.page_ids[-1], NUM_PAGES + 3]), PageIdError, "page_ids"),
    C("pool-free-scalar", lambda w: w.cache.pool.free(3), DTypeError, "page_ids"),
    C("pool-free-str", lambda w: w.cache.pool.free("12"), DTypeError, "page_ids"),
    C("pool-free-float-ids", lambda w: w.cache.pool.free([1.0]), DTypeError, "page_ids"),
    C("pool-free-none-id", lambda w: w.cache.pool.free([None]), DTypeError, "page_ids"),
    C("pool-free-numpy-out-of-range", lambda w: w.cache.pool.free(np.array([NUM_PAGES])),
      PageIdError, "page_ids"),
    C("pool-inc-ref-free-page", lambda w: w.cache.pool.inc_ref([w.free_page]),
      PageStateError, "page_ids"),
    C("pool-inc-ref-evictable-then-free",
      lambda w: w.cache.pool.inc_ref([w.evictable_page, w.free_page]), PageStateError, "page_ids"),
    C("pool-touch-out-of-range", lambda w: w.cache.pool.touch(NUM_PAGES), PageIdError, "page_id"),
    C("pool-mark-cached-free-page", lambda w: w.cache.pool.mark_cached(w.free_page),
      PageStateError, "page_id"),
    C("pool-ref-count-float", lambda w: w.cache.pool.ref_count(np.float64(1)),
      DTypeError, "page_id"),
    # ------------------------------------------------------------- PrefixIndex
    C("index-ctor-page-size-zero", lambda w: PrefixIndex(0), ConfigError, "page_size"),
    C("index-ctor-secret-str", lambda w: PrefixIndex(4, secret="key"), ConfigError, "secret"),
    C("index-ctor-secret-too-long", lambda w: PrefixIndex(4, secret=bytes(65)),
      ConfigError, "secret"),
    C("index-ctor-secret-empty", lambda w: PrefixIndex(4, secret=b""), ConfigError, "secret"),
    C("index-ctor-hash-fn-not-callable", lambda w: PrefixIndex(4, hash_fn=5),
      DTypeError, "hash_fn"),
    C("index-lookup-salt-float", lambda w: w.cache.index.lookup(bytes(8 * PAGE_SIZE), PAGE_SIZE,
                                                                  1, salt=1.5),
      DTypeError, "salt"),
    C("index-lookup-str-bytes", lambda w: w.cache.index.lookup("abcd" * 8, PAGE_SIZE, 1),
      DTypeError, "token_bytes"),
    C("index-lookup-negative-num-tokens",
      lambda w: w.cache.index.lookup(bytes(16 * PAGE_SIZE), -5, 1), ConfigError, "num_tokens"),
    C("index-register-partial-page",
      lambda w: w.cache.index.register(w.free_page, b"d" * 16, bytes(8), ("root", b"")),
      ConfigError, "tokens"),
    C("index-register-page-id-str",
      lambda w: w.cache.index.register("x", b"d" * 16, bytes(8 * PAGE_SIZE), ("root", b"")),
      DTypeError, "page_id"),
    # ----------------------------------------------------------------- KVStore
    C("store-layers-zero", lambda w: w.new_store(num_layers=0), ConfigError, "num_layers"),
    C("store-head-dim-float", lambda w: w.new_store(head_dim=3.0), DTypeError, "head_dim"),
    C("store-dtype-int16", lambda w: w.new_store(dtype="int16"), DTypeError, "dtype"),
    C("store-dtype-uint8", lambda w: w.new_store(dtype=np.uint8), DTypeError, "dtype"),
    C("store-dtype-float64", lambda w: w.new_store(dtype=np.float64), DTypeError, "dtype"),
    C("store-layout-unknown", lambda w: w.new_store(layout="NTHD"), LayoutError, "layout"),
    C("store-both-sizes", lambda w: w.new_store(memory_bytes=10**6), ConfigError, "num_pages"),
    C("store-no-size", lambda w: w.new_store(num_pages=None), ConfigError, "memory_bytes"),
    C("store-memory-too-small", lambda w: w.new_store(num_pages=None, memory_bytes=8),
      ConfigError, "memory_bytes"),
    C("store-slots-overflow-int32", lambda w: w.new_store(num_pages=2**31 // PAGE_SIZE),
      ConfigError, "num_pages"),
    C("store-backend-not-a-backend", lambda w: w.new_store(backend=42),
      (ConfigError, DTypeError), "backend"),
    # --------------------------------------------------------- backend.write
    C("be-write-layer-out-of-range", lambda w: w.be_write(layer=NUM_LAYERS), PageIdError, "layer"),
    C("be-write-layer-negative", lambda w: w.be_write(layer=-1), PageIdError, "layer"),
    C("be-write-layer-float", lambda w: w.be_write(layer=0.0), DTypeError, "layer"),
    C("be-write-slots-int64", lambda w: w.be_write(slot_mapping=np.array([0], np.int64)),
      DTypeError, "slot_mapping"),
    C("be-write-slots-list", lambda w: w.be_write(slot_mapping=[0]), DTypeError, "slot_mapping"),
    C("be-write-slots-2d", lambda w: w.be_write(slot_mapping=np.zeros((1, 1), np.int32)),
      ShapeError, "slot_mapping"),
    C("be-write-slot-out-of-range", lambda w: w.be_write(slot_mapping=w.i32(NUM_PAGES * PAGE_SIZE)),
      PageIdError, "slot_mapping"),
    C("be-write-slot-minus-two", lambda w: w.be_write(slot_mapping=w.i32(-2)),
      PageIdError, "slot_mapping"),
    C("be-write-slot-duplicate", lambda w: w.be_write(slot_mapping=w.i32(5, 5), k=w.rows(2),
                                                      v=w.rows(2)),
      PageIdError, "slot_mapping"),
    C("be-write-k-wrong-heads",
      lambda w: w.be_write(k=np.zeros((1, NUM_KV_HEADS + 1, HEAD_DIM), np.float32)),
      ShapeError, "k"),
    C("be-write-k-more-rows-than-slots", lambda w: w.be_write(k=w.rows(2), v=w.rows(2)),
      ShapeError, "k"),
    C("be-write-v-float16", lambda w: w.be_write(v=w.rows(1, np.float16)), DTypeError, "v"),
    C("be-write-k-list", lambda w: w.be_write(k=w.rows(1).tolist()), DTypeError, "k"),
    C("be-write-k-python-scalar", lambda w: w.be_write(k=1.0), DTypeError, "k"),
    C("be-write-k-object-array", lambda w: w.be_write(k=w.rows(1).astype(object)),
      DTypeError, "k"),
    C("be-write-store-read-only",
      lambda w: w.be_write(k_cache=_ro(w.cache.store.k), v_cache=_ro(w.cache.store.v)),
      ShapeError, "k_cache", backends=_CPU),
    C("be-write-store-non-contiguous",
      lambda w: w.be_write(k_cache=w.cache.store.k[:, ::2], v_cache=w.cache.store.v[:, ::2]),
      ShapeError, "k_cache"),
    C("be-write-store-4d", lambda w: w.be_write(k_cache=w.cache.store.k[0],
                                                v_cache=w.cache.store.v[0]),
      ShapeError, "k_cache"),
    C("be-write-store-shapes-differ", lambda w: w.be_write(v_cache=w.cache.store.v[:1]),
      ShapeError, "v_cache"),
    C("be-write-store-float64",
      lambda w: w.be_write(k_cache=w.backend.zeros(w.cache.store.shape, np.dtype(np.float64)),
                           v_cache=w.backend.zeros(w.cache.store.shape, np.dtype(np.float64)),
                           k=w.rows(1, np.float64), v=w.rows(1, np.float64)),
      DTypeError, "k_cache"),
    C("be-write-k-cache-is-v-cache",
      lambda w: w.be_write(v_cache=w.cache.store.k, k=w.rows(1) + 1, v=w.rows(1) + 2),
      ShapeError, "v_cache"),
    C("be-write-layout-unknown", lambda w: w.be_write(layout="NTHD"), LayoutError, "layout"),
    C("be-write-k-aliases-store",
      lambda w: w.be_write(k=w.cache.store.k[0, w.free_page, :1]), ShapeError, "k", dtypes=_F),
    C("be-write-v-aliases-k-store",
      lambda w: w.be_write(v=w.cache.store.k[1, w.free_page, :1]), ShapeError, "v", dtypes=_F),
    C("be-write-k-aliases-scales",
      lambda w: w.be_write(k=_scale_view(w, "k_scale", 1)[0]), ShapeError, "k", dtypes=_Q),
    C("be-write-v-aliases-scales",
      lambda w: w.be_write(v=_scale_view(w, "v_scale", 1)[0]), ShapeError, "v", dtypes=_Q),
    C("be-write-scale-float16",
      lambda w: w.be_write(k_scale=w.cache.store.k_scale.astype(np.float16)),
      DTypeError, "k_scale", dtypes=_Q),
    C("be-write-scale-wrong-shape",
      lambda w: w.be_write(v_scale=w.cache.store.v_scale[:, :, :1].copy()),
      ShapeError, "v_scale", dtypes=_Q),
    C("be-write-scales-shared",
      lambda w: w.be_write(v_scale=w.cache.store.k_scale), ShapeError, "v_scale", dtypes=_Q),
    C("be-write-k-float64-int8-store", lambda w: w.be_write(k=w.rows(1, np.float64),
                                                            v=w.rows(1, np.float64)),
      DTypeError, "k", dtypes=_Q),
    # -------------------------------------------------------- backend.gather
    C("be-gather-table-int64",
      lambda w: w.be_gather(page_table=np.array([[w.a.page_ids[0]]], np.int64)),
      DTypeError, "page_table"),
    C("be-gather-table-1d", lambda w: w.be_gather(page_table=w.i32(w.a.page_ids[0])),
      ShapeError, "page_table"),
    C("be-gather-table-out-of-range",
      lambda w: w.be_gather(page_table=np.array([[NUM_PAGES]], np.int32)),
      PageIdError, "page_table"),
    C("be-gather-table-minus-one-in-use",
      lambda w: w.be_gather(page_table=np.array([[-1]], np.int32)),
      PageIdError, "page_table"),
    C("be-gather-seq-len-past-table", lambda w: w.be_gather(seq_lens=w.i32(PAGE_SIZE + 1)),
      ShapeError, "seq_lens"),
    C("be-gather-seq-len-negative", lambda w: w.be_gather(seq_lens=w.i32(-1)),
      ShapeError, "seq_lens"),
    C("be-gather-seq-lens-wrong-length", lambda w: w.be_gather(seq_lens=w.i32(1, 1)),
      ShapeError, "seq_lens"),
    C("be-gather-seq-lens-float", lambda w: w.be_gather(seq_lens=np.array([1.0])),
      DTypeError, "seq_lens"),
    C("be-gather-out-layout-unknown", lambda w: w.be_gather(out_layout="TBHD"),
      LayoutError, "out_layout"),
    C("be-gather-out-non-contiguous",
      lambda w: w.be_gather(out_layout="BHTD", out=_noncontig_out(w, PAGE_SIZE)),
      ShapeError, "out[0]"),
    C("be-gather-out-read-only",
      lambda w: w.be_gather(out_layout="BHTD",
                            out=tuple(_ro(x) for x in w.out(1, PAGE_SIZE))),
      ShapeError, "out[0]", backends=_CPU),
    C("be-gather-out-wrong-dtype",
      lambda w: w.be_gather(out_layout="BHTD", out=w.out(1, PAGE_SIZE, np.float16)),
      DTypeError, "out[0]", dtypes=_F),
    C("be-gather-out-float64",
      lambda w: w.be_gather(out_layout="BHTD", out=w.out(1, PAGE_SIZE, np.float64)),
      DTypeError, "out[0]"),
    C("be-gather-out-not-the-dtype-asked",
      lambda w: w.be_gather(out_layout="BHTD", out=w.out(1, PAGE_SIZE), dtype="float16"),
      DTypeError, "out[0]", dtypes=_Q),
    C("be-gather-dtype-int8", lambda w: w.be_gather(dtype="int8"), DTypeError, "dtype",
      dtypes=_Q),
    C("be-gather-out-aliases-scales",
      lambda w: w.be_gather(out_layout="BTHD", out=(_scale_view(w, "k_scale", PAGE_SIZE),
                                                    _scale_view(w, "v_scale", PAGE_SIZE))),
      ShapeError, "out", dtypes=_Q),
    C("be-gather-out-too-short",
      lambda w: w.be_gather(out_layout="BHTD", out=w.out(1, PAGE_SIZE - 1)), ShapeError, "out[0]"),
    C("be-gather-out-wrong-batch",
      lambda w: w.be_gather(out_layout="BHTD", out=w.out(2, PAGE_SIZE)), ShapeError, "out[0]"),
    C("be-gather-out-same-array",
      lambda w: w.be_gather(out_layout="BHTD", out=(w.out(1, PAGE_SIZE)[0],) * 2),
      ShapeError, "out"),
    C("be-gather-out-not-a-pair",
      lambda w: w.be_gather(out_layout="BHTD", out=w.out(1, PAGE_SIZE)[0]), DTypeError, "out"),
    C("be-gather-out-lists",
      lambda w: w.be_gather(out_layout="BHTD", out=tuple(x.tolist() for x in w.out(1, PAGE_SIZE))),
      DTypeError, "out[0]"),
    C("be-gather-out-aliases-store",
      lambda w: w.be_gather(out_layout="BTHD",
                            out=(w.cache.store.k[0, w.free_page:w.free_page + 1],
                                 w.cache.store.v[0, w.free_page:w.free_page + 1])),
      ShapeError, "out", dtypes=_F),
    C("be-gather-num-positions-float", lambda w: w.be_gather(num_positions=8.0),
      DTypeError, "num_positions"),
    C("be-gather-num-positions-too-small", lambda w: w.be_gather(num_positions=PAGE_SIZE - 1),
      ShapeError, "num_positions"),
    # ---------------------------------------------------- backend.copy_pages
    C("be-copy-duplicate-destination", lambda w: w.be_copy(w.i32(1, 2), w.i32(9, 9)),
      PageStateError, "dst_pages"),
    C("be-copy-source-is-destination", lambda w: w.be_copy(w.i32(1, 2), w.i32(2, 9)),
      PageStateError, "dst_pages"),
    C("be-copy-source-out-of-range", lambda w: w.be_copy(w.i32(NUM_PAGES), w.i32(9)),
      PageIdError, "src_pages"),
    C("be-copy-destination-negative", lambda w: w.be_copy(w.i32(1), w.i32(-1)),
      PageIdError, "dst_pages"),
    C("be-copy-lengths-differ", lambda w: w.be_copy(w.i32(1, 2), w.i32(9)),
      ShapeError, "dst_pages"),
    C("be-copy-int64", lambda w: w.be_copy(np.array([1], np.int64), w.i32(9)),
      DTypeError, "src_pages"),
    C("be-copy-lists", lambda w: w.be_copy([1], [9]), DTypeError, "src_pages"),
    # ---------------------------------------------------- PagedKVCache(...)
    C("cache-ctor-layers-zero", lambda w: w.new_cache(num_layers=0), ConfigError, "num_layers"),
    C("cache-ctor-page-size-float", lambda w: w.new_cache(page_size=4.0), DTypeError, "page_size"),
    C("cache-ctor-dtype-int32", lambda w: w.new_cache(dtype="int32"), DTypeError, "dtype"),
    C("cache-ctor-layout-unknown", lambda w: w.new_cache(layout="THD"), LayoutError, "layout"),
    C("cache-ctor-backend-unknown", lambda w: w.new_cache(backend="torch"), ConfigError, "backend"),
    C("cache-ctor-secret-str", lambda w: w.new_cache(hash_secret="key"), ConfigError, "secret"),
    C("cache-ctor-no-size", lambda w: w.new_cache(num_pages=None), ConfigError, "num_pages"),
    # ------------------------------------------------------- add_sequence
    C("add-empty-list", lambda w: w.cache.add_sequence([]), ShapeError, "prompt"),
    C("add-empty-array", lambda w: w.cache.add_sequence(np.zeros(0, np.int64)),
      ShapeError, "prompt"),
    C("add-none", lambda w: w.cache.add_sequence(None), DTypeError, "prompt"),
    C("add-str", lambda w: w.cache.add_sequence("hello"), DTypeError, "prompt"),
    C("add-bytes", lambda w: w.cache.add_sequence(b"\x01\x02"), DTypeError, "prompt"),
    C("add-python-int", lambda w: w.cache.add_sequence(7), DTypeError, "prompt"),
    C("add-floats", lambda w: w.cache.add_sequence([1.0, 2.0]), DTypeError, "prompt"),
    C("add-numpy-floats", lambda w: w.cache.add_sequence(np.array([1.0, 2.0])),
      DTypeError, "prompt"),
    C("add-numpy-float-scalar-in-list", lambda w: w.cache.add_sequence([1, np.float32(2)]),
      DTypeError, "prompt"),
    C("add-bools", lambda w: w.cache.add_sequence([True, False]), DTypeError, "prompt"),
    C("add-numpy-bools", lambda w: w.cache.add_sequence(np.array([True, False])),
      DTypeError, "prompt"),
    C("add-strings-in-list", lambda w: w.cache.add_sequence([1, "2"]), DTypeError, "prompt"),
    C("add-none-in-list", lambda w: w.cache.add_sequence([1, None]), DTypeError, "prompt"),
    C("add-nested-lists", lambda w: w.cache.add_sequence([[1, 2], [3, 4]]), ShapeError, "prompt"),
    C("add-2d-array", lambda w: w.cache.add_sequence(np.ones((2, 2), np.int64)),
      ShapeError, "prompt"),
    C("add-0d-array", lambda w: w.cache.add_sequence(np.array(5)), ShapeError, "prompt"),
    C("add-object-array", lambda w: w.cache.add_sequence(np.array([1, 2], dtype=object)),
      DTypeError, "prompt"),
    C("add-id-past-int64", lambda w: w.cache.add_sequence([1, 2**63]), DTypeError, "prompt"),
    C("add-id-past-uint64", lambda w: w.cache.add_sequence([2**70]), DTypeError, "prompt"),
    C("add-uint64-array-past-int64",
      lambda w: w.cache.add_sequence(np.array([1, 2**63], np.uint64)), DTypeError, "prompt"),
    C("add-negative-id", lambda w: w.cache.add_sequence([3, -1]), DTypeError, "prompt"),
    C("add-salt-float", lambda w: w.cache.add_sequence([1, 2], salt=1.5), DTypeError, "salt"),
    C("add-salt-list", lambda w: w.cache.add_sequence([1, 2], salt=["t"]), DTypeError, "salt"),
    C("add-salt-bool", lambda w: w.cache.add_sequence([1, 2], salt=True), DTypeError, "salt"),
    # -------------------------------------------------------------- extend
    C("extend-released", lambda w: w.cache.extend(w.released, [1]), SequenceError, "seq"),
    C("extend-foreign", lambda w: w.cache.extend(w.foreign_seq, [1]), SequenceError, "seq"),
    C("extend-none-seq", lambda w: w.cache.extend(None, [1]), DTypeError, "seq"),
    C("extend-float-tokens", lambda w: w.cache.extend(w.a, [1.5]), DTypeError, "tokens"),
    C("extend-nested-tokens", lambda w: w.cache.extend(w.a, [[1]]), ShapeError, "tokens"),
    C("extend-huge", lambda w: w.cache.extend(w.a, np.arange(10**6)), OutOfPages, "token"),
    C("extend-one-page-too-many",
      lambda w: w.cache.extend(w.a, [1] * ((w.cache.pool.num_available + 1) * PAGE_SIZE)),
      OutOfPages, "token"),
    C("extend-forked-needs-copy-when-exhausted",
      lambda w: w.cache.extend(w.child, [1]), OutOfPages, "token",
      prepare=lambda w: w.cache.extend(w.a, [1] * (w.cache.pool.num_available * PAGE_SIZE))),
    # ---------------------------------------------------- fork / release
    C("fork-unplanned", lambda w: w.cache.fork(w.unplanned), SequenceError, "seq"),
    C("fork-released", lambda w: w.cache.fork(w.released), SequenceError, "seq"),
    C("fork-foreign", lambda w: w.cache.fork(w.foreign_seq), SequenceError, "seq"),
    C("release-twice", lambda w: w.cache.release(w.released), SequenceError, "seq"),
    C("release-foreign", lambda w: w.cache.release(w.foreign_seq), SequenceError, "seq"),
    C("release-none", lambda w: w.cache.release(None), DTypeError, "seq"),
    # ----------------------------------------------------------------- plan
    C("plan-bare-sequence", lambda w: w.cache.plan(w.a), DTypeError, "seqs"),
    C("plan-generator", lambda w: w.cache.plan(s for s in [w.a]), DTypeError, "seqs"),
    C("plan-listed-twice", lambda w: w.cache.plan([w.a, w.a]), SequenceError, "seqs"),
    C("plan-released", lambda w: w.cache.plan([w.a, w.released]), SequenceError, "seqs"),
    C("plan-none-item", lambda w: w.cache.plan([None]), DTypeError, "seqs"),
    C("plan-foreign", lambda w: w.cache.plan([w.foreign_seq]), SequenceError, "seqs"),
    # ---------------------------------------------------------------- write
    C("write-stale-plan", lambda w: w.cache.write(0, w.stale_plan, w.rows(0), w.rows(0)),
      StalePlanError, "plan"),
    C("write-foreign-plan", lambda w: w.cache.write(0, w.foreign_plan, w.rows(3), w.rows(3)),
      StalePlanError, "plan"),
    C("write-plan-none", lambda w: w.cache.write(0, None, w.rows(0), w.rows(0)),
      DTypeError, "plan"),
    C("write-layer-out-of-range", lambda w: w.cache.write(NUM_LAYERS, w.plan, w.rows(0), w.rows(0)),
      PageIdError, "layer"),
    C("write-more-rows-than-planned", lambda w: w.cache.write(0, w.plan, w.rows(1), w.rows(1)),
      ShapeError, "k"),
    C("write-k-float64", lambda w: w.cache.write(0, w.plan, w.rows(0, np.float64), w.rows(0)),
      DTypeError, "k"),
    C("write-k-list", lambda w: w.cache.write(0, w.plan, [], w.rows(0)), DTypeError, "k"),
    C("write-v-wrong-shape",
      lambda w: w.cache.write(0, w.plan, w.rows(0), np.zeros((0, NUM_KV_HEADS, HEAD_DIM + 1),
                                                             np.float32)),
      ShapeError, "v"),
    C("write-k-aliases-store",
      lambda w: w.cache.write(0, w.short_plan, w.cache.store.k[0, w.free_page, :3], w.rows(3)),
      ShapeError, "k", prepare=lambda w: setattr(w, "short_plan", w.cache.plan([w.unplanned])),
      dtypes=_F),
    C("write-v-aliases-scales",
      lambda w: w.cache.write(0, w.short_plan, w.rows(3), _scale_view(w, "v_scale", 3)[0]),
      ShapeError, "v", prepare=lambda w: setattr(w, "short_plan", w.cache.plan([w.unplanned])),
      dtypes=_Q),
    # --------------------------------------------------------------- gather
    C("gather-stale-plan", lambda w: w.cache.gather(0, w.stale_plan), StalePlanError, "plan"),
    C("gather-layout-unknown", lambda w: w.cache.gather(0, w.plan, layout="HBTD"),
      LayoutError, "layout"),
    C("gather-out-non-contiguous",
      lambda w: w.cache.gather(0, w.plan, out=(w.out(2, 20)[0][:, :, ::2], w.out(2, 10)[1])),
      ShapeError, "out"),
    C("gather-out-read-only",
      lambda w: w.cache.gather(0, w.plan, out=tuple(_ro(x) for x in w.out(2, 10))),
      ShapeError, "out", backends=_CPU),
    C("gather-out-wrong-dtype", lambda w: w.cache.gather(0, w.plan, out=w.out(2, 10, np.float64)),
      DTypeError, "out"),
    C("gather-out-shorter-than-sequences", lambda w: w.cache.gather(0, w.plan, out=w.out(2, 9)),
      ShapeError, "out"),
    C("gather-out-aliases-store",
      lambda w: w.cache.gather(0, w.short_plan, layout="BTHD",
                               out=(w.cache.store.k[0, w.free_page:w.free_page + 1],
                                    w.cache.store.v[0, w.free_page:w.free_page + 1])),
      ShapeError, "out", prepare=lambda w: setattr(w, "short_plan", w.cache.plan([w.unplanned])),
      dtypes=_F),
    C("gather-out-aliases-scales",
      lambda w: w.cache.gather(0, w.short_plan, layout="BTHD",
                               out=(_scale_view(w, "k_scale", 3), _scale_view(w, "v_scale", 3))),
      ShapeError, "out", prepare=lambda w: setattr(w, "short_plan", w.cache.plan([w.unplanned])),
      dtypes=_Q),
    C("gather-dtype-unknown", lambda w: w.cache.gather(0, w.plan, dtype="int8"),
      DTypeError, "dtype"),
    C("gather-dtype-not-the-caches", lambda w: w.cache.gather(0, w.plan, dtype="float16"),
      DTypeError, "dtype", dtypes=_F),
    C("gather-dtype-not-the-outs",
      lambda w: w.cache.gather(0, w.plan, out=w.out(2, 10), dtype="bfloat16"),
      DTypeError, "out", dtypes=_Q),
    C("gather-num-positions-too-small", lambda w: w.cache.gather(0, w.plan, num_positions=9),
      ShapeError, "num_positions"),
    C("gather-num-positions-str", lambda w: w.cache.gather(0, w.plan, num_positions="12"),
      DTypeError, "num_positions"),
    # ------------------------------------------ num_pages_needed / can_extend
    C("pages-needed-none", lambda w: w.cache.num_pages_needed(w.a, None),
      DTypeError, "num_new_tokens"),
    C("pages-needed-str", lambda w: w.cache.num_pages_needed(w.a, "3"),
      DTypeError, "num_new_tokens"),
    C("can-extend-float", lambda w: w.cache.can_extend(w.a, 2.5), DTypeError, "num_new_tokens"),
    C("pages-needed-released", lambda w: w.cache.num_pages_needed(w.released, 1),
      SequenceError, "seq"),
    # ------------------------------------------------------------ PagedCache
    C("pc-ctor-zero-pages",
      lambda w: pk.PagedCache(1, 0, PAGE_SIZE, 1, 2, backend=w.backend), ConfigError, "pages"),
    C("pc-ctor-dtype", lambda w: pk.PagedCache(1, 4, PAGE_SIZE, 1, 2, dtype="float64",
                                               backend=w.backend),
      DTypeError, "dtype"),
    C("pc-ctor-dtype-int8", lambda w: pk.PagedCache(1, 4, PAGE_SIZE, 1, 2, dtype="int8",
                                                    backend=w.backend),
      DTypeError, "dtype"),
    C("pc-alloc-exhausted", lambda w: w.pc.alloc(), OutOfPages, "page", prepare=World.exhaust_pc),
    C("pc-alloc-n-negative", lambda w: w.pc.alloc_n(-1), ConfigError, "Invalid n:"),
    C("pc-alloc-n-float", lambda w: w.pc.alloc_n(1.5), DTypeError, "Invalid n:"),
    C("pc-free-free-page", lambda w: w.pc.free(w.pc_free_page), PageStateError, "idx"),
    C("pc-free-out-of-range", lambda w: w.pc.free(NUM_PAGES), PageIdError, "idx"),
    C("pc-free-none", lambda w: w.pc.free(None), DTypeError, "idx"),
    C("pc-inc-ref-free-page", lambda w: w.pc.inc_ref(w.pc_free_page), PageStateError, "idx"),
    C("pc-record-page-not-in-use", lambda w: w.pc.record_page(w.pc_free_page, w.pc_tokens, 2),
      PageStateError, "page_idx"),
    C("pc-record-page-out-of-range", lambda w: w.pc.record_page(NUM_PAGES, w.pc_tokens, 2),
      PageIdError, "page_idx"),
    C("pc-record-page-partial-logical",
      lambda w: w.pc.record_page(w.pc_pages[2], w.pc_tokens[:10], 2),
      PageIdError, "logical_page_idx"),
    C("pc-record-page-float-tokens",
      lambda w: w.pc.record_page(w.pc_pages[2], [float(t) for t in w.pc_tokens], 2),
      DTypeError, "token_ids"),
    C("pc-record-page-logical-bool", lambda w: w.pc.record_page(w.pc_pages[2], w.pc_tokens, True),
      DTypeError, "logical_page_idx"),
    C("pc-lookup-str", lambda w: w.pc.lookup_prefix("prompt"), DTypeError, "token_ids"),
    C("pc-lookup-none", lambda w: w.pc.lookup_prefix(None), DTypeError, "token_ids"),
    C("pc-write-into-page-minus-one",
      lambda w: w.pc.write(0, [[w.pc_pages[0], -1]], 3, w.batch(1, 2), w.batch(1, 2)),
      PageIdError, "page_table"),
    C("pc-write-table-out-of-range",
      lambda w: w.pc.write(0, [[NUM_PAGES]], 0, w.batch(1, 1), w.batch(1, 1)),
      PageIdError, "page_table"),
    C("pc-write-table-float",
      lambda w: w.pc.write(0, [[1.0]], 0, w.batch(1, 1), w.batch(1, 1)), DTypeError, "page_table"),
    C("pc-write-table-ragged",
      lambda w: w.pc.write(0, [w.pc_pages[:2], w.pc_pages[:1]], 0, w.batch(2, 1), w.batch(2, 1)),
      (ShapeError, DTypeError), "page_table"),
    C("pc-write-start-negative",
      lambda w: w.pc.write(0, w.pc_table, -1, w.batch(1, 1), w.batch(1, 1)),
      PageIdError, "start_pos"),
    C("pc-write-start-past-table",
      lambda w: w.pc.write(0, w.pc_table, 3 * PAGE_SIZE, w.batch(1, 1), w.batch(1, 1)),
      PageIdError, "start_pos"),
    C("pc-write-start-float",
      lambda w: w.pc.write(0, w.pc_table, 0.0, w.batch(1, 1), w.batch(1, 1)),
      DTypeError, "start_pos"),
    C("pc-write-start-wrong-length",
      lambda w: w.pc.write(0, w.pc_table, [0, 1], w.batch(1, 1), w.batch(1, 1)),
      ShapeError, "start_pos"),
    C("pc-write-lengths-past-tokens",
      lambda w: w.pc.write(0, w.pc_table, 0, w.batch(1, 2), w.batch(1, 2), lengths=[3]),
      ShapeError, "lengths"),
    C("pc-write-k-float16",
      lambda w: w.pc.write(0, w.pc_table, 0, w.batch(1, 1, np.float16), w.batch(1, 1)),
      DTypeError, "k"),
    C("pc-write-v-shape-differs",
      lambda w: w.pc.write(0, w.pc_table, 0, w.batch(1, 2), w.batch(1, 1)), ShapeError, "v"),
    C("pc-write-layer-out-of-range",
      lambda w: w.pc.write(NUM_LAYERS, w.pc_table, 0, w.batch(1, 1), w.batch(1, 1)),
      PageIdError, "layer"),
    C("pc-write-two-rows-one-slot",
      lambda w: w.pc.write(0, [[w.pc_pages[2]], [w.pc_pages[2]]], 0, w.batch(2, 1), w.batch(2, 1)),
      PageIdError, "page_table"),
    C("pc-gather-seq-len-past-int32", lambda w: w.pc.gather(0, w.pc_table, seq_lens=[2**32 + 4]),
      ShapeError, "seq_lens"),
    C("pc-gather-seq-lens-float", lambda w: w.pc.gather(0, w.pc_table, seq_lens=[4.0]),
      DTypeError, "seq_lens"),
    C("pc-gather-seq-lens-wrong-length", lambda w: w.pc.gather(0, w.pc_table, seq_lens=[4, 4]),
      ShapeError, "seq_lens"),
    C("pc-gather-seq-len-past-table",
      lambda w: w.pc.gather(0, w.pc_table, seq_lens=[3 * PAGE_SIZE + 1]), ShapeError, "seq_lens"),
    C("pc-gather-table-3d", lambda w: w.pc.gather(0, w.pc_table[None]), ShapeError, "page_table"),
    # ------------------------------------------------------------ CacheView
    C("view-cache-not-a-paged-cache", lambda w: pk.CacheView(w.cache, w.pc_table),
      DTypeError, "cache"),
    C("view-total-len-negative", lambda w: w.pc.bind(w.pc_table, total_len=-1),
      DTypeError, "total_len"),
    C("view-total-len-float", lambda w: w.pc.bind(w.pc_table, total_len=2.0),
      DTypeError, "total_len"),
    C("view-table-out-of-range", lambda w: w.pc.bind([[NUM_PAGES]]), PageIdError, "page_table"),
    C("view-gather-total-len-past-gathered",
      lambda w: w.pc.bind(w.pc_table, total_len=3 * PAGE_SIZE + 1).gather(0),
      ShapeError, "total_len"),
    C("view-write-k-list", lambda w: w.view.write(0, 0, [[[[0.0]]]], w.batch(1, 1)),
      DTypeError, "k"),
    C("view-gather-seq-lens-str", lambda w: w.pc.bind(w.pc_table, seq_lens=["4"]).gather(0),
      DTypeError, "seq_lens"),
]
_O = World.make_ort
if OrtDecoder is not None:   # the engine's cases, on the backends it runs on
    CASES += [dataclasses.replace(c, backends=_CPU) for c in [
        C("ort-model-int", lambda w: OrtDecoder(42), DTypeError, "model"),
        C("ort-model-missing-file", lambda w: OrtDecoder("/nonexistent/model.onnx"),
          ConfigError, "model"),
        C("ort-model-garbage-bytes", lambda w: OrtDecoder(b"not an onnx model"),
          PagedKVError, "model"),
        C("ort-max-batch-zero", lambda w: OrtDecoder(_ort_model(), max_batch_size=0),
          ConfigError, "max_batch_size"),
        C("ort-eos-str", lambda w: OrtDecoder(_ort_model(), eos_token_id="2"),
          DTypeError, "eos_token_id"),
        C("ort-add-empty", lambda w: w.ort.add_request([]), ShapeError, "prompt", _O),
        C("ort-add-floats", lambda w: w.ort.add_request([1.5], 2), DTypeError, "prompt", _O),
        C("ort-add-2d", lambda w: w.ort.add_request(np.ones((2, 2), np.int64), 2),
          ShapeError, "prompt", _O),
        C("ort-add-out-of-vocabulary", lambda w: w.ort.add_request([1, 256], 2),
          ConfigError, "prompt", _O),
        C("ort-add-longer-than-pool", lambda w: w.ort.add_request([1] * 60, 8),
          ConfigError, "prompt", _O),
        C("ort-add-max-new-zero", lambda w: w.ort.add_request([1], 0),
          ConfigError, "max_new_tokens", _O),
        C("ort-add-max-new-float", lambda w: w.ort.add_request([1], 2.5),
          DTypeError, "max_new_tokens", _O),
        C("ort-add-salt-float", lambda w: w.ort.add_request([1], 2, salt=0.5),
          DTypeError, "salt", _O),
        C("ort-add-temperature-negative", lambda w: w.ort.add_request([1], 2, temperature=-1.0),
          ConfigError, "temperature", _O),
        C("ort-add-top-p-zero", lambda w: w.ort.add_request([1], 2, top_p=0.0),
          ConfigError, "top_p", _O),
        C("ort-add-top-k-float", lambda w: w.ort.add_request([1], 2, top_k=1.5),
          DTypeError, "top_k", _O),
        C("ort-add-eos-nested", lambda w: w.ort.add_request([1], 2, eos_token_id=[[1]]),
          DTypeError, "eos_token_id", _O),
        C("ort-add-seed-str", lambda w: w.ort.add_request([1], 2, temperature=1.0, seed="x"),
          DTypeError, "seed", _O),
        C("ort-generate-none", lambda w: w.ort.generate(None), DTypeError, "prompts", _O),
        C("ort-generate-second-prompt-bad", lambda w: w.ort.generate([[1, 2], [1.5]], 2),
          DTypeError, "prompt", _O),
        C("ort-get-output-unknown", lambda w: w.ort.get_output(999), RequestNotFound,
          "request_id", _O),
        C("ort-pop-output-unfinished", lambda w: w.ort.pop_output(w.ort_running),
          ConfigError, "request_id", _O),
        C("ort-abort-unknown", lambda w: w.ort.abort(999), RequestNotFound, "request_id", _O),
    ]]
NUM_CASES = len(CASES)


def _ids() -> list[str]:
    return [c.id for c in CASES]


STORE_DTYPES = ["float32", "int8"]
# (case, store dtype, backend); the backend goes to the cache_backend fixture,
# which skips one that is unavailable here
CASE_PARAMS = [pytest.param(c, d, b, id=f"{c.id}-{d}-{b}")
               for c in CASES for d in c.dtypes for b in c.backends]


def test_catalogue_is_large_and_ids_are_unique():
    print(f"\nmalformed-call catalogue: {NUM_CASES} cases x backends {CACHE_BACKENDS} "
          f"({pk.available_backends()} here)")
    assert NUM_CASES >= 60
    assert len(set(_ids())) == NUM_CASES


@pytest.mark.parametrize("case, dtype, cache_backend", CASE_PARAMS, indirect=["cache_backend"])
def test_malformed_call_raises_typed_error_and_changes_nothing(case: Case, dtype: str,
                                                               cache_backend: str):
    world = World(cache_backend, dtype)
    if case.prepare is not None:
        case.prepare(world)
    world.cache.check_invariants()
    before = snapshot(world)

    with pytest.raises(PagedKVError) as info:
        case.call(world)

    assert isinstance(info.value, case.error), (
        f"expected {case.error}, got {type(info.value).__name__}: {info.value}")
    assert case.names in str(info.value), (
        f"the message does not name {case.names!r}: {info.value}")
    world.cache.check_invariants()
    world.other.check_invariants()
    world.pc.pool.check_invariants()
    world.pc._index.check_invariants()
    changed = _diff(before, snapshot(world))
    assert not changed, f"a failed call changed {changed}"


@pytest.mark.parametrize("dtype", STORE_DTYPES)
def test_world_is_usable_after_every_failure(cache_backend: str, dtype: str):
    """One world takes every failing call in a row and still serves correct data."""
    world = World(cache_backend, dtype)
    host = world.backend.to_numpy
    expected_k, expected_v = map(host, world.cache.gather(0, world.plan))
    num_failed = 0
    for case in CASES:
        if (case.prepare is not None or dtype not in case.dtypes
                or cache_backend not in case.backends):
            continue
        try:
            case.call(world)
        except PagedKVError:
            num_failed += 1
        except Exception:  # reported per case by the parametrized test
            pass
    world.cache.check_invariants()
    k, v = map(host, world.cache.gather(0, world.plan))
    assert np.array_equal(k.view(np.uint32), expected_k.view(np.uint32))
    assert np.array_equal(v.view(np.uint32), expected_v.view(np.uint32))
    assert num_failed >= 60


@pytest.mark.parametrize("change", ["store-byte", "lru-order", "index-counter", "seq-tokens",
                                    "compat-counter", "pool-ref"])
def test_snapshot_sees_every_kind_of_change(change: str, cache_backend: str):
    """The snapshot the catalogue relies on notices a change of each kind."""
    world = World(cache_backend)
    before = snapshot(world)
    if change == "store-byte":
        world.cache.store.v[1, world.free_page, 0, 0, 0] += 1
    elif change == "lru-order":
        world.cache.pool.touch(world.evictable_page)
    elif change == "index-counter":
        world.cache.index.num_rejected += 1
    elif change == "seq-tokens":
        world.cache.extend(world.a, [1])
    elif change == "compat-counter":
        world.pc.lookup_prefix([1, 2, 3])
    else:
        world.cache.pool.inc_ref([world.shared_page])
    assert _diff(before, snapshot(world))
