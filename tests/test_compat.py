"""The seed's API on NumPy arrays: PagedCache and CacheView."""

import numpy as np
import pytest

from pagedkv_np import CacheView, PagedCache
from pagedkv_np.errors import (
    ConfigError,
    DTypeError,
    OutOfPages,
    PageIdError,
    PageStateError,
    ShapeError,
)
from pagedkv_np.layout import resolve_dtype
from pagedkv_np.pool import EVICTABLE, FREE, USED

PS = 4


def bits(x):
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def make(backend, n_pages=8, dtype="float32", n_layers=2, page_size=PS, n_kv_heads=2,
         head_dim=3):
    return PagedCache(n_layers, n_pages, page_size, n_kv_heads, head_dim, dtype=dtype,
                      backend=backend, hash_secret=b"compat-secret")


def host(cache, x):
    """``x``, an array of the cache's backend (its store, a gather), on the host."""
    return cache._backend.to_numpy(x)


def dev(cache, x):
    """Host array ``x`` as an array of the cache's backend (the K/V a model
    on that device would pass)."""
    return cache._backend.asarray(x)


def rand_kv(rng, shape, dtype="float32"):
    return rng.integers(-100, 100, size=shape).astype(np.float32).astype(resolve_dtype(dtype))


def record_prompt(cache, tokens):
    """Allocate, record and free the full pages of ``tokens``, as a seed
    caller would after prefill; return the pages."""
    n = len(tokens) // cache.page_size
    pages = cache.alloc_n(n)
    for i, p in enumerate(pages):
        cache.record_page(p, tokens, i)
    for p in reversed(pages):
        cache.free(p)
    return pages


# ------------------------------------------------------------ construction

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_construction_and_seed_attributes(dtype, cache_backend):
    cache = make(cache_backend, n_pages=5, dtype=dtype)
    assert cache.k_cache.shape == cache.v_cache.shape == (2, 5, PS, 2, 3)
    assert cache.k_cache.dtype == resolve_dtype(dtype)
    assert not bits(host(cache, cache.k_cache)).any()
    assert not bits(host(cache, cache.v_cache)).any()
    assert cache.page_size == PS
    assert (cache.lookup_hits, cache.lookup_misses) == (0, 0)
    assert cache.pool.num_pages == 5


@pytest.mark.parametrize("kw, error, word", [
    ({"n_pages": 0}, ConfigError, "num_pages"), ({"page_size": 0}, ConfigError, "page_size"),
    ({"dtype": "float64"}, DTypeError, "dtype"), ({"n_layers": 1.5}, DTypeError, "num_layers")])
def test_bad_construction(kw, error, word, cache_backend):
    with pytest.raises(error, match=word):
        make(cache_backend, **kw)


# ------------------------------------------------------------ the pool

def test_alloc_hands_out_lowest_free_ids(cache_backend):
    cache = make(cache_backend, n_pages=4)
    assert [cache.alloc() for _ in range(3)] == [0, 1, 2]
    cache.free(1)
    assert cache.alloc() == 1


def test_alloc_raises_when_the_pool_is_exhausted(cache_backend):
    # The seed returned -1, which its write then treated as the last page.
    cache = make(cache_backend, n_pages=2)
    cache.alloc(), cache.alloc()
    with pytest.raises(OutOfPages) as info:
        cache.alloc()
    assert (info.value.num_needed, info.value.num_available) == (1, 0)


def test_alloc_evicts_the_least_recently_used_cached_page(cache_backend):
    cache = make(cache_backend, n_pages=4)
    first = record_prompt(cache, list(range(8)))          # pages 0, 1; freed 1 then 0
    assert cache.pool.lru_order() == [1, 0]
    assert [cache.alloc(), cache.alloc()] == [2, 3]       # free pages first
    assert cache.alloc() == 1                             # then the LRU page
    assert cache.lookup_prefix(list(range(9))) == [0]     # its prefix entry is gone
    assert first == [0, 1]


def test_alloc_n_is_all_or_nothing(cache_backend):
    cache = make(cache_backend, n_pages=6)
    record_prompt(cache, list(range(8)))                  # 2 evictable pages
    cache.alloc_n(3)                                      # 1 free page left
    before = snapshot(cache)
    assert cache.alloc_n(4) == []                         # only 3 available
    assert snapshot(cache) == before                      # nothing evicted
    assert cache.lookup_prefix(list(range(9))) == [0, 1]
    assert sorted(cache.alloc_n(3)) == [0, 1, 5]
    assert cache.alloc_n(0) == []


def test_free_drops_one_reference(cache_backend):
    cache = make(cache_backend)
    p = cache.alloc()
    cache.inc_ref(p)
    cache.free(p)
    assert cache.pool.state(p) == USED and cache.pool.ref_count(p) == 1
    cache.free(p)
    assert cache.pool.state(p) == FREE


def test_double_free_raises_and_changes_nothing(cache_backend):
    cache = make(cache_backend)
    p = cache.alloc()
    cache.free(p)
    before = snapshot(cache)
    with pytest.raises(PageStateError, match="double free"):
        cache.free(p)
    assert snapshot(cache) == before
    assert cache.pool.ref_count(p) == 0
    assert cache.alloc() == p  # not lost


def test_recorded_page_persists_after_free_and_is_revived_by_inc_ref(cache_backend):
    cache = make(cache_backend)
    tokens = list(range(9))
    pages = record_prompt(cache, tokens)
    assert all(cache.pool.state(p) == EVICTABLE for p in pages)
    hits = cache.lookup_prefix(tokens)
    assert hits == pages
    for p in hits:
        cache.inc_ref(p)
    assert all(cache.pool.state(p) == USED for p in pages)
    assert cache.pool.num_evictable == 0
    for p in reversed(hits):
        cache.free(p)
    assert cache.pool.lru_order() == pages[::-1]


def test_inc_ref_of_a_free_page_raises(cache_backend):
    cache = make(cache_backend)
    before = snapshot(cache)
    with pytest.raises(PageStateError, match="free"):
        cache.inc_ref(3)
    assert snapshot(cache) == before


@pytest.mark.parametrize("method", ["free", "inc_ref"])
@pytest.mark.parametrize("bad, error", [(8, PageIdError), (-1, PageIdError),
                                        (1.0, DTypeError), ("1", DTypeError)])
def test_bad_page_id_raises_and_changes_nothing(method, bad, error, cache_backend):
    cache = make(cache_backend)
    cache.alloc_n(2)
    before = snapshot(cache)
    with pytest.raises(error, match="page"):
        getattr(cache, method)(bad)
    assert snapshot(cache) == before


@pytest.mark.parametrize("method", ["free", "inc_ref"])
def test_bad_page_id_message_names_idx(method, cache_backend):
    cache = make(cache_backend)
    with pytest.raises(PageIdError, match=r"Invalid idx\b"):
        getattr(cache, method)(8)


@pytest.mark.parametrize("bad, error", [(-1, ConfigError), (2.0, DTypeError)])
def test_bad_alloc_n_count_raises_and_changes_nothing(bad, error, cache_backend):
    cache = make(cache_backend)
    before = snapshot(cache)
    with pytest.raises(error):
        cache.alloc_n(bad)
    assert snapshot(cache) == before


def test_bad_alloc_n_count_message_names_n(cache_backend):
    with pytest.raises(ConfigError, match=r"Invalid n\b"):
        make(cache_backend).alloc_n(-1)


# ------------------------------------------------------------ prefix index

def test_lookup_prefix_counts_hits_and_misses(cache_backend):
    cache = make(cache_backend)
    tokens = list(range(13))  # 3 full pages
    record_prompt(cache, tokens[:8])
    assert cache.lookup_prefix(tokens) == [0, 1]          # page 2 not recorded
    assert (cache.lookup_hits, cache.lookup_misses) == (2, 1)
    assert cache.lookup_prefix(tokens[:9]) == [0, 1]      # everything that could hit did
    assert (cache.lookup_hits, cache.lookup_misses) == (4, 1)
    assert cache.lookup_prefix([50] * 9) == []
    assert (cache.lookup_hits, cache.lookup_misses) == (4, 2)
    assert cache.lookup_prefix([]) == []
    assert (cache.lookup_hits, cache.lookup_misses) == (4, 2)


def test_lookup_prefix_leaves_the_last_token_uncached(cache_backend):
    cache = make(cache_backend)
    record_prompt(cache, list(range(8)))
    assert cache.lookup_prefix(list(range(8))) == [0]
    assert cache.lookup_prefix(list(range(9))) == [0, 1]


def test_lookup_prefix_takes_no_reference_but_refreshes_lru(cache_backend):
    cache = make(cache_backend)
    a = record_prompt(cache, [1] * 4)
    b = record_prompt(cache, [2] * 4)
    assert cache.pool.lru_order() == a + b
    assert cache.lookup_prefix([1] * 5) == a
    assert cache.pool.lru_order() == b + a
    assert cache.pool.ref_count(a[0]) == 0


def test_lookup_is_chained_over_earlier_pages(cache_backend):
    # Differs from the seed: a page with equal tokens after another prefix,
    # or at another position, is not a hit.
    cache = make(cache_backend)
    record_prompt(cache, [1, 1, 1, 1, 2, 2, 2, 2])
    assert cache.lookup_prefix([3, 3, 3, 3, 2, 2, 2, 2, 0]) == []
    assert cache.lookup_prefix([2, 2, 2, 2, 0]) == []


def test_record_page_needs_its_parent_recorded(cache_backend):
    cache = make(cache_backend)
    pages = cache.alloc_n(2)
    tokens = list(range(9))
    cache.record_page(pages[1], tokens, 1)  # parent (page 0 of tokens) not indexed
    assert not cache.pool.is_cached(pages[1])
    cache.record_page(pages[0], tokens, 0)
    cache.record_page(pages[1], tokens, 1)
    assert cache.lookup_prefix(tokens) == pages


def test_record_page_of_a_free_page_raises(cache_backend):
    # The seed dropped such a page from its LRU for good (a leak).
    cache = make(cache_backend)
    p = cache.alloc()
    cache.free(p)
    before = snapshot(cache)
    with pytest.raises(PageStateError, match="page_idx"):
        cache.record_page(p, list(range(4)), 0)
    assert snapshot(cache) == before


@pytest.mark.parametrize("args, error, word", [
    ((0, [1, 2, 3], 0), PageIdError, "logical_page_idx"),     # a partial page
    ((0, list(range(8)), 2), PageIdError, "logical_page_idx"),
    ((0, list(range(8)), -1), PageIdError, "logical_page_idx"),
    ((0, list(range(8)), 1.0), DTypeError, "logical_page_idx"),
    ((9, list(range(8)), 0), PageIdError, "page_idx"),
    ((0.0, list(range(8)), 0), DTypeError, "page_idx"),
    ((0, [0.5] * 4, 0), DTypeError, "token_ids"),
    ((0, "abcd", 0), DTypeError, "token_ids"),
])
def test_record_page_bad_arguments(args, error, word, cache_backend):
    cache = make(cache_backend)
    cache.alloc()
    before = snapshot(cache)
    with pytest.raises(error, match=word):
        cache.record_page(*args)
    assert snapshot(cache) == before


def test_lookup_prefix_bad_tokens(cache_backend):
    cache = make(cache_backend)
    with pytest.raises(DTypeError, match="token_ids"):
        cache.lookup_prefix([1.5, 2])


# ------------------------------------------------------------ write / gather

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_write_then_gather_round_trip(dtype, cache_backend):
    rng = np.random.default_rng(1)
    cache = make(cache_backend, n_pages=8, dtype=dtype)
    table = np.array([[3, 5, 1], [0, 7, 2]])
    k = rand_kv(rng, (2, 10, 2, 3), dtype)
    v = rand_kv(rng, (2, 10, 2, 3), dtype)
    for layer in range(2):
        cache.write(layer, table, 0, dev(cache, k), dev(cache, v))
    # Seed-style: a step of 2 more tokens at position 10.
    k2, v2 = rand_kv(rng, (2, 2, 2, 3), dtype), rand_kv(rng, (2, 2, 2, 3), dtype)
    cache.write(1, table, 10, dev(cache, k2), dev(cache, v2))
    gk, gv = (host(cache, x) for x in cache.gather(1, table))
    assert gk.shape == (2, 12, 2, 3) and gk.dtype == resolve_dtype(dtype)
    assert np.array_equal(bits(gk), bits(np.concatenate([k, k2], axis=1)))
    assert np.array_equal(bits(gv), bits(np.concatenate([v, v2], axis=1)))
    gk0 = host(cache, cache.gather(0, table)[0])
    assert np.array_equal(bits(gk0[:, :10]), bits(k)) and not bits(gk0[:, 10:]).any()
    # Pages land where the table says: token 5 of row 1 is page 7, offset 1.
    assert np.array_equal(bits(host(cache, cache.k_cache)[0, 7, 1]), bits(k[1, 5]))


def test_write_takes_a_start_position_per_row(cache_backend):
    # The seed had one start_pos for the whole batch.
    rng = np.random.default_rng(2)
    cache = make(cache_backend, n_pages=8)
    table = np.array([[0, 1, -1], [2, 3, 4]])
    k = rand_kv(rng, (2, 3, 2, 3))
    cache.write(0, table, np.array([2, 9]), dev(cache, k), dev(cache, k))
    store = host(cache, cache.k_cache)
    assert np.array_equal(store[0, 0, 2:4], k[0, :2])
    assert np.array_equal(store[0, 1, 0], k[0, 2])
    assert np.array_equal(store[0, 4, 1:4], k[1])
    gk = host(cache, cache.gather(0, table, seq_lens=np.array([5, 12]))[0])
    assert np.array_equal(gk[0, 2:5], k[0]) and np.array_equal(gk[1, 9:12], k[1])
    assert gk.shape == (2, 12, 2, 3) and not gk[0, 5:].any()


def test_write_lengths_limit_each_row(cache_backend):
    rng = np.random.default_rng(3)
    cache = make(cache_backend, n_pages=8)
    table = np.array([[0, -1], [1, 2]])
    k = rand_kv(rng, (2, 6, 2, 3))
    cache.write(0, table, [0, 0], dev(cache, k), dev(cache, k), lengths=np.array([3, 6]))
    store = host(cache, cache.k_cache)
    assert np.array_equal(store[0, 0, :3], k[0, :3])
    assert not store[0, 0, 3:].any()  # row 0's padding tokens were not written
    assert np.array_equal(store[0, 2, :2], k[1, 4:])


def test_write_to_page_minus_one_raises_and_changes_nothing(cache_backend):
    # The seed wrote such tokens into the last page of the store.
    rng = np.random.default_rng(4)
    cache = make(cache_backend, n_pages=4)
    table = np.array([[0, -1], [1, 2]])
    k = dev(cache, rand_kv(rng, (2, 6, 2, 3)))
    before = snapshot(cache)
    with pytest.raises(PageIdError, match="page -1"):
        cache.write(0, table, 0, k, k)
    # The last offset of page -1 would be slot -1 (the "skip" marker): still refused.
    with pytest.raises(PageIdError, match="page -1"):
        cache.write(0, np.array([[2, -1]]), PS * 2 - 1, k[:1, :1], k[:1, :1])
    assert snapshot(cache) == before
    assert not host(cache, cache.k_cache).any()


def test_write_past_the_page_table_raises(cache_backend):
    cache = make(cache_backend)
    k = dev(cache, np.ones((1, 3, 2, 3), np.float32))
    with pytest.raises(PageIdError, match="start_pos"):
        cache.write(0, np.array([[0]]), 2, k, k)
    assert not host(cache, cache.k_cache).any()


def test_write_of_no_tokens_is_a_no_op(cache_backend):
    cache = make(cache_backend)
    k = dev(cache, np.ones((1, 0, 2, 3), np.float32))
    cache.write(0, np.array([[0]]), 0, k, k)
    assert not host(cache, cache.k_cache).any()


def test_gather_zero_fills_rows_with_fewer_pages(cache_backend):
    # The seed read page -1 (the store's last page) for such rows, and
    # returned uninitialised memory past each length.
    cache = make(cache_backend, n_pages=4)
    cache.k_cache[...] = 7.0
    cache.v_cache[...] = 7.0
    gk, gv = (host(cache, x) for x in cache.gather(0, np.array([[0, 1], [2, -1], [-1, -1]])))
    assert gk.shape == (3, 8, 2, 3)
    assert (gk[0] == 7).all() and (gk[1, :4] == 7).all()
    assert not gk[1, 4:].any() and not gk[2].any() and not gv[2].any()


def test_gather_with_seq_lens(cache_backend):
    cache = make(cache_backend, n_pages=4)
    cache.k_cache[...] = 1.0
    gk = host(cache, cache.gather(1, np.array([[0, 1], [2, 3]]), seq_lens=[5, 2])[0])
    assert gk.shape == (2, 5, 2, 3)
    assert (gk[0] == 1).all() and (gk[1, :2] == 1).all() and not gk[1, 2:].any()


def test_gather_of_an_empty_table(cache_backend):
    cache = make(cache_backend)
    gk, gv = cache.gather(0, np.zeros((2, 0), np.int32))
    assert gk.shape == (2, 0, 2, 3)


BAD_DATA_CALLS = [
    ("write page out of range",
     lambda c, k: c.write(0, np.array([[0, 9]]), 0, k, k),
     PageIdError, "page_table"),
    ("write page below -1",
     lambda c, k: c.write(0, np.array([[0, -2]]), 0, k, k),
     PageIdError, "page_table"),
    ("write 1-D table",
     lambda c, k: c.write(0, np.array([0, 1]), 0, k, k),
     ShapeError, "page_table"),
    ("write float table",
     lambda c, k: c.write(0, np.array([[0.0, 1.0]]), 0, k, k),
     DTypeError, "page_table"),
    ("write float start",
     lambda c, k: c.write(0, np.array([[0, 1]]), 1.5, k, k),
     DTypeError, "start_pos"),
    ("write negative start",
     lambda c, k: c.write(0, np.array([[0, 1]]), -1, k, k),
     PageIdError, "start_pos"),
    ("write start per row mismatch",
     lambda c, k: c.write(0, np.array([[0, 1]]), [0, 0], k, k),
     ShapeError, "start_pos"),
    ("write k shape",
     lambda c, k: c.write(0, np.array([[0, 1]]), 0, k[:, :, :1], k),
     ShapeError, "k"),
    ("write v shape",
     lambda c, k: c.write(0, np.array([[0, 1]]), 0, k, k[:, :2]),
     ShapeError, "v"),
    ("write k dtype",
     lambda c, k: c.write(0, np.array([[0, 1]]), 0, k.astype(np.float16), k),
     DTypeError, "k"),
    ("write k list",
     lambda c, k: c.write(0, np.array([[0, 1]]), 0, k.tolist(), k),
     DTypeError, "k"),
    ("write rows mismatch",
     lambda c, k: c.write(0, np.array([[0, 1], [2, 3]]), 0, k, k),
     ShapeError, "k"),
    ("write lengths too long",
     lambda c, k: c.write(0, np.array([[0, 1]]), 0, k, k, lengths=[9]),
     ShapeError, "lengths"),
    ("write lengths shape",
     lambda c, k: c.write(0, np.array([[0, 1]]), 0, k, k, lengths=[1, 1]),
     ShapeError, "lengths"),
    ("write layer range",
     lambda c, k: c.write(2, np.array([[0, 1]]), 0, k, k),
     PageIdError, "layer"),
    ("write layer type",
     lambda c, k: c.write(None, np.array([[0, 1]]), 0, k, k),
     DTypeError, "layer"),
    ("write duplicate slot",
     lambda c, k: c.write(0, np.array([[0, 0]]), 0, k, k),
     PageIdError, "slot"),
    ("gather page out of range",
     lambda c, k: c.gather(0, np.array([[0, 8]])),
     PageIdError, "page_table"),
    ("gather seq_lens too long",
     lambda c, k: c.gather(0, np.array([[0, 1]]), seq_lens=[9]),
     ShapeError, "seq_lens"),
    ("gather seq_lens shape",
     lambda c, k: c.gather(0, np.array([[0, 1]]), seq_lens=[1, 2]),
     ShapeError, "seq_lens"),
    ("gather seq_lens dtype",
     lambda c, k: c.gather(0, np.array([[0, 1]]), seq_lens=[1.0]),
     DTypeError, "seq_lens"),
    ("gather -1 within seq_lens",
     lambda c, k: c.gather(0, np.array([[0, -1]]), seq_lens=[5]),
     PageIdError, "page_table"),
    ("gather layer range", lambda c, k: c.gather(5, np.array([[0, 1]])), PageIdError, "layer"),
    ("gather ragged table", lambda c, k: c.gather(0, [[0, 1], [2]]), ShapeError, "page_table"),
    ("bind negative total_len",
     lambda c, k: c.bind([[0, 1]], total_len=-1),
     DTypeError, "total_len"),
    ("bind float total_len",
     lambda c, k: c.bind([[0, 1]], total_len=2.0),
     DTypeError, "total_len"),
    ("bind page out of range", lambda c, k: c.bind(np.array([[0, 9]])), PageIdError, "page_table"),
    ("view of a non-cache", lambda c, k: CacheView(object(), [[0]]), DTypeError, "cache"),
]


@pytest.mark.parametrize("what, call, error, word", BAD_DATA_CALLS,
                         ids=[c[0] for c in BAD_DATA_CALLS])
def test_bad_data_arguments_name_themselves_and_change_nothing(what, call, error, word,
                                                               cache_backend):
    cache = make(cache_backend, n_pages=8)
    k = dev(cache, np.ones((1, 5, 2, 3), np.float32))
    before = snapshot(cache)
    with pytest.raises(error) as info:
        call(cache, k)
    assert word in str(info.value), str(info.value)
    assert snapshot(cache) == before


# ------------------------------------------------------------ CacheView

def test_cache_view_write_and_gather(cache_backend):
    rng = np.random.default_rng(5)
    cache = make(cache_backend, n_pages=8)
    table = np.array([[4, 6], [5, 7]])
    view = cache.bind(table)
    assert isinstance(view, CacheView)
    k, v = rand_kv(rng, (2, 6, 2, 3)), rand_kv(rng, (2, 6, 2, 3))
    view.write(1, 0, dev(cache, k), dev(cache, v))
    gk, gv = (host(cache, x) for x in view.gather(1))
    assert gk.shape == (2, 8, 2, 3)  # no trim: whole pages
    assert np.array_equal(gk[:, :6], k) and np.array_equal(gv[:, :6], v)
    assert not gk[:, 6:].any()
    gk, gv = (host(cache, x) for x in cache.bind(table, total_len=6).gather(1))
    assert np.array_equal(gk, k) and np.array_equal(gv, v)


def test_cache_view_total_len_none_and_zero(cache_backend):
    # The seed did not trim when total_len was 0; here None means "no trim"
    # and 0 means zero positions.
    cache = make(cache_backend, n_pages=4)
    table = [[0, 1]]
    assert cache.bind(table).gather(0)[0].shape == (1, 8, 2, 3)
    assert cache.bind(table, total_len=None).gather(0)[0].shape == (1, 8, 2, 3)
    assert cache.bind(table, total_len=0).gather(0)[0].shape == (1, 0, 2, 3)
    assert cache.bind(table, total_len=3).gather(0)[0].shape == (1, 3, 2, 3)
    with pytest.raises(ShapeError, match="total_len"):
        cache.bind(table, total_len=9).gather(0)


def test_cache_view_ragged_rows_with_seq_lens_and_per_row_start(cache_backend):
    rng = np.random.default_rng(6)
    cache = make(cache_backend, n_pages=8)
    table = np.array([[0, 1], [2, 3]])
    view = cache.bind(table, seq_lens=np.array([3, 7]))
    k = rand_kv(rng, (2, 1, 2, 3))
    view.write(0, [2, 6], dev(cache, k), dev(cache, k))
    gk = host(cache, view.gather(0)[0])
    assert gk.shape == (2, 7, 2, 3)
    assert np.array_equal(gk[0, 2], k[0, 0]) and np.array_equal(gk[1, 6], k[1, 0])
    assert not gk[0, 3:].any()


def test_cache_view_has_no_instance_dict(cache_backend):
    view = make(cache_backend).bind([[0]])
    with pytest.raises(AttributeError):
        view.extra = 1


def snapshot(cache):
    pool, index = cache._pool, cache._index
    return (list(pool._ref), bytes(pool._state), bytes(pool._cached), list(pool._free),
            list(pool._prev), list(pool._next), pool._num_evictable,
            {p: (e.digest, e.tokens, e.parent) for p, e in index._entries.items()},
            dict(index._generation), cache.lookup_hits, cache.lookup_misses,
            bits(host(cache, cache.k_cache)).tobytes(), bits(host(cache, cache.v_cache)).tobytes())


# ------------------------------------------------- recording page by page

def count_hashed_tokens(cache):
    """Wrap the prefix index's lookup and insert so that ``counter[0]`` adds
    up the tokens they hash (a lookup's walk at most ``max_pages`` pages)
    and ``counter[1]`` the lookups."""
    index, counter = cache.index, [0, 0]
    lookup, insert = index.lookup, index.insert

    def counted_lookup(token_bytes, num_tokens, max_pages, *args, **kwargs):
        counter[0] += max_pages * index.page_size
        counter[1] += 1
        return lookup(token_bytes, num_tokens, max_pages, *args, **kwargs)

    def counted_insert(page_id, parent_digest, parent, tokens):
        counter[0] += len(tokens) // 8
        return insert(page_id, parent_digest, parent, tokens)

    index.lookup, index.insert = counted_lookup, counted_insert
    return counter


def hashed_per_page(backend, num_tokens, kind):
    """Tokens hashed per page while recording every page of one sequence of
    ``num_tokens`` in order, and the sequence's pages found by a lookup."""
    page_size = 16
    num_pages = num_tokens // page_size
    cache = PagedCache(1, num_pages, page_size, 1, 1, backend=backend)
    ids = np.random.default_rng(num_tokens).integers(0, 50_000, num_tokens)
    tokens = {"list": ids.tolist(), "tuple": tuple(ids.tolist()), "ndarray": ids}[kind]
    counter = count_hashed_tokens(cache)
    pages = cache.alloc_n(num_pages)
    for i, page_id in enumerate(pages):
        cache.record_page(page_id, tokens, i)
    per_page, num_walks = counter[0] / num_pages, counter[1]
    assert cache.lookup_prefix(ids.tolist() + [0]) == pages
    return per_page, num_walks


@pytest.mark.parametrize("kind", ["list", "tuple", "ndarray"])
def test_record_page_work_per_page_does_not_grow_with_the_sequence(kind, cache_backend):
    # Each call once converted the whole list and walked the chain from the
    # root: 32K tokens hashed 16x more per page than 2K.
    (short, short_walks), (long, long_walks) = (hashed_per_page(cache_backend, 2048, kind),
                                                hashed_per_page(cache_backend, 32768, kind))
    assert long <= 2 * short
    assert short == long == 16  # the recorded page's tokens, nothing else
    assert short_walks == long_walks == 0  # no walk from the root


def test_record_page_sequences_recorded_in_turn_keep_their_chains(cache_backend):
    cache = make(cache_backend, n_pages=12)
    seqs = [[s] * 4 + list(range(10 * s, 10 * s + 12)) for s in range(3)]
    counter = count_hashed_tokens(cache)
    pages = [cache.alloc_n(4) for _ in seqs]
    for i in range(4):
        for tokens, own in zip(seqs, pages):
            cache.record_page(own[i], tokens, i)
    assert counter == [3 * 4 * PS, 0]
    for tokens, own in zip(seqs, pages):
        assert cache.lookup_prefix(tokens + [0]) == own


@pytest.mark.parametrize("kind", ["list", "ndarray"])
def test_record_page_after_the_caller_changed_its_tokens(kind, cache_backend):
    # The same list (or array), changed in place between calls: its earlier
    # pages are not the recorded ones, so the next page is not recorded.
    cache = make(cache_backend, n_pages=8)
    tokens = list(range(12)) if kind == "list" else np.arange(12)
    pages = cache.alloc_n(3)
    cache.record_page(pages[0], tokens, 0)
    cache.record_page(pages[1], tokens, 1)
    tokens[1] = 50
    cache.record_page(pages[2], tokens, 2)
    assert not cache.pool.is_cached(pages[2]) and pages[2] not in cache.index
    assert cache.lookup_prefix(list(range(12)) + [0]) == pages[:2]
    # Changed back, the chain is found again.
    tokens[1] = 1
    cache.record_page(pages[2], tokens, 2)
    assert cache.lookup_prefix(list(range(12)) + [0]) == pages


def test_record_page_after_an_earlier_page_was_evicted(cache_backend):
    cache = make(cache_backend, n_pages=4)
    tokens = list(range(12))
    pages = cache.alloc_n(3)
    cache.record_page(pages[0], tokens, 0)
    cache.record_page(pages[1], tokens, 1)
    cache.free(pages[0])                        # evictable, then taken for reuse
    assert cache.alloc() == 3 and cache.alloc() == pages[0]
    cache.record_page(pages[2], tokens, 2)      # its chain starts at an evicted page
    assert not cache.pool.is_cached(pages[2]) and pages[2] not in cache.index
    assert cache.lookup_prefix(tokens + [0]) == []


def test_record_page_of_a_page_that_held_another_prefix(cache_backend):
    cache = make(cache_backend, n_pages=8)
    a, b = list(range(12)), list(range(20, 32))
    pages_a, pages_b = cache.alloc_n(3), cache.alloc_n(1)
    cache.record_page(pages_a[0], a, 0)
    cache.record_page(pages_a[1], a, 1)
    cache.record_page(pages_b[0], b, 0)
    cache.record_page(pages_a[1], b, 1)         # now page 1 of b, no longer of a
    cache.record_page(pages_a[2], a, 2)         # a's chain is broken at page 1
    assert pages_a[2] not in cache.index
    assert cache.lookup_prefix(a + [0]) == pages_a[:1]
    assert cache.lookup_prefix(b + [0]) == [pages_b[0], pages_a[1]]


def test_record_page_again_changes_nothing(cache_backend):
    cache = make(cache_backend, n_pages=8)
    tokens = list(range(12))
    pages = cache.alloc_n(3)
    for i, p in enumerate(pages):
        cache.record_page(p, tokens, i)
    before = snapshot(cache)
    for i, p in enumerate(pages):
        cache.record_page(p, tuple(tokens), i)
    assert snapshot(cache) == before


def test_record_page_checks_the_tokens_it_reads(cache_backend):
    cache = make(cache_backend, n_pages=8)
    tokens = list(range(12))
    pages = cache.alloc_n(3)
    cache.record_page(pages[0], tokens, 0)
    before = snapshot(cache)
    with pytest.raises(DTypeError, match="token_ids"):   # the page before the recorded one
        cache.record_page(pages[1], tokens[:3] + [1.5] + tokens[4:], 1)
    bad_first = [-1] + tokens[1:]                         # no chain of these tokens is kept
    with pytest.raises(DTypeError, match="token_ids"):
        cache.record_page(pages[2], bad_first, 2)
    assert snapshot(cache) == before


@pytest.mark.parametrize("args", [
    (0, [1.5, 2.0], 0),            # too short for a page, and not ids
    (99, list(range(4)) + [0.5], 0),  # a bad page id, and a bad id past the page
    (0, list(range(4)) + [-3], 1.0),
])
def test_record_page_names_invalid_tokens_before_other_arguments(args, cache_backend):
    cache = make(cache_backend)
    cache.alloc()
    before = snapshot(cache)
    with pytest.raises(DTypeError, match="token_ids"):
        cache.record_page(*args)
    assert snapshot(cache) == before
