"""The page pool: ref counts, free list, LRU of evictable pages."""

import numpy as np
import pytest

from pagedkv_np.errors import ConfigError, DTypeError, OutOfPages, PageIdError, PageStateError
from pagedkv_np.pool import EVICTABLE, FREE, USED, PagePool


def cached_pool(num_pages, num_cached):
    """A pool whose first ``num_cached`` pages are evictable (freed in id order)."""
    pool = PagePool(num_pages)
    pages = pool.allocate(num_cached)
    for p in pages:
        pool.mark_cached(p)
    pool.free(pages)
    return pool, pages


def assert_rejected(method, arg, error, name):
    """``method(arg)`` on a pool with 2 of 4 pages used raises ``error``
    naming ``name``, and changes nothing."""
    pool = PagePool(4)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(error, match=name):
        getattr(pool, method)(arg)
    assert snapshot(pool) == before


def test_new_pool_is_all_free():
    pool = PagePool(5)
    assert (pool.num_pages, pool.num_free, pool.num_used, pool.num_evictable) == (5, 5, 0, 0)
    assert pool.num_available == 5
    assert all(pool.state(p) == FREE and pool.ref_count(p) == 0 for p in range(5))
    pool.check_invariants()


@pytest.mark.parametrize("bad, error", [(0, ConfigError), (-3, ConfigError),
                                        (2.0, DTypeError), (True, DTypeError)])
def test_pool_size_is_validated(bad, error):
    with pytest.raises(error, match="num_pages"):
        PagePool(bad)


def test_allocate_hands_out_lowest_ids_first_with_ref_count_one():
    pool = PagePool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    assert all(pool.state(p) == USED and pool.ref_count(p) == 1 for p in range(4))
    assert (pool.num_free, pool.num_used) == (2, 4)
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_freed_page_is_reused_first():
    pool = PagePool(4)
    pool.allocate(3)
    pool.free([1])
    assert pool.allocate(1) == [1]


def test_allocate_is_all_or_nothing():
    pool, cached = cached_pool(6, 2)
    pool.allocate(3)  # 1 free + 2 evictable left
    evicted = []
    pool.on_evict = evicted.append
    before = snapshot(pool)
    with pytest.raises(OutOfPages) as info:
        pool.allocate(4)
    assert info.value.num_needed == 4 and info.value.num_available == 3
    assert isinstance(info.value, MemoryError)
    assert "4" in str(info.value) and "3" in str(info.value)
    assert snapshot(pool) == before and evicted == []
    assert pool.lru_order() == cached


def test_allocate_evicts_only_when_no_page_is_free():
    pool, cached = cached_pool(5, 2)  # pages 0, 1 evictable; 2, 3, 4 free
    evicted = []
    pool.on_evict = evicted.append
    assert sorted(pool.allocate(3)) == [2, 3, 4]
    assert evicted == [] and pool.num_evictable == 2
    assert pool.allocate(1) == [0]  # least recently used first
    assert evicted == [0]
    assert pool.state(0) == USED and not pool.is_cached(0) and pool.ref_count(0) == 1
    assert pool.lru_order() == [1]
    pool.check_invariants()


def test_lru_order_follows_free_order_and_touch():
    pool, _ = cached_pool(6, 4)
    assert pool.lru_order() == [0, 1, 2, 3]
    pool.touch(1)
    assert pool.lru_order() == [0, 2, 3, 1]
    pool.touch(0)
    assert pool.lru_order() == [2, 3, 1, 0]
    pool.touch(5)  # free page: no-op
    pool.check_invariants()
    order = []
    pool.on_evict = order.append
    pool.allocate(6)
    assert order == [2, 3, 1, 0]


def test_touch_of_a_used_page_is_a_no_op():
    pool = PagePool(3)
    pool.allocate(1)
    pool.touch(0)
    assert pool.state(0) == USED and pool.lru_order() == []


def test_inc_ref_revives_an_evictable_page():
    pool, _ = cached_pool(4, 3)
    pool.inc_ref([1])
    assert pool.state(1) == USED and pool.ref_count(1) == 1 and pool.is_cached(1)
    assert pool.lru_order() == [0, 2]
    pool.inc_ref([1, 1])
    assert pool.ref_count(1) == 3
    pool.free([1, 1, 1])
    assert pool.lru_order() == [0, 2, 1]  # back at the most recently used end
    pool.check_invariants()


def test_inc_ref_of_a_free_page_raises_and_changes_nothing():
    pool = PagePool(3)
    pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(PageStateError, match="page_ids.*page 2 is free"):
        pool.inc_ref([0, 2])  # page 0 must not have been counted
    assert snapshot(pool) == before


def test_free_of_an_uncached_page_makes_it_free():
    pool = PagePool(3)
    pool.allocate(2)
    pool.inc_ref([0])
    pool.free([0])
    assert pool.state(0) == USED and pool.ref_count(0) == 1
    pool.free([0])
    assert pool.state(0) == FREE and pool.num_free == 2
    pool.check_invariants()


def test_free_of_a_cached_page_makes_it_evictable():
    pool = PagePool(3)
    pool.allocate(1)
    pool.mark_cached(0)
    pool.free([0])
    assert pool.state(0) == EVICTABLE and pool.num_evictable == 1 and pool.num_free == 2
    assert pool.num_available == 3 and pool.num_used == 0
    pool.check_invariants()


def test_free_order_is_eviction_order():
    pool = PagePool(4)
    pages = pool.allocate(4)
    for p in pages:
        pool.mark_cached(p)
    pool.free([3, 2, 1, 0])  # tail first, as the cache releases a sequence
    assert pool.lru_order() == [3, 2, 1, 0]


def test_free_of_a_page_listed_twice():
    pool = PagePool(3)
    pool.allocate(1)
    pool.inc_ref([0])
    pool.free([0, 0])
    assert pool.state(0) == FREE


@pytest.mark.parametrize("ids", [[0, 0], [1], [0, 2, 2]])
def test_double_free_raises_and_changes_nothing(ids):
    pool = PagePool(4)
    pool.allocate(1)
    pool.allocate(1)
    pool.free([1])  # page 1 now free
    before = snapshot(pool)
    with pytest.raises(PageStateError, match="page_ids"):
        pool.free(ids)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_free_of_an_evictable_page_raises():
    pool, _ = cached_pool(3, 1)
    before = snapshot(pool)
    with pytest.raises(PageStateError, match="evictable"):
        pool.free([0])
    assert snapshot(pool) == before


@pytest.mark.parametrize("method", ["free", "inc_ref"])
@pytest.mark.parametrize("ids, error", [
    ([4], PageIdError), ([-1], PageIdError), ([0, 99], PageIdError),
    ([0.0], DTypeError), ([True], DTypeError), (["0"], DTypeError), ([None], DTypeError),
    (0, DTypeError), ("01", DTypeError), (None, DTypeError)])
def test_bad_page_ids_raise_and_change_nothing(method, ids, error):
    assert_rejected(method, ids, error, "page_ids")


@pytest.mark.parametrize("method", ["ref_count", "state", "is_cached", "touch", "mark_cached",
                                    "uncache"])
@pytest.mark.parametrize("bad, error", [(4, PageIdError), (-1, PageIdError),
                                        (1.0, DTypeError), (False, DTypeError)])
def test_bad_single_page_id_raises(method, bad, error):
    assert_rejected(method, bad, error, "page_id")


def test_numpy_integer_ids_are_accepted():
    pool = PagePool(4)
    pages = np.array(pool.allocate(2), dtype=np.int32)
    pool.inc_ref(pages)
    assert pool.ref_count(np.int64(1)) == 2
    pool.free(pages)
    pool.free(pages)
    assert pool.num_free == 4


@pytest.mark.parametrize("bad, error", [(-1, ConfigError), (1.5, DTypeError), (None, DTypeError)])
def test_allocate_count_is_validated(bad, error):
    pool = PagePool(4)
    before = snapshot(pool)
    with pytest.raises(error, match="num"):
        pool.allocate(bad)
    with pytest.raises(error, match="num"):
        pool.can_allocate(bad)
    assert snapshot(pool) == before


def test_can_allocate_counts_free_and_evictable():
    pool, _ = cached_pool(5, 2)
    pool.allocate(3)
    assert pool.can_allocate(2) and not pool.can_allocate(3) and pool.can_allocate(0)


def test_mark_cached_needs_a_page_in_use():
    pool = PagePool(3)
    with pytest.raises(PageStateError, match="page_id"):
        pool.mark_cached(1)
    assert not pool.is_cached(1)


def test_uncache_of_an_evictable_page_frees_it():
    pool, _ = cached_pool(3, 2)
    pool.uncache(0)
    assert pool.state(0) == FREE and not pool.is_cached(0) and pool.lru_order() == [1]
    pool.uncache(0)  # already uncached: no-op
    pool.check_invariants()


def test_uncache_of_a_used_page_frees_it_at_zero():
    pool = PagePool(3)
    pool.allocate(1)
    pool.mark_cached(0)
    pool.uncache(0)
    assert pool.state(0) == USED
    pool.free([0])
    assert pool.state(0) == FREE


def test_on_evict_is_told_each_evicted_page_in_order():
    pool, cached = cached_pool(3, 3)
    evicted = []
    pool.on_evict = evicted.append
    assert pool.allocate(2) == [0, 1]
    assert evicted == [0, 1]
    assert pool.lru_order() == [2]


def test_counters_add_up_through_a_workload():
    rng = np.random.default_rng(0)
    pool = PagePool(16)
    held = []
    for _ in range(400):
        op = rng.integers(4)
        if op == 0 and pool.num_available:
            held += pool.allocate(int(rng.integers(1, pool.num_available + 1)))
        elif op == 1 and held:
            p = held.pop(int(rng.integers(len(held))))
            pool.free([p])
        elif op == 2 and held:
            pool.mark_cached(held[int(rng.integers(len(held)))])
        elif op == 3 and pool.num_evictable:
            victim = pool.lru_order()[int(rng.integers(pool.num_evictable))]
            pool.inc_ref([victim])
            held.append(victim)
        pool.check_invariants()
        assert pool.num_used == len(set(held))
        assert sum(pool.ref_count(p) for p in range(16)) == len(held)


def test_repr():
    pool = PagePool(4)
    pool.allocate(1)
    assert repr(pool) == "PagePool(num_pages=4, free=3, used=1, evictable=0)"


# ------------------------------------------------------------ corruption

def corrupt_free_list_duplicate(pool):
    pool._free.append(pool._free[-1])


def corrupt_used_page_in_free_list(pool):
    pool._free.append(0)


def corrupt_negative_ref(pool):
    pool._ref[3] = -1


def corrupt_lru_count(pool):
    pool._num_evictable += 1


def corrupt_evictable_not_cached(pool):
    pool._cached[1] = 0


def corrupt_lru_link(pool):
    pool._prev[2] = 0


def corrupt_state_without_ref(pool):
    pool._ref[0] = 0


@pytest.mark.parametrize("corrupt", [
    corrupt_free_list_duplicate, corrupt_used_page_in_free_list, corrupt_negative_ref,
    corrupt_lru_count, corrupt_evictable_not_cached, corrupt_lru_link,
    corrupt_state_without_ref])
def test_check_invariants_detects_corruption(corrupt):
    pool = PagePool(6)
    pool.allocate(3)       # 0, 1, 2 used
    pool.mark_cached(1)
    pool.mark_cached(2)
    pool.free([1, 2])      # 1, 2 evictable; 3, 4, 5 free
    pool.allocate(1)       # 3 used
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_invariants()


def snapshot(pool):
    return (list(pool._ref), bytes(pool._state), bytes(pool._cached), list(pool._free),
            list(pool._prev), list(pool._next), pool._num_evictable)
