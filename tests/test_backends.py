"""Every backend against the NumPy reference, bit for bit.

Runs for every registered backend plus "cupy", which skips when CuPy or a GPU
is missing (the one allowed skip); any other backend that fails to load is an
error. The data are random bit patterns, NaNs with payloads included, compared
as unsigned integers, so a kernel that moved values through float arithmetic
(or dropped a payload) would fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_np import (
    BackendUnavailable,
    DTypeError,
    KVStore,
    PageIdError,
    ShapeError,
    available_backends,
    get_backend,
)
from pagedkv_np.backends.numpy_ref import NumpyBackend
from pagedkv_np.layout import bits_view_dtype, resolve_dtype

BACKENDS = sorted(set(available_backends()) | {"numpy", "numba", "cupy"})
DTYPES = ["float32", "float16", "bfloat16"]
LAYOUTS = ["NHD", "HND"]
OUT_LAYOUTS = ["BTHD", "BHTD"]
PAGE_SIZES = [1, 16, 128]
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 3, 8
LAYER = 1  # not the first: layer offsets must be right

# Bit patterns that a float round trip would change: NaNs with payloads
# (quiet and signalling, both signs), -0, the smallest subnormal.
SPECIAL_BITS = {
    4: [0x7FC00001, 0xFFA0BEEF, 0x7F800001, 0x80000000, 0x00000001],
    2: [0x7E01, 0xFC01, 0x7C01, 0x7F81, 0xFF85, 0x8000, 0x0001],
}

REF = NumpyBackend()


@pytest.fixture(params=BACKENDS)
def backend(request):
    try:
        return get_backend(request.param)
    except BackendUnavailable as exc:
        if request.param == "cupy":
            pytest.skip(f"no CuPy or no GPU: {exc}")
        raise


def random_bits(rng, shape, dtype) -> np.ndarray:
    """An array of ``dtype`` holding random bit patterns and every special one."""
    dtype = resolve_dtype(dtype)
    bits = bits_view_dtype(dtype)
    x = rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits, endpoint=True)
    special = np.array(SPECIAL_BITS[dtype.itemsize], dtype=bits)
    flat = x.reshape(-1)
    flat[: min(flat.size, special.size)] = special[: flat.size]
    return x.view(dtype)


def host(backend, x) -> np.ndarray:
    return np.asarray(backend.to_numpy(x))


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.view(bits_view_dtype(actual.dtype)),
                                  expected.view(bits_view_dtype(expected.dtype)))


class Stores:
    """The same random store on ``backend`` and on the host (for the reference)."""

    def __init__(self, backend, rng, *, layout, dtype, page_size, num_pages):
        self.layout = layout
        self.backend = backend
        store = KVStore(NUM_LAYERS, page_size, NUM_HEADS, HEAD_DIM, num_pages=num_pages,
                        dtype=dtype, layout=layout, backend=backend)
        self.ref_k = random_bits(rng, store.shape, store.dtype)
        self.ref_v = random_bits(rng, store.shape, store.dtype)
        store.k[...] = backend.asarray(self.ref_k)
        store.v[...] = backend.asarray(self.ref_v)
        self.store = store

    @property
    def k(self):
        return self.store.k

    @property
    def v(self):
        return self.store.v

    def assert_matches_reference(self) -> None:
        assert_same_bits(host(self.backend, self.store.k), self.ref_k)
        assert_same_bits(host(self.backend, self.store.v), self.ref_v)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return host(self.backend, self.store.k).copy(), host(self.backend, self.store.v).copy()

    def assert_unchanged(self, snap) -> None:
        assert_same_bits(host(self.backend, self.store.k), snap[0])
        assert_same_bits(host(self.backend, self.store.v), snap[1])


def make_page_table(rng, seq_lens, page_size, num_pages, spare_pages=1) -> np.ndarray:
    """Distinct random pages for each sequence, -1 past its last page."""
    used = [-(-int(n) // page_size) for n in seq_lens]
    width = max(used, default=0) + spare_pages
    pages = rng.permutation(num_pages)[: sum(used)]
    table = np.full((len(seq_lens), width), -1, dtype=np.int32)
    at = 0
    for b, u in enumerate(used):
        table[b, :u] = pages[at:at + u]
        at += u
    return table


def edge_seq_lens(page_size: int) -> np.ndarray:
    # exactly on a page boundary, one token, empty, a partial last page
    return np.array([2 * page_size, 1, 0, 2 * page_size + max(1, page_size // 3)], np.int32)


def pages_for(seq_lens, page_size) -> int:
    return sum(-(-int(n) // page_size) for n in seq_lens) + 3


# ------------------------------------------------------------------ gather
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_reference(backend, dtype, layout, out_layout, page_size):
    rng = np.random.default_rng(page_size)
    seq_lens = edge_seq_lens(page_size)
    stores = Stores(backend, rng, layout=layout, dtype=dtype, page_size=page_size,
                    num_pages=pages_for(seq_lens, page_size))
    table = make_page_table(rng, seq_lens, page_size, stores.store.num_pages)
    got = backend.gather(stores.k, stores.v, LAYER, table, seq_lens, layout=layout,
                         out_layout=out_layout)
    want = REF.gather(stores.ref_k, stores.ref_v, LAYER, table, seq_lens, layout=layout,
                      out_layout=out_layout)
    for g, w in zip(got, want):
        assert_same_bits(host(backend, g), w)
    stores.assert_matches_reference()  # gather reads only


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_into_garbage_out_with_spare_positions(backend, dtype, layout, out_layout,
                                                      page_size):
    rng = np.random.default_rng(100 + page_size)
    seq_lens = edge_seq_lens(page_size)
    stores = Stores(backend, rng, layout=layout, dtype=dtype, page_size=page_size,
                    num_pages=pages_for(seq_lens, page_size))
    table = make_page_table(rng, seq_lens, page_size, stores.store.num_pages)
    num_positions = int(seq_lens.max()) + 5
    shape = ((len(seq_lens), num_positions, NUM_HEADS, HEAD_DIM) if out_layout == "BTHD"
             else (len(seq_lens), NUM_HEADS, num_positions, HEAD_DIM))
    garbage = random_bits(rng, shape, dtype), random_bits(rng, shape, dtype)
    out = backend.asarray(garbage[0].copy()), backend.asarray(garbage[1].copy())
    got = backend.gather(stores.k, stores.v, LAYER, table, seq_lens, layout=layout,
                         out_layout=out_layout, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    want = REF.gather(stores.ref_k, stores.ref_v, LAYER, table, seq_lens, layout=layout,
                      out_layout=out_layout, num_positions=num_positions)
    for g, w in zip(got, want):
        g = host(backend, g)
        assert_same_bits(g, w)
        for b, n in enumerate(seq_lens):
            tail = g[b, n:] if out_layout == "BTHD" else g[b, :, n:]
            assert not tail.view(bits_view_dtype(g.dtype)).any()


@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_empty_batch(backend, layout, out_layout):
    rng = np.random.default_rng(3)
    stores = Stores(backend, rng, layout=layout, dtype="float32", page_size=16, num_pages=4)
    table = np.zeros((0, 2), np.int32)
    seq_lens = np.zeros(0, np.int32)
    k, v = backend.gather(stores.k, stores.v, 0, table, seq_lens, layout=layout,
                          out_layout=out_layout, num_positions=7)
    assert host(backend, k).shape[0] == 0 and host(backend, v).shape[0] == 0
    stores.assert_matches_reference()


@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_all_rows_empty(backend, layout, out_layout):
    rng = np.random.default_rng(4)
    stores = Stores(backend, rng, layout=layout, dtype="float16", page_size=16, num_pages=4)
    table = np.full((3, 2), -1, np.int32)
    seq_lens = np.zeros(3, np.int32)
    k, v = backend.gather(stores.k, stores.v, 0, table, seq_lens, layout=layout,
                          out_layout=out_layout, num_positions=4)
    for x in (host(backend, k), host(backend, v)):
        assert x.shape[0] == 3 and not x.view(np.uint16).any()


@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_large_batch(backend, dtype, layout, out_layout):
    """Big enough (several MiB out) for the engines' parallel/streaming paths."""
    rng = np.random.default_rng(5)
    page_size, num_heads, head_dim = 16, 4, 64
    seq_lens = np.array([1000, 17, 2048, 0, 1536, 16], np.int32)
    num_pages = pages_for(seq_lens, page_size)
    store = KVStore(1, page_size, num_heads, head_dim, num_pages=num_pages, dtype=dtype,
                    layout=layout, backend=backend)
    ref_k = random_bits(rng, store.shape, store.dtype)
    ref_v = random_bits(rng, store.shape, store.dtype)
    store.k[...], store.v[...] = backend.asarray(ref_k), backend.asarray(ref_v)
    table = make_page_table(rng, seq_lens, page_size, num_pages)
    got = backend.gather(store.k, store.v, 0, table, seq_lens, layout=layout,
                         out_layout=out_layout)
    want = REF.gather(ref_k, ref_v, 0, table, seq_lens, layout=layout, out_layout=out_layout)
    for g, w in zip(got, want):
        assert_same_bits(host(backend, g), w)


# ------------------------------------------------------------------- write
def random_slots(rng, num_tokens, num_slots, num_skipped) -> np.ndarray:
    slots = rng.permutation(num_slots)[:num_tokens].astype(np.int32)
    slots[rng.permutation(num_tokens)[:num_skipped]] = -1
    return slots


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_matches_reference(backend, dtype, layout, page_size):
    rng = np.random.default_rng(10 + page_size)
    num_pages = max(4, 64 // page_size)
    stores = Stores(backend, rng, layout=layout, dtype=dtype, page_size=page_size,
                    num_pages=num_pages)
    num_tokens = min(40, num_pages * page_size)
    slots = random_slots(rng, num_tokens, num_pages * page_size, num_skipped=5)
    k = random_bits(rng, (num_tokens, NUM_HEADS, HEAD_DIM), dtype)
    v = random_bits(rng, (num_tokens, NUM_HEADS, HEAD_DIM), dtype)
    backend.write(stores.k, stores.v, LAYER, slots, backend.asarray(k), backend.asarray(v),
                  layout=layout)
    REF.write(stores.ref_k, stores.ref_v, LAYER, slots, k, v, layout=layout)
    stores.assert_matches_reference()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_gather_round_trip(backend, dtype, layout, page_size):
    """Tokens written through a page table's slots come back in order."""
    rng = np.random.default_rng(20 + page_size)
    seq_lens = edge_seq_lens(page_size)
    stores = Stores(backend, rng, layout=layout, dtype=dtype, page_size=page_size,
                    num_pages=pages_for(seq_lens, page_size))
    table = make_page_table(rng, seq_lens, page_size, stores.store.num_pages)
    positions = [np.arange(n) for n in seq_lens]
    slots = np.concatenate([table[b, p // page_size] * page_size + p % page_size
                            for b, p in enumerate(positions)]).astype(np.int32)
    k = random_bits(rng, (slots.size, NUM_HEADS, HEAD_DIM), dtype)
    v = random_bits(rng, (slots.size, NUM_HEADS, HEAD_DIM), dtype)
    backend.write(stores.k, stores.v, 0, slots, backend.asarray(k), backend.asarray(v),
                  layout=layout)
    for out_layout in OUT_LAYOUTS:
        gk, gv = backend.gather(stores.k, stores.v, 0, table, seq_lens, layout=layout,
                                out_layout=out_layout)
        gk, gv = host(backend, gk), host(backend, gv)
        at = 0
        for b, n in enumerate(seq_lens):
            for got, new in ((gk, k), (gv, v)):
                rows = got[b, :n] if out_layout == "BTHD" else got[b, :, :n].transpose(1, 0, 2)
                assert_same_bits(np.ascontiguousarray(rows), new[at:at + n])
            at += n


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_strided_input(backend, dtype, layout):
    """k/v as a model hands them out: a [H, N, D] buffer seen as [N, H, D],
    and every other token of a bigger batch."""
    rng = np.random.default_rng(30)
    stores = Stores(backend, rng, layout=layout, dtype=dtype, page_size=16, num_pages=8)
    num_tokens = 20
    slots = random_slots(rng, num_tokens, 8 * 16, num_skipped=3)
    heads_first = random_bits(rng, (NUM_HEADS, num_tokens, HEAD_DIM), dtype)
    every_other = random_bits(rng, (2 * num_tokens, NUM_HEADS, HEAD_DIM), dtype)
    k_host, v_host = heads_first.transpose(1, 0, 2), every_other[::2]
    k = backend.asarray(heads_first).transpose(1, 0, 2)
    v = backend.asarray(every_other)[::2]
    assert not k.flags.c_contiguous and not v.flags.c_contiguous
    backend.write(stores.k, stores.v, LAYER, slots, k, v, layout=layout)
    REF.write(stores.ref_k, stores.ref_v, LAYER, slots, k_host, v_host, layout=layout)
    stores.assert_matches_reference()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_all_slots_skipped(backend, layout):
    rng = np.random.default_rng(31)
    stores = Stores(backend, rng, layout=layout, dtype="float16", page_size=4, num_pages=4)
    slots = np.full(6, -1, np.int32)
    k = backend.asarray(random_bits(rng, (6, NUM_HEADS, HEAD_DIM), "float16"))
    backend.write(stores.k, stores.v, 0, slots, k, k, layout=layout)
    stores.assert_matches_reference()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_no_tokens(backend, layout):
    rng = np.random.default_rng(32)
    stores = Stores(backend, rng, layout=layout, dtype="float32", page_size=4, num_pages=4)
    empty = backend.asarray(np.zeros((0, NUM_HEADS, HEAD_DIM), np.float32))
    backend.write(stores.k, stores.v, 0, np.zeros(0, np.int32), empty, empty, layout=layout)
    stores.assert_matches_reference()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_write_large_batch(backend, dtype, layout):
    """A prefill-sized write (several MiB) for the engines' parallel paths."""
    rng = np.random.default_rng(33)
    page_size, num_heads, head_dim, num_pages = 16, 8, 64, 320
    store = KVStore(1, page_size, num_heads, head_dim, num_pages=num_pages, dtype=dtype,
                    layout=layout, backend=backend)
    ref_k = random_bits(rng, store.shape, store.dtype)
    ref_v = random_bits(rng, store.shape, store.dtype)
    store.k[...], store.v[...] = backend.asarray(ref_k), backend.asarray(ref_v)
    slots = random_slots(rng, 4000, num_pages * page_size, num_skipped=50)
    k = random_bits(rng, (4000, num_heads, head_dim), dtype)
    v = random_bits(rng, (4000, num_heads, head_dim), dtype)
    backend.write(store.k, store.v, 0, slots, backend.asarray(k), backend.asarray(v),
                  layout=layout)
    REF.write(ref_k, ref_v, 0, slots, k, v, layout=layout)
    assert_same_bits(host(backend, store.k), ref_k)
    assert_same_bits(host(backend, store.v), ref_v)


# -------------------------------------------------------------- copy_pages
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_pages_matches_reference(backend, dtype, layout, page_size):
    rng = np.random.default_rng(40 + page_size)
    stores = Stores(backend, rng, layout=layout, dtype=dtype, page_size=page_size,
                    num_pages=12)
    order = rng.permutation(12).astype(np.int32)
    src, dst = order[:4], order[4:8]
    backend.copy_pages(stores.k, stores.v, src, dst, layout=layout)
    REF.copy_pages(stores.ref_k, stores.ref_v, src, dst, layout=layout)
    stores.assert_matches_reference()
    # every layer's copy equals its source page
    got = host(backend, stores.k)
    assert_same_bits(got[:, dst], got[:, src])


def test_copy_pages_none(backend):
    rng = np.random.default_rng(41)
    stores = Stores(backend, rng, layout="NHD", dtype="float32", page_size=4, num_pages=4)
    none = np.zeros(0, np.int32)
    backend.copy_pages(stores.k, stores.v, none, none)
    stores.assert_matches_reference()


# -------------------------------------------------------------- validation
@pytest.fixture
def small(backend):
    rng = np.random.default_rng(50)
    stores = Stores(backend, rng, layout="NHD", dtype="float32", page_size=4, num_pages=6)
    k = backend.asarray(random_bits(rng, (3, NUM_HEADS, HEAD_DIM), "float32"))
    return stores, k


def test_write_out_of_range_slot(backend, small):
    stores, k = small
    snap = stores.snapshot()
    for bad in (24, 1000, -2):
        with pytest.raises(PageIdError, match="slot_mapping"):
            backend.write(stores.k, stores.v, 0, np.array([0, bad, 2], np.int32), k, k)
    stores.assert_unchanged(snap)


def test_write_duplicate_slot(backend, small):
    stores, k = small
    snap = stores.snapshot()
    with pytest.raises(PageIdError, match="slot_mapping"):
        backend.write(stores.k, stores.v, 0, np.array([5, 7, 5], np.int32), k, k)
    stores.assert_unchanged(snap)


def test_write_wrong_dtype(backend, small):
    stores, k = small
    snap = stores.snapshot()
    slots = np.arange(3, dtype=np.int32)
    wrong = backend.asarray(np.zeros(k.shape, np.float16))
    with pytest.raises(DTypeError, match="dtype of k"):
        backend.write(stores.k, stores.v, 0, slots, wrong, k)
    with pytest.raises(DTypeError, match="slot_mapping"):
        backend.write(stores.k, stores.v, 0, slots.astype(np.int64), k, k)
    stores.assert_unchanged(snap)


def test_write_wrong_shape(backend, small):
    stores, k = small
    snap = stores.snapshot()
    with pytest.raises(ShapeError, match="shape of v"):
        backend.write(stores.k, stores.v, 0, np.arange(3, dtype=np.int32), k, k[:, :2])
    with pytest.raises(ShapeError, match="shape of k"):
        backend.write(stores.k, stores.v, 0, np.arange(2, dtype=np.int32), k, k[:2])
    stores.assert_unchanged(snap)


def test_gather_unassigned_page_within_length(backend, small):
    stores, _ = small
    snap = stores.snapshot()
    table = np.array([[0, -1, 2]], np.int32)  # page 1 of a 9-token sequence missing
    out = tuple(backend.asarray(np.ones((1, 9, NUM_HEADS, HEAD_DIM), np.float32))
                for _ in range(2))
    with pytest.raises(PageIdError, match="page_table"):
        backend.gather(stores.k, stores.v, 0, table, np.array([9], np.int32), out=out)
    stores.assert_unchanged(snap)
    assert (host(backend, out[0]) == 1).all()  # nothing written before the error


def test_gather_wrong_dtype_and_shape(backend, small):
    stores, _ = small
    snap = stores.snapshot()
    table, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
    with pytest.raises(DTypeError, match="seq_lens"):
        backend.gather(stores.k, stores.v, 0, table, lens.astype(np.int64))
    wrong_dtype = tuple(backend.asarray(np.zeros((1, 5, NUM_HEADS, HEAD_DIM), np.float16))
                        for _ in range(2))
    with pytest.raises(DTypeError, match=r"out\[0\]"):
        backend.gather(stores.k, stores.v, 0, table, lens, out=wrong_dtype)
    wrong_shape = tuple(backend.asarray(np.zeros((1, 5, NUM_HEADS + 1, HEAD_DIM), np.float32))
                        for _ in range(2))
    with pytest.raises(ShapeError, match=r"shape of out\[0\]"):
        backend.gather(stores.k, stores.v, 0, table, lens, out=wrong_shape)
    short = tuple(backend.asarray(np.zeros((1, 4, NUM_HEADS, HEAD_DIM), np.float32))
                  for _ in range(2))
    with pytest.raises(ShapeError, match="shorter"):
        backend.gather(stores.k, stores.v, 0, table, lens, out=short)
    stores.assert_unchanged(snap)


def test_gather_non_contiguous_out(backend, small):
    stores, _ = small
    snap = stores.snapshot()
    table, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
    big = backend.asarray(np.ones((1, 10, NUM_HEADS, HEAD_DIM), np.float32))
    ok = backend.asarray(np.ones((1, 5, NUM_HEADS, HEAD_DIM), np.float32))
    with pytest.raises(ShapeError, match=r"out\[0\]"):
        backend.gather(stores.k, stores.v, 0, table, lens, out=(big[:, ::2], ok))
    stores.assert_unchanged(snap)
    assert (host(backend, big) == 1).all() and (host(backend, ok) == 1).all()


def test_copy_pages_invalid(backend, small):
    stores, _ = small
    snap = stores.snapshot()
    with pytest.raises(PageIdError, match="dst_pages"):
        backend.copy_pages(stores.k, stores.v, np.array([0], np.int32), np.array([6], np.int32))
    with pytest.raises(DTypeError, match="src_pages"):
        backend.copy_pages(stores.k, stores.v, np.array([0], np.int64), np.array([1], np.int64))
    stores.assert_unchanged(snap)


# ---------------------------------------------------------------- aliasing
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_refuses_a_source_that_aliases_the_store(backend, layout):
    """K/V rows read from the store itself: a kernel writing in its own order
    would read rows it has already overwritten, so every backend refuses."""
    rng = np.random.default_rng(60)
    stores = Stores(backend, rng, layout=layout, dtype="float32", page_size=4, num_pages=6)
    snap = stores.snapshot()
    slots = np.array([9, 10, 11, 12], np.int32)
    # four rows of layer 0's page 1 (NHD) or of its first head and beyond (HND)
    src = stores.k[0, 1] if layout == "NHD" else stores.k[0, 1].transpose(1, 0, 2)
    src = src[:, :NUM_HEADS] if layout == "NHD" else src
    other = backend.asarray(np.zeros((4, NUM_HEADS, HEAD_DIM), np.float32))
    with pytest.raises(ShapeError, match="Invalid k: it shares memory with the store"):
        backend.write(stores.k, stores.v, 0, slots, src, other, layout=layout)
    with pytest.raises(ShapeError, match="Invalid v: it shares memory with the store"):
        backend.write(stores.k, stores.v, 0, slots, other, stores.v[1, 2, :4][:, :NUM_HEADS]
                      if layout == "NHD" else stores.v[1, 2].transpose(1, 0, 2), layout=layout)
    stores.assert_unchanged(snap)


def test_cache_write_refuses_a_source_that_aliases_the_store(backend):
    from pagedkv_np import PagedKVCache

    cache = PagedKVCache(1, 6, 4, NUM_HEADS, HEAD_DIM, backend=backend, dtype="float32")
    seq = cache.add_sequence([1, 2, 3, 4, 5])
    cache.extend(seq, [1, 2, 3, 4, 5])
    plan = cache.plan([seq])
    src = cache.v_cache.reshape(-1)[:5 * NUM_HEADS * HEAD_DIM].reshape(5, NUM_HEADS, HEAD_DIM)
    ok = backend.asarray(np.ones((5, NUM_HEADS, HEAD_DIM), np.float32))
    before = host(backend, cache.k_cache).copy()
    with pytest.raises(ShapeError, match="shares memory with the store"):
        cache.write(0, plan, src, ok)
    assert_same_bits(host(backend, cache.k_cache), before)


# -------------------------------------------------------------- int8 stores
Q_HEAD_DIMS = [8, 64]


def quant_inputs(rng, shape, dtype) -> np.ndarray:
    """K/V values over many magnitudes, with every edge the format defines:
    NaN, infinities, subnormals, all-zero groups, groups whose scale would be
    subnormal, the largest finite values and exact halves of a step."""
    dtype = resolve_dtype(dtype)
    n, h, d = shape
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, (n, h, 1))
    finfo_max = float(np.finfo(np.float16).max) if dtype == np.float16 else 3.0e38
    edges = [np.nan, np.inf, -np.inf, 1e-40, -1e-39, 0.0, finfo_max, -finfo_max]
    x[0, 0, :len(edges[:d])] = edges[:d]
    x[1 % n] = 0.0                                  # all-zero heads
    x[2 % n, 0] = 1e-37 * rng.standard_normal(d)    # a subnormal scale, stored as 0
    x[3 % n, 0] = np.arange(d) % 7 - 3.5            # halves of the step 1... after scaling
    x[3 % n, 0, 0] = 127.0
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float32).astype(dtype)


class QStores:
    """The same random int8 store (codes and scales) on ``backend`` and the host."""

    def __init__(self, backend, rng, *, layout, page_size, num_pages, head_dim=HEAD_DIM):
        self.backend = backend
        store = KVStore(NUM_LAYERS, page_size, NUM_HEADS, head_dim, num_pages=num_pages,
                        dtype="int8", layout=layout, backend=backend)
        self.ref = [rng.integers(-127, 128, store.shape).astype(np.int8) for _ in range(2)]
        # scales over the whole range (16-bit outputs meet subnormals and
        # overflow), zeros among them
        for _ in range(2):
            s = (2.0 ** rng.uniform(-126, 100, store.k_scale.shape)).astype(np.float32)
            s[rng.random(s.shape) < 0.05] = 0
            self.ref.append(s)
        for arr, ref in zip(self.arrays(store), self.ref):
            arr[...] = backend.asarray(ref)
        self.store = store

    @staticmethod
    def arrays(store):
        return store.k, store.v, store.k_scale, store.v_scale

    def assert_matches_reference(self) -> None:
        for arr, ref in zip(self.arrays(self.store), self.ref):
            assert_same_bits(host(self.backend, arr), ref)


@pytest.mark.parametrize("head_dim", Q_HEAD_DIMS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_quantized_matches_reference(backend, dtype, layout, page_size, head_dim):
    rng = np.random.default_rng(70 + page_size + head_dim)
    num_pages = max(4, 64 // page_size)
    stores = QStores(backend, rng, layout=layout, page_size=page_size, num_pages=num_pages,
                     head_dim=head_dim)
    num_tokens = min(40, num_pages * page_size)
    slots = random_slots(rng, num_tokens, num_pages * page_size, num_skipped=5)
    k = quant_inputs(rng, (num_tokens, NUM_HEADS, head_dim), dtype)
    v = quant_inputs(rng, (num_tokens, NUM_HEADS, head_dim), dtype)[::-1].copy()
    backend.write_quantized(*QStores.arrays(stores.store), LAYER, slots, backend.asarray(k),
                            backend.asarray(v), layout=layout)
    REF.write_quantized(*stores.ref, LAYER, slots, k, v, layout=layout)
    stores.assert_matches_reference()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_quantized_strided_input(backend, dtype, layout):
    rng = np.random.default_rng(71)
    stores = QStores(backend, rng, layout=layout, page_size=16, num_pages=8)
    num_tokens = 20
    slots = random_slots(rng, num_tokens, 8 * 16, num_skipped=3)
    heads_first = quant_inputs(rng, (NUM_HEADS, num_tokens, HEAD_DIM), dtype)
    every_other = quant_inputs(rng, (2 * num_tokens, NUM_HEADS, HEAD_DIM), dtype)
    k = backend.asarray(heads_first).transpose(1, 0, 2)
    v = backend.asarray(every_other)[::2]
    backend.write_quantized(*QStores.arrays(stores.store), LAYER, slots, k, v, layout=layout)
    REF.write_quantized(*stores.ref, LAYER, slots, heads_first.transpose(1, 0, 2),
                        every_other[::2], layout=layout)
    stores.assert_matches_reference()


@pytest.mark.parametrize("head_dim", Q_HEAD_DIMS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_quantized_matches_reference(backend, dtype, layout, out_layout, page_size,
                                            head_dim):
    rng = np.random.default_rng(80 + page_size + head_dim)
    seq_lens = edge_seq_lens(page_size)
    stores = QStores(backend, rng, layout=layout, page_size=page_size,
                     num_pages=pages_for(seq_lens, page_size), head_dim=head_dim)
    table = make_page_table(rng, seq_lens, page_size, stores.store.num_pages)
    num_positions = int(seq_lens.max()) + 3
    shape = ((len(seq_lens), num_positions, NUM_HEADS, head_dim) if out_layout == "BTHD"
             else (len(seq_lens), NUM_HEADS, num_positions, head_dim))
    out = tuple(backend.asarray(random_bits(rng, shape, dtype)) for _ in range(2))
    got = backend.gather_quantized(*QStores.arrays(stores.store), LAYER, table, seq_lens,
                                   layout=layout, out_layout=out_layout, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    want = REF.gather_quantized(*stores.ref, LAYER, table, seq_lens, layout=layout,
                                out_layout=out_layout, num_positions=num_positions,
                                dtype=dtype)
    for g, w in zip(got, want):
        assert_same_bits(host(backend, g), w)
    # allocated outputs: float32 unless asked
    fresh = backend.gather_quantized(*QStores.arrays(stores.store), LAYER, table, seq_lens,
                                     layout=layout, out_layout=out_layout)
    assert host(backend, fresh[0]).dtype == np.float32
    stores.assert_matches_reference()  # gather reads only


@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_write_then_gather_round_trip(backend, dtype, layout, out_layout):
    rng = np.random.default_rng(90)
    page_size = 16
    seq_lens = edge_seq_lens(page_size)
    stores = QStores(backend, rng, layout=layout, page_size=page_size,
                     num_pages=pages_for(seq_lens, page_size), head_dim=64)
    table = make_page_table(rng, seq_lens, page_size, stores.store.num_pages)
    slots = np.concatenate([table[b, np.arange(n) // page_size] * page_size
                            + np.arange(n) % page_size
                            for b, n in enumerate(seq_lens)]).astype(np.int32)
    k = quant_inputs(rng, (slots.size, NUM_HEADS, 64), dtype)
    v = quant_inputs(rng, (slots.size, NUM_HEADS, 64), dtype)
    backend.write_quantized(*QStores.arrays(stores.store), 0, slots, backend.asarray(k),
                            backend.asarray(v), layout=layout)
    gk, gv = backend.gather_quantized(*QStores.arrays(stores.store), 0, table, seq_lens,
                                      layout=layout, out_layout=out_layout, dtype=dtype)
    gk, gv = host(backend, gk), host(backend, gv)
    from pagedkv_np.quant import dequantize, quantize

    at = 0
    for b, n in enumerate(seq_lens):
        for got, new in ((gk, k), (gv, v)):
            rows = got[b, :n] if out_layout == "BTHD" else got[b, :, :n].transpose(1, 0, 2)
            assert_same_bits(np.ascontiguousarray(rows),
                             dequantize(*quantize(new[at:at + n]), dtype))
        at += n


@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_large_batch(backend, layout, out_layout):
    """Several MiB each way: the engines' parallel paths."""
    rng = np.random.default_rng(91)
    page_size, head_dim = 16, 128
    seq_lens = np.array([1000, 17, 2048, 0, 1536, 16], np.int32)
    num_pages = pages_for(seq_lens, page_size)
    stores = QStores(backend, rng, layout=layout, page_size=page_size, num_pages=num_pages,
                     head_dim=head_dim)
    slots = random_slots(rng, 3000, num_pages * page_size, num_skipped=40)
    k = quant_inputs(rng, (3000, NUM_HEADS, head_dim), "bfloat16")
    backend.write_quantized(*QStores.arrays(stores.store), 1, slots, backend.asarray(k),
                            backend.asarray(k), layout=layout)
    REF.write_quantized(*stores.ref, 1, slots, k, k, layout=layout)
    stores.assert_matches_reference()
    table = make_page_table(rng, seq_lens, page_size, num_pages)
    for dtype in ("float32", "float16"):
        got = backend.gather_quantized(*QStores.arrays(stores.store), 1, table, seq_lens,
                                       layout=layout, out_layout=out_layout, dtype=dtype)
        want = REF.gather_quantized(*stores.ref, 1, table, seq_lens, layout=layout,
                                    out_layout=out_layout, dtype=dtype)
        for g, w in zip(got, want):
            assert_same_bits(host(backend, g), w)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_pages_of_an_int8_store(backend, layout, page_size):
    rng = np.random.default_rng(92 + page_size)
    stores = QStores(backend, rng, layout=layout, page_size=page_size, num_pages=12)
    order = rng.permutation(12).astype(np.int32)
    src, dst = order[:4], order[4:8]
    stores.store.copy_pages(src, dst)
    REF.copy_pages(stores.ref[0], stores.ref[1], src, dst, layout=layout)
    REF.copy_pages(stores.ref[2], stores.ref[3], src, dst, layout=layout)
    stores.assert_matches_reference()


def test_plain_write_and_gather_refuse_an_int8_store(backend):
    rng = np.random.default_rng(93)
    stores = QStores(backend, rng, layout="NHD", page_size=4, num_pages=4)
    k = backend.asarray(np.zeros((1, NUM_HEADS, HEAD_DIM), np.int8))
    with pytest.raises(DTypeError, match="write_quantized"):
        backend.write(stores.store.k, stores.store.v, 0, np.zeros(1, np.int32), k, k)
    with pytest.raises(DTypeError, match="gather_quantized"):
        backend.gather(stores.store.k, stores.store.v, 0, np.zeros((1, 1), np.int32),
                       np.ones(1, np.int32))
    stores.assert_matches_reference()


def test_quantized_write_refuses_a_source_that_aliases_the_scales(backend):
    rng = np.random.default_rng(94)
    stores = QStores(backend, rng, layout="NHD", page_size=4, num_pages=4)
    flat = stores.store.k_scale.reshape(-1)
    src = flat[:NUM_HEADS * HEAD_DIM].reshape(1, NUM_HEADS, HEAD_DIM)
    with pytest.raises(ShapeError, match="Invalid k: it shares memory with the store"):
        backend.write_quantized(*QStores.arrays(stores.store), 0, np.zeros(1, np.int32), src,
                                src.copy())
    stores.assert_matches_reference()
