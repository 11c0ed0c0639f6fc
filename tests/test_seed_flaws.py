"""Each flaw of the seed design (shared/seed/README.md), shown not to happen here.

One test per flaw, named after it. The seed's own hash function is
reproduced below (as a hash_fn of the prefix index) to show that even it
could not make the cache serve wrong K/V.
"""

import numpy as np
import pytest

from pagedkv_np import PagedCache, PagedKVCache
from pagedkv_np.backends import get_backend
from pagedkv_np.errors import OutOfPages, PageIdError, PageStateError
from pagedkv_np.pool import EVICTABLE, PagePool

from helpers import bits


def seed_page_hash(secret, parent, tokens):
    """The seed's page hash (31-polynomial mod 2**64 over one page's tokens,
    ignoring everything before the page), as a ``hash_fn``."""
    h = 0
    for t in np.frombuffer(tokens, dtype="<i8").tolist():
        h = (h * 31 + t) & 0xFFFFFFFFFFFFFFFF
    return h.to_bytes(8, "little")


def make_cache(backend, **kw):
    return PagedKVCache(2, kw.pop("num_pages", 32), kw.pop("page_size", 2), 1, 2,
                        dtype="float32", backend=backend, **kw)


def prefill(cache, prompt, expected_kv, salt=None):
    seq = cache.add_sequence(prompt, salt)
    cache.extend(seq, prompt[seq.num_cached_tokens:])
    plan = cache.plan([seq])
    start = int(plan.context_lens[0])
    for layer in range(cache.num_layers):
        k, v = expected_kv(prompt, salt, layer, 1, 2, "float32")
        cache.write(layer, plan, k[start:], v[start:])
    return seq


def gathered_is_exact(cache, seq, expected_kv):
    """Every position of ``seq`` holds the K/V computed under its own prefix."""
    plan = cache.plan([seq])
    for layer in range(cache.num_layers):
        k, v = map(cache.backend.to_numpy, cache.gather(layer, plan, layout="BTHD"))
        ek, ev = expected_kv(seq.tokens, seq.salt, layer, 1, 2, "float32")
        if not (np.array_equal(bits(k[0]), bits(ek)) and np.array_equal(bits(v[0]), bits(ev))):
            return False
    return True


def test_flaw1_page_hash_is_chained_over_the_whole_prefix(expected_kv, cache_backend):
    cache = make_cache(cache_backend)
    shared_page = [5, 5]
    x = prefill(cache, [1, 1] + shared_page + [0], expected_kv)
    cache.release(x)
    # Same page tokens after a different first page: not a hit.
    y = cache.add_sequence([2, 2] + shared_page + [0])
    assert y.num_cached_tokens == 0
    # Same page tokens at another position: not a hit either.
    z = cache.add_sequence(shared_page + [7])
    assert z.num_cached_tokens == 0
    cache.extend(y, [2, 2] + shared_page + [0])
    cache.extend(z, shared_page + [7])
    plan = cache.plan([y, z])
    for layer in range(2):
        ks, vs = [], []
        for seq in (y, z):
            k, v = expected_kv(seq.tokens, None, layer, 1, 2, "float32")
            ks.append(k)
            vs.append(v)
        cache.write(layer, plan, np.concatenate(ks), np.concatenate(vs))
    assert gathered_is_exact(cache, y, expected_kv) and gathered_is_exact(cache, z, expected_kv)
    # The digests of equal page tokens differ with their prefix and position.
    assert len({bytes(d) for d in y._digests + x._digests + z._digests}) == len(
        y._digests + x._digests + z._digests)


def test_flaw2_colliding_hashes_never_return_wrong_kv(expected_kv, cache_backend):
    cache = make_cache(cache_backend, _hash_fn=seed_page_hash)
    assert seed_page_hash(b"", b"", np.array([1, 0], "<i8").tobytes()) == \
        seed_page_hash(b"", b"", np.array([0, 31], "<i8").tobytes())
    first = prefill(cache, [1, 0, 5], expected_kv)
    cache.release(first)
    # [0, 31] has the same seed hash as [1, 0]: verification rejects it.
    other = cache.add_sequence([0, 31, 5])
    assert other.num_cached_tokens == 0 and cache.index.num_rejected == 1
    cache.release(other)
    # A page of equal tokens one page later hashes alike under the seed's
    # hash; the page computed after it must not be served after [1, 0] alone.
    longer = prefill(cache, [2, 2, 1, 0, 4, 4, 9], expected_kv)
    cache.release(longer)
    probe = prefill(cache, [1, 0, 4, 4, 9], expected_kv)
    assert gathered_is_exact(cache, probe, expected_kv)


def test_flaw3_padding_page_id_never_reaches_the_store(cache_backend):
    cache = PagedCache(1, 4, 2, 1, 2, backend=cache_backend)
    backend = get_backend(cache_backend)
    host = backend.to_numpy
    k = backend.asarray(np.ones((2, 3, 1, 2), np.float32))
    with pytest.raises(PageIdError):
        cache.write(0, np.array([[0, 1], [2, -1]]), 0, k, k)  # row 1's 3rd token -> page -1
    assert not host(cache.k_cache).any() and not host(cache.v_cache).any()
    # gather of a row whose table is shorter reads zeros, not page -1 (the last page)
    cache.k_cache[0, 3] = 9.0
    gk, _ = cache.gather(0, np.array([[3, 2], [0, -1]]))
    assert not host(gk)[1, 2:].any()
    # The cache's own plans pad page tables with -1 but never write through them.
    kv_cache = make_cache(cache_backend, num_pages=4)
    a = kv_cache.add_sequence([1, 2, 3, 4, 5])
    kv_cache.extend(a, [1, 2, 3, 4, 5])
    b = kv_cache.add_sequence([6])
    kv_cache.extend(b, [6])
    plan = kv_cache.plan([a, b])
    assert plan.page_table[1].tolist() == [b.page_ids[0], -1, -1]
    assert (plan.slot_mapping >= 0).all()
    kv_cache.write(0, plan, np.ones((6, 1, 2), np.float32), np.ones((6, 1, 2), np.float32))
    assert host(kv_cache.k_cache)[0].sum() == 12  # 6 tokens x 2, nothing else touched
    gk, _ = kv_cache.gather(0, plan, layout="BTHD")
    assert not host(gk)[1, 1:].any()


def test_flaw4_double_free_and_recording_a_free_page_raise(cache_backend):
    cache = PagedCache(1, 4, 2, 1, 2, backend=cache_backend)
    p = cache.alloc()
    cache.free(p)
    with pytest.raises(PageStateError):
        cache.free(p)  # the seed drove the count to -1 and lost the page
    assert cache.pool.ref_count(p) == 0
    assert sorted(cache.alloc_n(4)) == [0, 1, 2, 3]  # no page lost
    for q in range(4):
        cache.free(q)
    with pytest.raises(PageStateError):
        cache.record_page(p, [1, 2], 0)  # the seed leaked such a page
    # A page recorded while in use stays evictable and is reclaimed when needed.
    q = cache.alloc()
    cache.record_page(q, [1, 2], 0)
    cache.free(q)
    assert cache.pool.state(q) == EVICTABLE
    assert sorted(cache.alloc_n(4)) == [0, 1, 2, 3]
    cache.pool.check_invariants()


def test_flaw5_alloc_n_evicts_nothing_when_it_fails(expected_kv, cache_backend):
    cache = PagedCache(1, 4, 2, 1, 2, backend=cache_backend)
    pages = cache.alloc_n(2)
    cache.record_page(pages[0], [1, 2, 3, 4], 0)
    cache.record_page(pages[1], [1, 2, 3, 4], 1)
    cache.free(pages[1])
    cache.free(pages[0])
    cache.alloc()  # 1 free + 2 evictable left
    assert cache.alloc_n(4) == []
    assert cache.lookup_prefix([1, 2, 3, 4, 5]) == pages  # prefix entries intact
    assert cache.pool.num_evictable == 2
    # Same for the sequence API.
    kv = make_cache(cache_backend, num_pages=4, partial_page_reuse=False)
    old = prefill(kv, [1, 2, 3, 4, 5], expected_kv)
    kv.release(old)
    seq = kv.add_sequence([9])
    with pytest.raises(OutOfPages):
        kv.extend(seq, list(range(9)))
    assert kv.num_evictable_pages == 2 and len(kv.index) == 2
    assert kv.add_sequence([1, 2, 3, 4, 5]).num_cached_tokens == 4


def test_flaw6_ragged_batch_is_written_in_one_call(expected_kv, cache_backend):
    # Seed API: one start position per row.
    cache = PagedCache(1, 8, 2, 1, 2, backend=cache_backend)
    backend = get_backend(cache_backend)
    table = np.array([[0, 1, 2], [3, 4, 5]])
    k = np.arange(2 * 2 * 2, dtype=np.float32).reshape(2, 2, 1, 2) + 1
    cache.write(0, table, np.array([1, 4]), backend.asarray(k), backend.asarray(k))
    gk = backend.to_numpy(cache.gather(0, table, seq_lens=[3, 6])[0])
    assert np.array_equal(gk[0, 1:3], k[0]) and np.array_equal(gk[1, 4:6], k[1])
    # Sequence API: a plan over sequences of different lengths, one write per layer.
    kv = make_cache(cache_backend)
    seqs = []
    for prompt in ([1, 2, 3, 4, 5], [6], [7, 8, 9]):
        s = kv.add_sequence(prompt)
        kv.extend(s, prompt)
        seqs.append(s)
    plan = kv.plan(seqs)
    assert plan.seq_lens.tolist() == [5, 1, 3]
    for layer in range(2):
        ks, vs = zip(*(expected_kv(s.tokens, None, layer, 1, 2, "float32") for s in seqs))
        kv.write(layer, plan, np.concatenate(ks), np.concatenate(vs))
    assert all(gathered_is_exact(kv, s, expected_kv) for s in seqs)


def test_flaw7_gather_never_returns_uninitialised_memory(cache_backend):
    cache = make_cache(cache_backend, num_pages=4)
    cache.k_cache[...] = np.nan  # stale data everywhere
    cache.v_cache[...] = np.nan
    a = cache.add_sequence([1, 2, 3])
    cache.extend(a, [1, 2, 3])
    b = cache.add_sequence([4])
    cache.extend(b, [4])
    plan = cache.plan([a, b])
    kv = np.ones((4, 1, 2), np.float32)
    cache.write(0, plan, kv, kv)
    out = (cache.backend.empty((2, 6, 1, 2), np.float32),
           cache.backend.empty((2, 6, 1, 2), np.float32))
    for x in out:
        x[...] = np.nan
    k, v = map(cache.backend.to_numpy, cache.gather(0, plan, layout="BTHD", out=out))
    assert (k[0, :3] == 1).all() and (k[1, :1] == 1).all()
    assert (bits(k[0, 3:]) == 0).all() and (bits(k[1, 1:]) == 0).all()
    assert (bits(v[0, 3:]) == 0).all() and (bits(v[1, 1:]) == 0).all()
    # CacheView trims with total_len=0 too (the seed ignored 0); None means no trim.
    seed_api = PagedCache(1, 4, 2, 1, 2, backend=cache_backend)
    assert seed_api.bind([[0, 1]], total_len=0).gather(0)[0].shape[1] == 0
    assert seed_api.bind([[0, 1]], total_len=None).gather(0)[0].shape[1] == 4


class _Counting:
    """Counts element reads and writes of a list or bytearray in ``counter[0]``."""

    def __init__(self, data, counter):
        super().__init__(data)
        self.counter = counter

    def __getitem__(self, i):
        self.counter[0] += 1
        return super().__getitem__(i)

    def __setitem__(self, i, v):
        self.counter[0] += 1
        super().__setitem__(i, v)


class _Counted(_Counting, list):
    """A list that counts element accesses and refuses every O(n) operation."""

    def append(self, x):
        self.counter[0] += 1
        super().append(x)

    def pop(self, *index):
        if index and index[0] not in (-1, len(self) - 1):
            raise AssertionError("pop from the front or middle of a list is O(n)")
        self.counter[0] += 1
        return super().pop()

    def _on(self, *args, **kwargs):
        raise AssertionError("an O(n) list operation")

    remove = index = insert = count = __contains__ = __iter__ = __reversed__ = _on


class _CountedBytes(_Counting, bytearray):
    """A bytearray that counts element accesses and refuses every O(n) operation."""

    def _on(self, *args, **kwargs):
        raise AssertionError("an O(n) bytearray operation")

    __contains__ = __iter__ = find = index = count = _on


def _pool_op_costs(num_pages):
    """Element accesses of each pool operation on a pool of ``num_pages``
    whose pages are mostly cached and evictable."""
    pool = PagePool(num_pages)
    pages = pool.allocate(num_pages)
    for p in pages:
        pool.mark_cached(p)
    pool.free(pages[:num_pages // 2])      # first half evictable, in id order
    pool.free(pages[num_pages // 2 + 2:])  # 2 pages stay in use, the rest evictable
    counter = [0]
    for name in ("_free", "_prev", "_next", "_ref"):
        setattr(pool, name, _Counted(getattr(pool, name), counter))
    for name in ("_state", "_cached"):
        setattr(pool, name, _CountedBytes(getattr(pool, name), counter))
    middle = num_pages // 4
    costs = {}
    ops = [
        ("revive from the middle of the LRU", lambda: pool.inc_ref([middle])),
        ("free to the LRU", lambda: pool.free([middle])),
        ("touch the middle of the LRU", lambda: pool.touch(num_pages // 3)),
        ("allocate by eviction", lambda: pool.allocate(1)),
        ("uncache a used page", lambda: pool.uncache(num_pages // 2)),
        ("free to the free list", lambda: pool.free([num_pages // 2])),
        ("allocate a free page", lambda: pool.allocate(1)),
        ("inc_ref and free of a used page", lambda: (pool.inc_ref([num_pages // 2 + 1]),
                                                     pool.free([num_pages // 2 + 1]))),
    ]
    for name, op in ops:
        counter[0] = 0
        op()
        costs[name] = counter[0]
    return costs


def test_pool_operations_are_O1_not_O_n():
    # The seed's bitmask, `idx in list`, list.remove and list.pop(0) made
    # alloc/free O(n). Here no operation may scan a structure, and each costs
    # the same number of element accesses whatever the pool size.
    small, large = _pool_op_costs(1024), _pool_op_costs(65536)
    assert small == large
    assert max(small.values()) < 40
