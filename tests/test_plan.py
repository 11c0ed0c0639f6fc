"""Per-step index arrays."""

import dataclasses
import gc
import weakref

import numpy as np
import pytest

from pagedkv_np import PagedKVCache, Plan
from pagedkv_np import plan as plan_module
from pagedkv_np.errors import DTypeError, StalePlanError
from pagedkv_np.plan import build_plan


def naive_slots(pages, start, stop, page_size):
    return [pages[t // page_size] * page_size + t % page_size for t in range(start, stop)]


def test_build_plan_arrays():
    #            seq 0: 5 tokens, 3 cached     seq 1: 4 tokens, none cached   seq 2: nothing new
    plan = build_plan([[7, 2], [4, 0], [9]], [5, 4, 2], [3, 0, 2], page_size=3,
                      seq_ids=[10, 11, 12])
    assert plan.page_table.dtype == np.int32 and plan.page_table.tolist() == [
        [7, 2], [4, 0], [9, -1]]
    assert plan.seq_lens.dtype == np.int32 and plan.seq_lens.tolist() == [5, 4, 2]
    assert plan.query_start_loc.dtype == np.int32
    assert plan.query_start_loc.tolist() == [0, 2, 6, 6]
    assert plan.slot_mapping.dtype == np.int32
    assert plan.slot_mapping.tolist() == (naive_slots([7, 2], 3, 5, 3)
                                          + naive_slots([4, 0], 0, 4, 3))
    assert plan.slot_mapping.tolist() == [2 * 3 + 0, 2 * 3 + 1, 12, 13, 14, 0]
    assert plan.new_lens.tolist() == [2, 4, 0] and plan.new_lens.dtype == np.int32
    assert plan.context_lens.tolist() == [3, 0, 2] and plan.context_lens.dtype == np.int32
    assert plan.num_seqs == 3 and plan.num_new_tokens == 6
    assert plan.seq_ids == (10, 11, 12)
    # data only: the arrays and the ids, no bookkeeping of a cache
    assert [f.name for f in dataclasses.fields(plan)] == [
        "page_table", "seq_lens", "slot_mapping", "query_start_loc", "seq_ids", "context_lens"]


def test_plan_arrays_are_read_only():
    plan = build_plan([[1]], [1], [0], 4, [0])
    for name in ("page_table", "seq_lens", "slot_mapping", "query_start_loc"):
        arr = getattr(plan, name)
        with pytest.raises(ValueError):
            arr[...] = 0
    with pytest.raises(AttributeError):
        plan.seq_lens = np.zeros(1, np.int32)


def test_empty_batch():
    plan = build_plan([], [], [], 4, [])
    assert plan.page_table.shape == (0, 0) and plan.seq_lens.shape == (0,)
    assert plan.slot_mapping.shape == (0,) and plan.query_start_loc.tolist() == [0]
    assert plan.num_seqs == 0 and plan.num_new_tokens == 0


def test_sequence_without_pages():
    plan = build_plan([[], [3]], [0, 2], [0, 0], 4, [0, 1])
    assert plan.page_table.tolist() == [[-1], [3]]
    assert plan.slot_mapping.tolist() == [12, 13]


@pytest.mark.parametrize("page_size", [1, 2, 5, 16])
def test_slots_match_a_naive_loop(page_size):
    rng = np.random.default_rng(page_size)
    page_lists, lens, ctx, expected = [], [], [], []
    free = rng.permutation(400).tolist()  # distinct pages across sequences
    for _ in range(6):
        n = int(rng.integers(0, 40))
        pages = [free.pop() for _ in range(-(-n // page_size))]
        c = int(rng.integers(0, n + 1))
        page_lists.append(pages)
        lens.append(n)
        ctx.append(c)
        expected += naive_slots(pages, c, n, page_size)
    plan = build_plan(page_lists, lens, ctx, page_size, list(range(6)))
    assert plan.slot_mapping.tolist() == expected
    assert np.unique(plan.slot_mapping).size == plan.slot_mapping.size


@pytest.mark.parametrize("loop_max", [0, 10_000])      # array operations / Python loop
@pytest.mark.parametrize("list_max", [0, 10_000])      # page table from arrays / one list
def test_every_way_of_building_gives_the_same_plan(monkeypatch, loop_max, list_max):
    rng = np.random.default_rng(7)
    page_size = 4
    free = rng.permutation(300).tolist()
    page_lists, lens, ctx = [], [], []
    for n in (0, 1, 4, 5, 37, 64, 3):
        page_lists.append([free.pop() for _ in range(-(-n // page_size))])
        lens.append(n)
        ctx.append(int(rng.integers(0, n + 1)))
    want = build_plan(page_lists, lens, ctx, page_size, list(range(7)))
    monkeypatch.setattr(plan_module, "LOOP_MAX_TOKENS", loop_max)
    monkeypatch.setattr(plan_module, "LIST_MAX_ENTRIES", list_max)
    arrays = [np.array(p, dtype=np.int32) for p in page_lists]
    for pages, page_arrays in ((page_lists, None), (page_lists, arrays), (arrays, None)):
        got = build_plan(pages, lens, ctx, page_size, list(range(7)), page_arrays=page_arrays)
        for name in ("page_table", "seq_lens", "slot_mapping", "query_start_loc",
                     "context_lens"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype == np.int32 and a.tolist() == b.tolist(), name
    expected = []
    for p, c, n in zip(page_lists, ctx, lens):
        expected += naive_slots(p, c, n, page_size)
    assert want.slot_mapping.tolist() == expected


def test_cache_plan_splits_context_and_new_tokens(cache_backend):
    cache = PagedKVCache(1, 16, 4, 1, 2, backend=cache_backend)
    a = cache.add_sequence([1] * 6)
    cache.extend(a, [1] * 6)
    b = cache.add_sequence([2] * 8)   # ends exactly on a page boundary
    cache.extend(b, [2] * 8)
    plan = cache.plan([b, a])
    assert isinstance(plan, Plan)
    assert plan.seq_ids == (b.seq_id, a.seq_id)
    assert plan.seq_lens.tolist() == [8, 6]
    assert plan.context_lens.tolist() == [0, 0]
    assert plan.page_table.tolist() == [list(b.page_ids), list(a.page_ids)]
    assert plan.slot_mapping.tolist() == (naive_slots(b.page_ids, 0, 8, 4)
                                          + naive_slots(a.page_ids, 0, 6, 4))
    assert a.num_computed_tokens == 6 and b.num_computed_tokens == 8
    cache.extend(a, [3])
    plan = cache.plan([a, b])
    assert plan.context_lens.tolist() == [6, 8] and plan.new_lens.tolist() == [1, 0]
    assert plan.slot_mapping.tolist() == [a.page_ids[1] * 4 + 2]
    # Planning again without new tokens: nothing new to write.
    again = cache.plan([a, b])
    assert again.num_new_tokens == 0 and again.seq_lens.tolist() == [7, 8]


def test_cache_plan_of_an_empty_batch(cache_backend):
    cache = PagedKVCache(1, 4, 4, 1, 2, backend=cache_backend)
    plan = cache.plan([])
    assert plan.num_seqs == 0
    cache.write(0, plan, np.zeros((0, 1, 2), np.float32), np.zeros((0, 1, 2), np.float32))
    k, v = cache.gather(0, plan)
    assert k.shape == v.shape == (0, 1, 0, 2)


def test_cache_keeps_each_plans_state_without_holding_the_plan(cache_backend):
    cache = PagedKVCache(2, 8, 4, 1, 2, backend=cache_backend)
    seq = cache.add_sequence([1, 2, 3])
    cache.extend(seq, [1, 2, 3])
    plan = cache.plan([seq])
    k = np.ones((3, 1, 2), np.float32)
    assert not cache.is_written(plan)
    cache.write(0, plan, k, k)
    assert not cache.is_written(plan)
    cache.write(1, plan, k, k)
    assert cache.is_written(plan)
    other = PagedKVCache(2, 8, 4, 1, 2, backend=cache_backend)
    with pytest.raises(StalePlanError, match="another cache"):
        other.is_written(plan)
    ref = weakref.ref(plan)
    del plan
    gc.collect()
    assert ref() is None      # the cache's record does not keep the plan alive


def test_plan_table_forgets_a_plan_once_it_is_gone():
    from pagedkv_np.plan_state import PlanState, PlanTable
    table = PlanTable()
    plans = [build_plan([[1]], [1], [0], 4, [0]) for _ in range(5)]
    states = [PlanState(0, (), (), 1) for _ in plans]
    for plan, state in zip(plans, states):
        table.add(plan, state)
    assert len(table) == 5 and table.state(plans[3]) is states[3]
    del plans[:4]
    gc.collect()
    assert len(table) == 1 and table.current(plans[0], 0) is states[4]
    fresh = build_plan([[1]], [1], [0], 4, [0])     # may reuse a dead plan's id
    with pytest.raises(StalePlanError, match="another cache"):
        table.state(fresh)
    with pytest.raises(DTypeError, match="expected a Plan"):
        table.state("plan")
