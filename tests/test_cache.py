"""PagedKVCache: sequences over the pool, the prefix index and the store."""

import hashlib
import threading

import numpy as np
import pytest

from pagedkv_np import PagedKVCache, Sequence
from pagedkv_np.errors import (
    AllocationError,
    ConfigError,
    DTypeError,
    LayoutError,
    OutOfPages,
    PageIdError,
    SequenceError,
    ShapeError,
    StalePlanError,
)
from pagedkv_np.layout import OutputLayout, StoreLayout, resolve_dtype
from pagedkv_np.pool import EVICTABLE, FREE


def bits(x):
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def make_cache(backend, num_layers=2, num_pages=32, page_size=4, num_kv_heads=2, head_dim=3,
               **kw):
    kw.setdefault("dtype", "float32")
    return PagedKVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim,
                        backend=backend, **kw)


def filled(cache, shape, value):
    """An array of the cache's backend and dtype, every element ``value``."""
    x = cache.backend.empty(shape, cache.dtype)
    x[...] = value
    return x


def write_step(cache, plan, seqs, expected_kv):
    """Write every layer's K/V of the plan's new tokens, as a model would."""
    ctx, lens = plan.context_lens, plan.seq_lens
    for layer in range(cache.num_layers):
        ks, vs = [], []
        for b, seq in enumerate(seqs):
            k, v = expected_kv(seq.tokens, seq.salt, layer, cache.num_kv_heads, cache.head_dim,
                               cache.dtype)
            ks.append(k[ctx[b]:lens[b]])
            vs.append(v[ctx[b]:lens[b]])
        cache.write(layer, plan, np.concatenate(ks), np.concatenate(vs))


def assert_gathered(cache, plan, seqs, expected_kv, layout="BTHD", out=None, num_positions=None):
    """Gather every layer and compare bit for bit with what was written;
    positions past each sequence's length must be zero."""
    for layer in range(cache.num_layers):
        k, v = cache.gather(layer, plan, layout=layout, out=out, num_positions=num_positions)
        if out is not None:
            assert k is out[0] and v is out[1]
        k, v = cache.backend.to_numpy(k), cache.backend.to_numpy(v)
        if OutputLayout.parse(layout) is OutputLayout.BHTD:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        assert k.dtype == cache.dtype
        for b, seq in enumerate(seqs):
            n = int(plan.seq_lens[b])
            ek, ev = expected_kv(seq.tokens[:n], seq.salt, layer, cache.num_kv_heads,
                                 cache.head_dim, cache.dtype)
            assert np.array_equal(bits(k[b, :n]), bits(ek)), (layer, b)
            assert np.array_equal(bits(v[b, :n]), bits(ev)), (layer, b)
            assert not bits(k[b, n:]).any() and not bits(v[b, n:]).any()


def run_prompt(cache, prompt, expected_kv, salt=None):
    """add_sequence + extend + plan + write: a prefill step."""
    seq = cache.add_sequence(prompt, salt)
    cache.extend(seq, prompt[seq.num_cached_tokens:])
    plan = cache.plan([seq])
    write_step(cache, plan, [seq], expected_kv)
    return seq, plan


# ------------------------------------------------------------------- flows

def test_the_documented_flow(expected_kv, cache_backend):
    cache = PagedKVCache(2, 64, 16, 2, 8, dtype="float32", backend=cache_backend,
                         partial_page_reuse=False)
    prompt = list(range(100, 140))  # 2 full pages and 8 tokens
    seq = cache.add_sequence(prompt)
    assert seq.num_cached_tokens == 0
    new = prompt[seq.num_cached_tokens:]
    cache.extend(seq, new)
    plan = cache.plan([seq])
    k_buf = filled(cache, (1, 2, 48, 8), np.nan)
    v_buf = filled(cache, (1, 2, 48, 8), np.nan)
    for layer in range(2):
        k_new, v_new = expected_kv(prompt, None, layer, 2, 8, "float32")
        cache.write(layer, plan, k_new, v_new)
        k, v = cache.gather(layer, plan, layout="BHTD", out=(k_buf, v_buf))
        assert k is k_buf and v is v_buf
        k, v = cache.backend.to_numpy(k), cache.backend.to_numpy(v)
        assert np.array_equal(k[0].transpose(1, 0, 2)[:40], k_new)
        assert np.array_equal(v[0].transpose(1, 0, 2)[:40], v_new)
        assert not k[0, :, 40:].any() and not v[0, :, 40:].any()
    cache.release(seq)
    assert seq.is_released
    assert cache.num_evictable_pages == 2 and cache.num_free_pages == 62
    cache.check_invariants()
    # The next request with the same prompt reuses both full pages.
    again = cache.add_sequence(prompt)
    assert again.num_cached_tokens == 32


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("out_layout", ["BTHD", "BHTD"])
def test_prefill_and_decode_round_trip(expected_kv, dtype, layout, page_size, out_layout,
                                       cache_backend):
    cache = make_cache(cache_backend, num_pages=64, page_size=page_size, dtype=dtype, layout=layout)
    assert cache.layout is StoreLayout(layout) and cache.dtype == resolve_dtype(dtype)
    prompts = [list(range(1, 8)), list(range(50, 50 + 2 * page_size)), [7, 7, 7, 7, 7]]
    seqs = []
    for p in prompts:
        s = cache.add_sequence(p)
        cache.extend(s, p)
        seqs.append(s)
    plan = cache.plan(seqs)
    write_step(cache, plan, seqs, expected_kv)
    assert_gathered(cache, plan, seqs, expected_kv, out_layout)
    for step in range(3):  # decode: one token each, ragged lengths
        for i, s in enumerate(seqs):
            cache.extend(s, [step + i])
        plan = cache.plan(seqs)
        assert plan.new_lens.tolist() == [1, 1, 1]
        write_step(cache, plan, seqs, expected_kv)
        assert_gathered(cache, plan, seqs, expected_kv, out_layout)
    # Preallocated buffers longer than needed: the tail is zeroed.
    t = int(plan.seq_lens.max()) + 5
    shape = (3, t, 2, 3) if out_layout == "BTHD" else (3, 2, t, 3)
    out = (filled(cache, shape, 1), filled(cache, shape, 1))
    assert_gathered(cache, plan, seqs, expected_kv, out_layout, out=out)
    assert_gathered(cache, plan, seqs, expected_kv, out_layout, num_positions=t)
    cache.check_invariants()


def test_gather_default_layout_is_bhtd(expected_kv, cache_backend):
    cache = make_cache(cache_backend)
    seq, plan = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    k, v = cache.gather(0, plan)
    assert k.shape == (1, 2, 5, 3)


def test_prefix_reuse_across_requests(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=4, partial_page_reuse=False)
    system = list(range(1000, 1010))  # 10 tokens: 2 full pages shared
    first, _ = run_prompt(cache, system + [1, 2, 3], expected_kv)
    first_pages = first.page_ids
    cache.release(first)
    second = cache.add_sequence(system + [7, 8])
    assert second.num_cached_tokens == 8
    assert second.page_ids == first_pages[:2]
    assert second.num_tokens == second.num_computed_tokens == 8
    cache.extend(second, (system + [7, 8])[8:])
    plan = cache.plan([second])
    assert plan.context_lens.tolist() == [8]
    write_step(cache, plan, [second], expected_kv)
    assert_gathered(cache, plan, [second], expected_kv)
    cache.check_invariants()


def test_live_sequences_share_prefix_pages(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=2)
    a, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    b, plan_b = run_prompt(cache, [1, 2, 3, 4, 9, 9], expected_kv)
    assert b.num_cached_tokens == 4 and b.page_ids[:2] == a.page_ids[:2]
    assert all(cache.pool.ref_count(p) == 2 for p in a.page_ids[:2])
    plan = cache.plan([a, b])
    assert_gathered(cache, plan, [a, b], expected_kv)
    cache.release(a)
    assert all(cache.pool.ref_count(p) == 1 for p in b.page_ids[:2])
    cache.check_invariants()


def test_release_frees_tail_first_and_keeps_full_pages(expected_kv, cache_backend):
    cache = make_cache(cache_backend, num_pages=8, page_size=2, partial_page_reuse=False)
    seq, _ = run_prompt(cache, [1, 2, 3, 4, 5, 6, 7], expected_kv)
    pages = seq.page_ids
    cache.release(seq)
    # The partial last page is not worth keeping; full pages evict tail first.
    assert cache.pool.state(pages[3]) == FREE
    assert cache.pool.lru_order() == [pages[2], pages[1], pages[0]]
    assert all(cache.pool.state(p) == EVICTABLE for p in pages[:3])
    assert cache.stats.pages_evictable == 3 and cache.stats.pages_used == 0


def test_full_pages_are_indexed_only_after_the_plan_is_followed_by_a_call(expected_kv,
                                                                          cache_backend):
    cache = make_cache(cache_backend, page_size=2)
    seq = cache.add_sequence([1, 2, 3, 4, 5])
    cache.extend(seq, [1, 2, 3, 4, 5])
    assert len(cache.index) == 0
    plan = cache.plan([seq])
    assert len(cache.index) == 0  # not yet written
    write_step(cache, plan, [seq], expected_kv)
    probe = cache.add_sequence([1, 2, 3, 4, 5])  # the next call commits the plan
    assert len(cache.index) == 2
    assert probe.num_cached_tokens == 4


def test_extend_evicts_least_recently_used_cached_pages(expected_kv, cache_backend):
    cache = make_cache(cache_backend, num_pages=6, page_size=2, partial_page_reuse=False)
    old, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)   # 2 full pages + 1
    old_pages = old.page_ids
    cache.release(old)
    assert cache.num_evictable_pages == 2 and cache.num_free_pages == 4
    big = cache.add_sequence([9] * 9)
    cache.extend(big, [9] * 9)  # 5 pages: 4 free + the LRU page (old's tail page)
    assert old_pages[1] in big.page_ids and old_pages[0] not in big.page_ids
    assert len(cache.index) == 1
    cache.check_invariants()
    probe = cache.add_sequence([1, 2, 3, 4, 5])
    assert probe.num_cached_tokens == 2


def test_extend_out_of_pages_changes_nothing(expected_kv, state_of, same_state, cache_backend):
    cache = make_cache(cache_backend, num_pages=6, page_size=2)
    old, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    cache.release(old)
    seq = cache.add_sequence([5, 6, 7])
    cache.extend(seq, [5, 6, 7])           # 2 pages used, 2 free + 2 evictable left
    before = state_of(cache)
    with pytest.raises(OutOfPages) as info:
        cache.extend(seq, list(range(10)))  # needs 5 pages
    assert (info.value.num_needed, info.value.num_available) == (5, 4)
    assert "extend" in str(info.value)
    same_state(before, state_of(cache))
    assert not cache.can_extend(seq, 10) and cache.can_extend(seq, 9)
    assert cache.num_pages_needed(seq, 10) == 5
    cache.check_invariants()


def test_extend_out_of_pages_right_after_a_step_changes_nothing(expected_kv, state_of,
                                                                same_state, cache_backend):
    # errors.py: an operation that raises has changed nothing, the prefix
    # index included. Here the step's full pages are still waiting to be
    # indexed when extend runs out of pages.
    cache = make_cache(cache_backend, num_pages=3, page_size=2)
    seq, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)  # planned and written
    before = state_of(cache)
    with pytest.raises(OutOfPages):
        cache.extend(seq, [6, 7, 8])
    same_state(before, state_of(cache))


def test_write_accepts_strided_k_and_v(expected_kv, cache_backend):
    cache = make_cache(cache_backend, layout="HND")
    seq = cache.add_sequence([1, 2, 3, 4, 5])
    cache.extend(seq, [1, 2, 3, 4, 5])
    plan = cache.plan([seq])
    for layer in range(2):
        k, v = expected_kv(seq.tokens, None, layer, 2, 3, "float32")
        # [H, N, D] arrays viewed as [N, H, D]: not C-contiguous
        k_strided = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
        v_padded = np.zeros((5, 2, 6), np.float32)
        v_padded[..., ::2] = v
        assert not k_strided.flags.c_contiguous
        cache.write(layer, plan, k_strided, v_padded[..., ::2])
    assert_gathered(cache, plan, [seq], expected_kv)


def test_extend_by_nothing_is_a_no_op(expected_kv, state_of, same_state, cache_backend):
    cache = make_cache(cache_backend)
    seq, plan = run_prompt(cache, [1, 2, 3], expected_kv)
    cache.plan([seq])
    before = state_of(cache)
    cache.extend(seq, [])
    same_state(before, state_of(cache))
    cache.gather(0, plan)  # the plan is still current


def test_num_pages_needed(cache_backend):
    cache = make_cache(cache_backend, page_size=4)
    seq = cache.add_sequence([1])
    assert cache.num_pages_needed(seq, 0) == 0
    assert cache.num_pages_needed(seq, 1) == 1
    assert cache.num_pages_needed(seq, 4) == 1
    assert cache.num_pages_needed(seq, 5) == 2
    cache.extend(seq, [1, 2, 3])
    assert cache.num_pages_needed(seq, 1) == 0
    assert cache.num_pages_needed(seq, 2) == 1
    assert cache.can_extend(seq, 4 * 31 + 1) and not cache.can_extend(seq, 4 * 31 + 2)


# ------------------------------------------------------------------ fork

@pytest.mark.parametrize("first", ["child", "parent"])
def test_fork_copies_a_shared_partial_page_on_first_extend(expected_kv, first, cache_backend):
    cache = make_cache(cache_backend, page_size=4)
    parent, _ = run_prompt(cache, [1, 2, 3, 4, 5, 6], expected_kv)  # last page half full
    child = cache.fork(parent)
    assert child.page_ids == parent.page_ids and child.seq_id != parent.seq_id
    assert child.tokens.tolist() == parent.tokens.tolist()
    assert child.num_tokens == child.num_computed_tokens == 6
    assert child.salt == parent.salt
    shared = parent.page_ids[1]
    assert cache.pool.ref_count(shared) == 2
    host = cache.backend.to_numpy
    snapshot_shared = (host(cache.k_cache)[:, shared].copy(), host(cache.v_cache)[:, shared].copy())
    mover, stayer = (child, parent) if first == "child" else (parent, child)
    assert cache.num_pages_needed(mover, 1) == 1  # the copy
    cache.extend(mover, [42])
    assert mover.page_ids[0] == stayer.page_ids[0]           # full page still shared
    assert mover.page_ids[1] != shared and stayer.page_ids[1] == shared
    assert cache.pool.ref_count(shared) == 1
    plan = cache.plan([mover])
    write_step(cache, plan, [mover], expected_kv)
    # The other side's page is untouched by the mover's write.
    assert np.array_equal(host(cache.k_cache)[:, shared], snapshot_shared[0])
    assert np.array_equal(host(cache.v_cache)[:, shared], snapshot_shared[1])
    cache.extend(stayer, [43, 44])   # no longer shared: no copy
    assert stayer.page_ids[1] == shared
    plan = cache.plan([mover, stayer])
    write_step(cache, plan, [mover, stayer], expected_kv)
    assert_gathered(cache, plan, [mover, stayer], expected_kv)
    cache.check_invariants()


def test_fork_with_a_full_last_page_copies_nothing(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=4)
    parent, _ = run_prompt(cache, list(range(8)), expected_kv)
    child = cache.fork(parent)
    free = cache.num_free_pages
    cache.extend(child, [1])
    cache.extend(parent, [2])
    assert cache.num_free_pages == free - 2
    assert child.page_ids[:2] == parent.page_ids[:2]
    plan = cache.plan([parent, child])
    write_step(cache, plan, [parent, child], expected_kv)
    assert_gathered(cache, plan, [parent, child], expected_kv)


def test_fork_three_ways(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=4)
    parent, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    kids = [cache.fork(parent), cache.fork(parent)]
    assert cache.pool.ref_count(parent.page_ids[1]) == 3
    for i, s in enumerate([kids[0], parent, kids[1]]):
        cache.extend(s, [10 + i, 20 + i])
    plan = cache.plan([parent] + kids)
    write_step(cache, plan, [parent] + kids, expected_kv)
    assert_gathered(cache, plan, [parent] + kids, expected_kv)
    assert len({s.page_ids[1] for s in [parent] + kids}) == 3
    cache.check_invariants()


def test_fork_needs_planned_tokens(state_of, same_state, cache_backend):
    cache = make_cache(cache_backend)
    seq = cache.add_sequence([1, 2, 3])
    cache.extend(seq, [1, 2, 3])
    before = state_of(cache)
    with pytest.raises(SequenceError, match="seq"):
        cache.fork(seq)
    same_state(before, state_of(cache))


@pytest.mark.parametrize("written", [0, 1])
def test_fork_between_plan_and_write_is_refused(expected_kv, state_of, same_state, written,
                                                cache_backend):
    """A copy of the shared last page taken before the parent's write lands
    would miss it; a fork with a plan still unwritten (in any layer) is
    refused, and allowed once the plan is written."""
    cache = make_cache(cache_backend, page_size=4)
    a = cache.add_sequence([1, 2, 3, 4, 5, 6])
    cache.extend(a, [1, 2, 3, 4, 5, 6])
    plan = cache.plan([a])
    k, v = expected_kv(a.tokens, None, 0, cache.num_kv_heads, cache.head_dim, cache.dtype)
    for layer in range(written):            # none, or only some of the layers
        cache.write(layer, plan, k, v)
    before = state_of(cache)
    with pytest.raises(SequenceError, match="not written"):
        cache.fork(a)
    same_state(before, state_of(cache))
    # the variant: the plan discarded after a fork would have left the child
    # counting tokens that were never written
    cache.discard(plan)
    assert a.num_computed_tokens == 0
    with pytest.raises(SequenceError, match="not yet planned"):
        cache.fork(a)
    plan = cache.plan([a])
    write_step(cache, plan, [a], expected_kv)
    b = cache.fork(a)
    cache.extend(b, [7])
    plan_b = cache.plan([b])
    write_step(cache, plan_b, [b], expected_kv)
    assert_gathered(cache, plan_b, [b], expected_kv)      # positions 4-5 included
    cache.release(a)
    assert_gathered(cache, cache.plan([b]), [b], expected_kv)
    cache.check_invariants()


def test_gather_buffers_too_large_to_allocate_are_refused(state_of, same_state, cache_backend):
    cache = make_cache(cache_backend)
    seq, plan = cache.add_sequence([1, 2, 3]), None
    cache.extend(seq, [1, 2, 3])
    plan = cache.plan([seq])
    before = state_of(cache)
    with pytest.raises(AllocationError, match="num_positions"):
        cache.gather(0, plan, num_positions=10**15)
    with pytest.raises(ConfigError, match="num_positions"):
        cache.gather(0, plan, num_positions=2**63)
    same_state(before, state_of(cache))
    with pytest.raises(AllocationError, match="num_pages"):
        make_cache(cache_backend, num_layers=10**4, num_pages=10**6, num_kv_heads=8, head_dim=128)


def test_extend_of_a_forked_sequence_out_of_pages_changes_nothing(expected_kv, state_of,
                                                                 same_state, cache_backend):
    cache = make_cache(cache_backend, num_pages=2, page_size=4)
    parent, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)  # both pages used
    child = cache.fork(parent)
    before = state_of(cache)
    with pytest.raises(OutOfPages) as info:
        cache.extend(child, [6])  # needs the copy of the shared page
    assert (info.value.num_needed, info.value.num_available) == (1, 0)
    same_state(before, state_of(cache))
    shared = child.page_ids[1]
    cache.release(parent)
    cache.extend(child, [6])  # no longer shared: fits in place
    assert child.page_ids[1] == shared


def test_extend_batch_equals_an_extend_per_sequence(expected_kv, state_of, same_state,
                                                    cache_backend):
    caches = [make_cache(cache_backend, num_pages=16, page_size=2) for _ in range(2)]
    batches = []
    for cache in caches:
        a, _ = run_prompt(cache, [1, 2, 3], expected_kv)     # room left in its page
        b, _ = run_prompt(cache, [4, 5, 6, 7], expected_kv)  # full pages
        c = cache.fork(b)
        batches.append([c, a, b])
    caches[0].extend_batch(batches[0], np.array([11, 12, 13]))
    for seq, tok in zip(batches[1], [11, 12, 13]):
        caches[1].extend(seq, [tok])
    # the caches differ in their hash keys only: compare what does not hash
    views = [[(s.page_ids, s.num_tokens, s.num_computed_tokens, list(s.tokens)) for s in seqs]
             for seqs in batches]
    assert views[0] == views[1]
    assert state_of(caches[0])["pool"] == state_of(caches[1])["pool"]
    for cache, seqs in zip(caches, batches):
        assert [s.tokens[-1] for s in seqs] == [11, 12, 13]
        plan = cache.plan(seqs)
        assert plan.new_lens.tolist() == [1, 1, 1]
        write_step(cache, plan, seqs, expected_kv)
        assert_gathered(cache, plan, seqs, expected_kv)
        cache.check_invariants()


def test_extend_batch_of_forks_sharing_a_partial_page(expected_kv, cache_backend):
    cache = make_cache(cache_backend, num_pages=4, page_size=4)
    parent, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)   # page 2 holds 1 token
    child = cache.fork(parent)
    # at most 2 pages for 2 copies; the second sequence then holds its page alone
    cache.extend_batch([parent, child], [6, 7])
    assert cache.num_free_pages == 1
    assert parent.page_ids[1] != child.page_ids[1]
    plan = cache.plan([parent, child])
    write_step(cache, plan, [parent, child], expected_kv)
    assert_gathered(cache, plan, [parent, child], expected_kv)
    cache.check_invariants()


def test_extend_batch_out_of_pages_changes_nothing(expected_kv, state_of, same_state,
                                                   cache_backend):
    cache = make_cache(cache_backend, num_pages=5, page_size=2)
    seqs = [run_prompt(cache, [i, i + 1], expected_kv)[0] for i in (1, 5)]   # full pages
    third, _ = run_prompt(cache, [7], expected_kv)
    assert cache.num_free_pages == 2
    cache.extend(third, [8])
    before = state_of(cache)
    with pytest.raises(OutOfPages) as info:
        cache.extend_batch(seqs + [third], [1, 2, 3])   # 3 new pages, 2 free
    assert (info.value.num_needed, info.value.num_available) == (3, 2)
    same_state(before, state_of(cache))
    cache.extend_batch(seqs, [1, 2])
    assert cache.num_free_pages == 0


@pytest.mark.parametrize("call, err", [
    (lambda c, s: c.extend_batch(s, [1]), ShapeError),                    # one token for two
    (lambda c, s: c.extend_batch(s, [[1], [2]]), ShapeError),
    (lambda c, s: c.extend_batch(s, [1.5, 2]), DTypeError),
    (lambda c, s: c.extend_batch(s, [1, -2]), DTypeError),
    (lambda c, s: c.extend_batch([s[0], s[0]], [1, 2]), SequenceError),    # listed twice
    (lambda c, s: c.extend_batch(s[0], [1]), DTypeError),                  # not a list
    (lambda c, s: c.extend_batch([s[0], "x"], [1, 2]), DTypeError),
    (lambda c, s: c.extend_batch([s[0], make_cache(c.backend).add_sequence([1])], [1, 2]),
     SequenceError),                                                       # another cache's
])
def test_bad_extend_batch_changes_nothing(expected_kv, state_of, same_state, call, err,
                                          cache_backend):
    cache = make_cache(cache_backend)
    seqs = [run_prompt(cache, p, expected_kv)[0] for p in ([1, 2, 3], [4, 5])]
    before = state_of(cache)
    with pytest.raises(err):
        call(cache, seqs)
    same_state(before, state_of(cache))


def test_extend_batch_of_nothing_is_a_no_op(expected_kv, state_of, same_state, cache_backend):
    cache = make_cache(cache_backend)
    seq, plan = run_prompt(cache, [1, 2, 3], expected_kv)
    before = state_of(cache)
    cache.extend_batch([], [])
    same_state(before, state_of(cache))
    cache.gather(0, plan)  # the plan is still current


# ------------------------------------------------------------ release

def test_released_sequence_cannot_be_used(expected_kv, state_of, same_state, cache_backend):
    cache = make_cache(cache_backend)
    seq, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    cache.release(seq)
    assert seq.is_released and seq.page_ids == () and "released" in repr(seq)
    before = state_of(cache)
    for call in (lambda: cache.extend(seq, [1]), lambda: cache.plan([seq]),
                 lambda: cache.fork(seq), lambda: cache.release(seq),
                 lambda: cache.num_pages_needed(seq, 1), lambda: cache.can_extend(seq, 1)):
        with pytest.raises(SequenceError, match="released"):
            call()
    same_state(before, state_of(cache))


def test_release_after_an_unwritten_plan_indexes_nothing_of_it(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=2, partial_page_reuse=False)
    seq = cache.add_sequence([1, 2, 3, 4, 5, 6, 7])
    cache.extend(seq, [1, 2, 3])
    plan = cache.plan([seq])
    write_step(cache, plan, [seq], expected_kv)
    assert len(cache.index) == 1       # page 0, written in every layer
    cache.extend(seq, [4, 5, 6, 7])
    plan = cache.plan([seq])           # pages 1 and 2 planned, never written
    cache.release(seq)
    assert len(cache.index) == 1
    assert cache.num_evictable_pages == 1 and cache.num_free_pages == cache.num_pages - 1
    assert cache.add_sequence([1, 2, 3, 4, 5, 6, 7]).num_cached_tokens == 2


def test_release_with_caching_indexes_full_planned_pages(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=2, partial_page_reuse=False)
    seq, _ = run_prompt(cache, [1, 2, 3, 4, 5, 6, 7], expected_kv)
    cache.extend(seq, [8, 9])  # reserved, never planned: not indexed
    cache.release(seq)
    assert len(cache.index) == 3
    assert cache.add_sequence([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_cached_tokens == 6


def test_disabled_prefix_caching_looks_up_and_indexes_nothing(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=2, enable_prefix_caching=False)
    seq, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    cache.release(seq)
    assert len(cache.index) == 0 and cache.num_free_pages == cache.num_pages
    again = cache.add_sequence([1, 2, 3, 4, 5])
    assert again.num_cached_tokens == 0 and cache.stats.prefix_query_tokens == 0


# ------------------------------------------------------------ partial pages

def test_a_shared_prefix_shorter_than_a_page_hits(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=16)
    first, _ = run_prompt(cache, [7, 8, 9, 1, 2], expected_kv)
    first_pages = first.page_ids
    cache.release(first)
    assert cache.num_evictable_pages == 1          # the partly filled page is kept
    seq = cache.add_sequence([7, 8, 9, 3])
    assert seq.num_cached_tokens == 3
    assert seq.page_ids[0] != first_pages[0]       # a copy: the original stays intact
    cache.extend(seq, [3])
    plan = cache.plan([seq])
    write_step(cache, plan, [seq], expected_kv)
    assert_gathered(cache, plan, [seq], expected_kv)
    assert cache.stats.prefix_hit_tokens == 3


def test_a_prompt_leaving_a_full_page_midway_reuses_its_head(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=4)
    first, _ = run_prompt(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9], expected_kv)
    first_pages = first.page_ids
    cache.release(first)
    seq = cache.add_sequence([1, 2, 3, 4, 5, 6, 0, 0, 0])
    assert seq.num_cached_tokens == 6               # one whole page, then 2 of the next
    assert seq.page_ids[0] == first_pages[0]        # whole pages are shared
    assert seq.page_ids[1] != first_pages[1]
    cache.extend(seq, [0, 0, 0])
    plan = cache.plan([seq])
    write_step(cache, plan, [seq], expected_kv)
    assert_gathered(cache, plan, [seq], expected_kv)
    again = cache.add_sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    plan = cache.plan([again])
    assert_gathered(cache, plan, [again], expected_kv)   # the original page is unchanged


def test_partial_reuse_respects_salts_and_the_last_token(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=16)
    first, _ = run_prompt(cache, [5, 6, 7], expected_kv)
    cache.release(first)
    assert cache.add_sequence([5, 6, 7, 8], salt="other").num_cached_tokens == 0
    assert cache.add_sequence([5, 6, 7]).num_cached_tokens == 2
    assert cache.add_sequence([5]).num_cached_tokens == 0


def test_partial_reuse_without_a_free_page_falls_back_to_whole_pages(expected_kv, cache_backend):
    cache = make_cache(cache_backend, num_pages=2, page_size=4)
    first, _ = run_prompt(cache, [1, 2, 3, 4, 5, 6], expected_kv)
    cache.release(first)                            # page 0 indexed, page 1 partial
    holder = cache.add_sequence([9])
    cache.extend(holder, [9])                       # takes a page: only the two cached left
    seq = cache.add_sequence([1, 2, 3, 4, 5, 9, 9])
    assert seq.num_cached_tokens in (4, 5)          # the copy needs a page: it may evict
    cache.check_invariants()


def test_partial_reuse_can_be_turned_off(expected_kv, cache_backend):
    cache = make_cache(cache_backend, page_size=16, partial_page_reuse=False)
    first, _ = run_prompt(cache, [7, 8, 9, 1, 2], expected_kv)
    cache.release(first)
    assert cache.num_evictable_pages == 0
    assert cache.add_sequence([7, 8, 9, 3]).num_cached_tokens == 0


# ------------------------------------------------------------ plans

@pytest.mark.parametrize("change", ["extend_same", "release_same"])
def test_stale_plan_is_refused(expected_kv, state_of, same_state, change, cache_backend):
    cache = make_cache(cache_backend)
    a, _ = run_prompt(cache, [1, 2, 3], expected_kv)
    plan = cache.plan([a])
    if change == "extend_same":
        cache.extend(a, [7])
    else:
        cache.release(a)
    before = state_of(cache)
    k = np.zeros((plan.num_new_tokens, 2, 3), np.float32)
    with pytest.raises(StalePlanError, match="plan"):
        cache.write(0, plan, k, k)
    with pytest.raises(StalePlanError, match="plan"):
        cache.gather(0, plan)
    same_state(before, state_of(cache))


@pytest.mark.parametrize("change", ["extend_other", "release_other", "add_other"])
def test_plan_survives_changes_to_other_sequences(expected_kv, change, cache_backend):
    # Another thread's sequences may change between this plan and its writes.
    cache = make_cache(cache_backend, page_size=2)
    a = cache.add_sequence([1, 2, 3])
    cache.extend(a, [1, 2, 3])
    b, _ = run_prompt(cache, [4, 5, 6], expected_kv)
    plan = cache.plan([a])
    if change == "extend_other":
        cache.extend(b, [7, 8, 9])
    elif change == "release_other":
        cache.release(b)
    else:
        cache.add_sequence([1, 2, 3])
    write_step(cache, plan, [a], expected_kv)
    assert_gathered(cache, plan, [a], expected_kv)


def test_plan_from_another_cache_is_refused(expected_kv, cache_backend):
    one, two = make_cache(cache_backend), make_cache(cache_backend)
    seq, plan = run_prompt(one, [1, 2, 3], expected_kv)
    run_prompt(two, [1, 2, 3], expected_kv)
    k = np.zeros((3, 2, 3), np.float32)
    with pytest.raises(StalePlanError, match="another cache"):
        two.write(0, plan, k, k)
    with pytest.raises(StalePlanError, match="another cache"):
        two.gather(0, plan)


def test_sequence_from_another_cache_is_refused(state_of, same_state, cache_backend):
    one, two = make_cache(cache_backend), make_cache(cache_backend)
    seq = one.add_sequence([1, 2, 3])
    two.add_sequence([1, 2, 3])
    before = state_of(two)
    for call in (lambda: two.extend(seq, [1]), lambda: two.plan([seq]), lambda: two.fork(seq),
                 lambda: two.release(seq), lambda: two.num_pages_needed(seq, 1)):
        with pytest.raises(SequenceError, match="another cache"):
            call()
    same_state(before, state_of(two))
    assert not seq.is_released


def test_plan_with_a_duplicated_sequence_is_refused(state_of, same_state, cache_backend):
    cache = make_cache(cache_backend)
    a = cache.add_sequence([1, 2, 3])
    cache.extend(a, [1, 2, 3])
    b = cache.add_sequence([4])
    before = state_of(cache)
    with pytest.raises(SequenceError, match="seqs.*twice"):
        cache.plan([a, b, a])
    same_state(before, state_of(cache))
    assert a.num_computed_tokens == 0


def test_a_new_plan_does_not_invalidate_the_previous_one(expected_kv, cache_backend):
    cache = make_cache(cache_backend)
    a, plan = run_prompt(cache, [1, 2, 3], expected_kv)
    cache.plan([a])
    assert_gathered(cache, plan, [a], expected_kv)


def test_discard_takes_a_plan_back(expected_kv, state_of, same_state, cache_backend):
    cache = make_cache(cache_backend, page_size=2)
    seq = cache.add_sequence([1, 2, 3, 4, 5])
    cache.extend(seq, [1, 2, 3, 4, 5])
    after_extend = state_of(cache)
    plan = cache.plan([seq])
    assert seq.num_computed_tokens == 5
    cache.discard(plan)  # say, the model call failed
    same_state(after_extend, state_of(cache))
    assert seq.num_computed_tokens == 0
    assert cache.add_sequence([1, 2, 3, 4, 5]).num_cached_tokens == 0  # nothing indexed
    again = cache.plan([seq])
    assert again.context_lens.tolist() == [0] and again.new_lens.tolist() == [5]
    write_step(cache, again, [seq], expected_kv)
    assert_gathered(cache, again, [seq], expected_kv)


def test_discard_of_a_written_plan_is_refused(expected_kv, state_of, same_state, cache_backend):
    cache = make_cache(cache_backend, page_size=2)
    seq, plan = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)  # every layer written
    before = state_of(cache)
    with pytest.raises(StalePlanError, match="plan"):
        cache.discard(plan)
    same_state(before, state_of(cache))
    assert seq.num_computed_tokens == 5


def test_discard_of_a_stale_or_foreign_plan_is_refused(expected_kv, state_of, same_state,
                                                       cache_backend):
    cache = make_cache(cache_backend, page_size=2)
    a, plan = run_prompt(cache, [1, 2, 3], expected_kv)
    b = cache.add_sequence([4])
    cache.extend(b, [4])
    before = state_of(cache)
    with pytest.raises(StalePlanError):
        cache.discard(plan)
    with pytest.raises(StalePlanError, match="another cache"):
        cache.discard(make_cache(cache_backend).plan([]))
    with pytest.raises(DTypeError, match="plan"):
        cache.discard("plan")
    same_state(before, state_of(cache))


def test_discard_of_a_plan_without_new_tokens_changes_nothing(expected_kv, state_of,
                                                             same_state, cache_backend):
    cache = make_cache(cache_backend)
    seq, _ = run_prompt(cache, [1, 2, 3], expected_kv)
    plan = cache.plan([seq])
    before = state_of(cache)
    cache.discard(plan)
    same_state(before, state_of(cache))


# ------------------------------------------------------------ sizing / stats

def test_memory_bytes_sizes_the_store(cache_backend):
    per_page = 2 * 3 * 8 * 2 * 4 * 2  # K+V, layers, page_size, heads, head_dim, bytes
    cache = PagedKVCache(3, None, 8, 2, 4, dtype="float16", backend=cache_backend, layout="NHD",
                         memory_bytes=per_page * 20 + 5)
    assert cache.num_pages == 20
    assert cache.nbytes == per_page * 20 == cache.k_cache.nbytes + cache.v_cache.nbytes
    assert cache.k_cache.shape == (3, 20, 8, 2, 4) and cache.k_cache.dtype == np.float16


def test_properties_and_repr():
    cache = make_cache("numpy", num_layers=3, num_pages=7, page_size=5, num_kv_heads=2, head_dim=4,
                       dtype="bfloat16", layout="HND")
    assert (cache.num_layers, cache.num_pages, cache.page_size, cache.num_kv_heads,
            cache.head_dim) == (3, 7, 5, 2, 4)
    assert cache.k_cache.shape == cache.v_cache.shape == (3, 7, 2, 5, 4)
    assert cache.nbytes == 2 * 3 * 7 * 2 * 5 * 4 * 2
    assert "layout=HND" in repr(cache) and "backend='numpy'" in repr(cache)


def test_stats(expected_kv, cache_backend):
    cache = make_cache(cache_backend, num_pages=10, page_size=2, partial_page_reuse=False)
    s = cache.stats
    assert (s.num_pages, s.pages_used, s.pages_free, s.pages_evictable, s.num_sequences,
            s.prefix_hit_tokens, s.prefix_query_tokens, s.prefix_hit_rate) == (
        10, 0, 10, 0, 0, 0, 0, 0.0)
    a, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    b = cache.add_sequence([1, 2, 3, 4, 9])
    s = cache.stats
    assert (s.pages_used, s.pages_free, s.pages_evictable, s.num_sequences) == (3, 7, 0, 2)
    assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (4, 10)
    assert s.prefix_hit_rate == pytest.approx(0.4)
    assert s["prefix_hit_rate"] == pytest.approx(0.4) and s["num_sequences"] == 2
    d = s.as_dict()
    assert set(d) == {"num_pages", "pages_used", "pages_free", "pages_evictable",
                      "num_sequences", "prefix_hit_tokens", "prefix_query_tokens",
                      "prefix_hit_rate"}
    cache.release(a)
    cache.release(b)
    s = cache.stats
    assert (s.pages_used, s.pages_free, s.pages_evictable, s.num_sequences) == (0, 8, 2, 0)
    with pytest.raises(AttributeError):
        s.pages_used = 5


def test_sequence_properties(cache_backend):
    cache = make_cache(cache_backend)
    seq = cache.add_sequence([5, 6, 7], salt="t")
    assert isinstance(seq, Sequence) and seq.salt == "t"
    cache.extend(seq, [5, 6, 7])
    toks = seq.tokens
    assert toks.dtype == np.int64 and toks.tolist() == [5, 6, 7]
    toks[0] = 99
    assert seq.tokens.tolist() == [5, 6, 7]  # a copy
    assert isinstance(seq.page_ids, tuple) and len(seq.page_ids) == 1
    assert (seq.num_tokens, seq.num_computed_tokens, seq.num_cached_tokens) == (3, 0, 0)
    assert not seq.is_released and "tokens=3" in repr(seq)


# ------------------------------------------------------------ collisions

def seed_like_hash(secret, parent, tokens):
    """A weak hash that ignores the parent, as the seed's page_hash did."""
    return hashlib.blake2b(tokens, digest_size=16).digest()


def test_weak_hash_never_serves_a_page_computed_after_another_prefix(expected_kv, cache_backend):
    # Verification must make the cache exact whatever the hash does: page
    # contents are only ever served after exactly the prefix they were
    # computed after.
    cache = make_cache(cache_backend, page_size=2, _hash_fn=seed_like_hash)
    A, B, D = [1, 1], [2, 2], [4, 4]
    s1, _ = run_prompt(cache, A + [9], expected_kv)
    cache.release(s1)
    s2, _ = run_prompt(cache, B + A + D + [9], expected_kv)  # D computed after B + A
    cache.release(s2)
    s3 = cache.add_sequence(A + D + [9])                     # D after A alone
    cache.extend(s3, (A + D + [9])[s3.num_cached_tokens:])
    plan = cache.plan([s3])
    write_step(cache, plan, [s3], expected_kv)
    assert_gathered(cache, plan, [s3], expected_kv)
    assert s3.num_cached_tokens == 2


# ------------------------------------------------------------ bad input

BAD_CTOR = [
    ("num_layers", 0, ConfigError), ("num_pages", -1, ConfigError),
    ("page_size", 2.0, DTypeError), ("num_kv_heads", None, DTypeError),
    ("head_dim", 0, ConfigError), ("dtype", "float64", DTypeError),
    ("layout", "NDH", LayoutError), ("backend", "nope", ConfigError),
    ("backend", 3, ConfigError), ("memory_bytes", 10, ConfigError),
    ("hash_secret", b"", ConfigError), ("hash_secret", "text", ConfigError),
]


@pytest.mark.parametrize("name, value, error", BAD_CTOR)
def test_bad_constructor_arguments(name, value, error):
    kw = dict(num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=2,
              dtype="float32", layout="NHD", backend="numpy")
    if name == "memory_bytes":
        kw["num_pages"] = None
    kw[name] = value
    args = [kw.pop(k) for k in ("num_layers", "num_pages", "page_size", "num_kv_heads",
                                "head_dim")]
    with pytest.raises(error, match=name.replace("hash_", "")):
        PagedKVCache(*args, **kw)


def test_bad_constructor_without_any_size():
    with pytest.raises(ConfigError, match="num_pages"):
        PagedKVCache(1, None, 2, 1, 2, backend="numpy")


@pytest.fixture
def busy_cache(expected_kv, cache_backend):
    """A cache with a live sequence that reused a cached prefix, and its
    prefill plan (still current)."""
    cache = make_cache(cache_backend, num_pages=8, page_size=2)
    old, _ = run_prompt(cache, [1, 2, 3, 4, 5], expected_kv)
    cache.release(old)
    seq, plan = run_prompt(cache, [1, 2, 3, 4, 6, 7], expected_kv)
    cache.plan([seq])  # indexes the written pages; the prefill plan stays current
    return cache, seq, plan


def _out(c, t=6, dtype=np.float32):
    return c.backend.zeros((1, 2, t, 3), dtype)


def _read_only(c):
    """A read-only output buffer. A device array has no read-only flag: for a
    device backend this is a read-only host array, which it refuses too."""
    x = _out(c)
    if not isinstance(x, np.ndarray):
        x = np.zeros(x.shape, x.dtype)
    x.setflags(write=False)
    return x


# (description, call(cache, seq, plan, kv), error, word the message must name);
# kv is a valid k (and v) for the plan.
BAD_CALLS = [
    ("prompt empty", lambda c, s, p, kv: c.add_sequence([]), ShapeError, "prompt"),
    ("prompt float", lambda c, s, p, kv: c.add_sequence([1.5]), DTypeError, "prompt"),
    ("prompt negative", lambda c, s, p, kv: c.add_sequence([-1]), DTypeError, "prompt"),
    ("prompt 2-D", lambda c, s, p, kv: c.add_sequence(np.zeros((2, 2), np.int64)), ShapeError,
     "prompt"),
    ("prompt None", lambda c, s, p, kv: c.add_sequence(None), DTypeError, "prompt"),
    ("salt float", lambda c, s, p, kv: c.add_sequence([1, 2], salt=1.5), DTypeError, "salt"),
    ("salt list", lambda c, s, p, kv: c.add_sequence([1, 2], salt=["a"]), DTypeError, "salt"),
    ("extend tokens str", lambda c, s, p, kv: c.extend(s, "12"), DTypeError, "tokens"),
    ("extend tokens float", lambda c, s, p, kv: c.extend(s, [1.0]), DTypeError, "tokens"),
    ("extend seq", lambda c, s, p, kv: c.extend(3, [1]), DTypeError, "seq"),
    ("fork seq", lambda c, s, p, kv: c.fork(None), DTypeError, "seq"),
    ("release seq", lambda c, s, p, kv: c.release("x"), DTypeError, "seq"),
    ("plan single", lambda c, s, p, kv: c.plan(s), DTypeError, "seqs"),
    ("plan generator", lambda c, s, p, kv: c.plan(x for x in [s]), DTypeError, "seqs"),
    ("plan item", lambda c, s, p, kv: c.plan([s, 3]), DTypeError, "seqs"),
    ("needed seq", lambda c, s, p, kv: c.num_pages_needed(None, 1), DTypeError, "seq"),
    ("needed str", lambda c, s, p, kv: c.num_pages_needed(s, "3"), DTypeError,
     "num_new_tokens"),
    ("needed float", lambda c, s, p, kv: c.num_pages_needed(s, 2.5), DTypeError,
     "num_new_tokens"),
    ("needed negative", lambda c, s, p, kv: c.num_pages_needed(s, -1), ConfigError,
     "num_new_tokens"),
    ("can_extend str", lambda c, s, p, kv: c.can_extend(s, "3"), DTypeError,
     "num_new_tokens"),
    ("write layer", lambda c, s, p, kv: c.write(2, p, kv, kv), PageIdError, "layer"),
    ("write layer type", lambda c, s, p, kv: c.write(0.0, p, kv, kv), DTypeError, "layer"),
    ("write plan", lambda c, s, p, kv: c.write(0, None, kv, kv), DTypeError, "plan"),
    ("write k shape", lambda c, s, p, kv: c.write(0, p, kv[:1], kv), ShapeError, "k"),
    ("write v shape", lambda c, s, p, kv: c.write(0, p, kv, kv[:, :1]), ShapeError, "v"),
    ("write k dtype", lambda c, s, p, kv: c.write(0, p, kv.astype(np.float16), kv),
     DTypeError, "k"),
    ("write k list", lambda c, s, p, kv: c.write(0, p, kv.tolist(), kv), DTypeError, "k"),
    ("gather layer", lambda c, s, p, kv: c.gather(-1, p), PageIdError, "layer"),
    ("gather plan", lambda c, s, p, kv: c.gather(0, "plan"), DTypeError, "plan"),
    ("gather layout", lambda c, s, p, kv: c.gather(0, p, layout="TBHD"), LayoutError,
     "layout"),
    ("gather out pair", lambda c, s, p, kv: c.gather(0, p, out=_out(c)), DTypeError, "out"),
    ("gather out short", lambda c, s, p, kv: c.gather(0, p, out=(_out(c, 5), _out(c, 5))),
     ShapeError, "out"),
    ("gather out dtype", lambda c, s, p, kv: c.gather(
        0, p, out=(_out(c, dtype=np.float64), _out(c, dtype=np.float64))), DTypeError, "out"),
    ("gather out strided", lambda c, s, p, kv: c.gather(
        0, p, out=(c.backend.zeros((1, 2, 6, 6), np.float32)[..., ::2], _out(c))), ShapeError,
     "out"),
    ("gather out read-only", lambda c, s, p, kv: c.gather(0, p, out=(_read_only(c), _out(c))),
     ShapeError, "out"),
    ("gather out shared", lambda c, s, p, kv: c.gather(0, p, out=(_out(c),) * 2), ShapeError,
     "out"),
    ("gather num_positions", lambda c, s, p, kv: c.gather(0, p, num_positions=5), ShapeError,
     "num_positions"),
    ("gather num_positions type", lambda c, s, p, kv: c.gather(0, p, num_positions=7.0),
     DTypeError, "num_positions"),
]


@pytest.mark.parametrize("what, call, error, word", BAD_CALLS,
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_input_names_the_argument_and_changes_nothing(busy_cache, state_of, same_state,
                                                         what, call, error, word):
    cache, seq, plan = busy_cache
    kv = np.zeros((plan.num_new_tokens, 2, 3), np.float32)
    if what == "gather out read-only" and not isinstance(cache.k_cache, np.ndarray):
        error = DTypeError   # a device backend refuses a host buffer before its flags
    before = state_of(cache)
    with pytest.raises(error) as info:
        call(cache, seq, plan, kv)
    assert word in str(info.value), str(info.value)
    same_state(before, state_of(cache))
    cache.check_invariants()


# ------------------------------------------------------------ threads

def test_threads_share_one_cache(expected_kv, cache_backend):
    """Smoke test: several threads add, extend, plan, write, gather and
    release on one cache. A plan goes stale whenever another thread reserves
    or releases pages (documented), so StalePlanError is tolerated here; the
    structures must stay consistent whatever the interleaving."""
    cache = make_cache(cache_backend, num_layers=1, num_pages=48, page_size=2)
    system = [7, 7, 8, 8, 9, 9]
    errors, stale = [], [0]
    barrier = threading.Barrier(4)

    def worker(wid):
        rng = np.random.default_rng(wid)
        try:
            barrier.wait()
            for it in range(40):
                prompt = system + rng.integers(0, 5, size=int(rng.integers(1, 6))).tolist()
                seq = cache.add_sequence(prompt, salt=int(rng.integers(2)))
                try:
                    cache.extend(seq, prompt[seq.num_cached_tokens:])
                    plan = cache.plan([seq])
                    k = np.zeros((plan.num_new_tokens, 2, 3), np.float32)
                    try:
                        cache.write(0, plan, k, k)
                        kk, _ = cache.gather(0, plan)
                        assert kk.shape[2] == seq.num_tokens
                    except StalePlanError:
                        stale[0] += 1
                    if it % 3 == 0:
                        child = cache.fork(seq)
                        cache.extend(child, [it])
                        cache.release(child)
                except OutOfPages:
                    pass
                cache.release(seq)
        except BaseException as exc:  # reported below, with the thread's id
            errors.append((wid, repr(exc)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    cache.check_invariants()
    s = cache.stats
    assert s.num_sequences == 0 and s.pages_used == 0
    assert s.pages_free + s.pages_evictable == cache.num_pages


def test_pages_planned_in_one_thread_are_not_served_before_they_are_written(expected_kv,
                                                                            cache_backend):
    """The cache may be shared by threads, so another thread's call can come
    between a plan and its writes. Pages of that plan must not be handed to
    another sequence as a cached prefix before their K/V is written."""
    cache = make_cache(cache_backend, num_layers=1, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    planned, go_on = threading.Event(), threading.Event()
    result = {}

    def thread_a():
        seq = cache.add_sequence(prompt)
        cache.extend(seq, prompt)
        plan = cache.plan([seq])
        planned.set()
        go_on.wait(10)  # the other thread runs here
        k, v = expected_kv(prompt, None, 0, 2, 3, "float32")
        cache.write(0, plan, k, v)

    def thread_b():
        planned.wait(10)
        seq = cache.add_sequence(prompt)
        plan = cache.plan([seq])
        result["cached"] = seq.num_cached_tokens
        result["k"], _ = cache.gather(0, plan, layout="BTHD")
        go_on.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    n = result["cached"]
    ek, _ = expected_kv(prompt, None, 0, 2, 3, "float32")
    assert np.array_equal(cache.backend.to_numpy(result["k"])[0, :n], ek[:n]), (
        f"{n} cached token(s) served before their K/V was written")


# ------------------------------------------------------------ default layouts

@pytest.mark.parametrize("gather_layout, store_layout", [
    ("BHTD", StoreLayout.HND), ("BTHD", StoreLayout.NHD)])
def test_default_store_layout_matches_the_gather_layout(gather_layout, store_layout,
                                                        expected_kv, cache_backend):
    kw = {} if gather_layout == "BHTD" else {"gather_layout": gather_layout}
    cache = make_cache(cache_backend, **kw)          # the default gather is BHTD
    assert cache.layout is store_layout
    assert cache.gather_layout is OutputLayout(gather_layout)
    seq = cache.add_sequence([3, 1, 4, 1, 5])
    cache.extend(seq, [3, 1, 4, 1, 5])
    plan = cache.plan([seq])
    write_step(cache, plan, [seq], expected_kv)
    k, v = cache.gather(1, plan)      # in the cache's gather layout
    k, v = cache.backend.to_numpy(k), cache.backend.to_numpy(v)
    ek, ev = expected_kv(seq.tokens, None, 1, 2, 3, np.float32)   # [T, H, D]
    if gather_layout == "BHTD":
        ek, ev = ek.transpose(1, 0, 2), ev.transpose(1, 0, 2)
    assert np.array_equal(k[0], ek) and np.array_equal(v[0], ev)
    other = "BTHD" if gather_layout == "BHTD" else "BHTD"
    k2, _ = cache.gather(1, plan, layout=other)    # a named layout still wins
    assert k2.shape == (k.shape[0], k.shape[2], k.shape[1], k.shape[3])


def test_an_explicit_store_layout_keeps_the_bhtd_gather_default(cache_backend):
    cache = make_cache(cache_backend, layout="NHD")
    assert cache.layout is StoreLayout.NHD and cache.gather_layout is OutputLayout.BHTD
    seq = cache.add_sequence([1, 2, 3])
    cache.extend(seq, [1, 2, 3])
    k, _ = cache.gather(0, cache.plan([seq]))
    assert k.shape == (1, 2, 3, 3)    # [B, H, T, D]


def test_a_bad_gather_layout_is_refused(cache_backend):
    with pytest.raises(LayoutError, match="gather_layout"):
        make_cache(cache_backend, gather_layout="TBHD")
