"""Sequence: its transitions, and nothing it holds that its tokens or pages
would not give."""

import numpy as np
import pytest

from pagedkv_np import PagedKVCache, Sequence
from pagedkv_np.errors import SequenceError


def raw(*tokens):
    return np.array(tokens, dtype="<i8").tobytes()


def test_prefix_counts_as_cached_planned_and_written():
    seq = Sequence(3, 1, "t", raw(5, 6, 7, 8), [9], [b"d"], [("i",)])
    assert (seq.seq_id, seq.owner, seq.salt) == (3, 1, "t")
    assert seq.num_tokens == seq.num_cached_tokens == seq.num_computed_tokens == 4
    assert seq.num_written_tokens == 4 and seq.num_indexed_pages == 1
    assert seq.tokens.tolist() == [5, 6, 7, 8] and seq.page_ids == (9,)
    assert seq.link(0) == (b"d", ("i",)) and seq.version == 0


def test_append_grows_tokens_and_pages_and_bumps_the_version():
    seq = Sequence(0, 1, None)
    assert seq.pages_needed(0, 4) == 0 and seq.pages_needed(1, 4) == 1
    assert seq.pages_needed(9, 4) == 3
    seq.append(raw(1, 2, 3, 4, 5), [7, 2])
    assert seq.num_tokens == 5 and seq.tokens.tolist() == [1, 2, 3, 4, 5]
    assert seq.page_ids == (7, 2) and seq.page_array().tolist() == [7, 2]
    assert seq.version == 1
    # 3 more fit the second page; a fourth needs a third page
    assert seq.pages_needed(3, 4) == 0 and seq.pages_needed(4, 4) == 1
    assert seq.num_computed_tokens == 0     # reserved, not planned
    seq.mark_planned()
    assert seq.num_computed_tokens == 5


def test_page_array_follows_a_replaced_last_page():
    seq = Sequence(0, 1, None)
    seq.append(raw(*range(6)), [4, 8])
    assert seq.page_array().tolist() == [4, 8]
    seq.append(raw(6), [], replace_last=11)
    assert seq.page_ids == (4, 11) and seq.page_array().tolist() == [4, 11]
    seq.append(raw(*range(40)), list(range(20, 30)))
    assert seq.page_array().tolist() == [4, 11, *range(20, 30)]


def test_fork_copies_the_state_and_flags_the_shared_tail():
    seq = Sequence(0, 1, "s", raw(1, 2, 3, 4), [5], [b"a"], [("x",)])
    seq.append(raw(9, 9), [6])
    assert seq.shared_tail(4) is None       # never forked
    ids = iter(range(1, 10))
    with pytest.raises(SequenceError, match="not yet planned"):
        seq.fork(ids)
    seq.mark_planned()
    with pytest.raises(SequenceError, match="not written in every layer"):
        seq.fork(ids)
    assert seq.mark_written(4, 6)
    child = seq.fork(ids)             # the refused forks took no id
    assert (child.seq_id, child.owner, child.salt) == (1, 1, "s")
    assert child.tokens.tolist() == seq.tokens.tolist() and child.page_ids == (5, 6)
    assert child.num_cached_tokens == 4 and child.num_written_tokens == 6
    assert child.links() == seq.links()
    # both may share the partly filled page 6, until each extends
    assert seq.shared_tail(4) == child.shared_tail(4) == 6
    seq.append(raw(1), [], replace_last=7)
    assert seq.shared_tail(4) is None and child.shared_tail(4) == 6
    child.append(raw(1), [])
    assert child.shared_tail(4) is None
    # the copies are independent
    assert seq.page_ids == (5, 7) and child.page_ids == (5, 6)


def test_release_hands_back_the_pages():
    seq = Sequence(0, 1, None)
    seq.append(raw(1, 2, 3), [4, 5])
    assert seq.release() == [4, 5]
    assert seq.is_released and seq.page_ids == () and seq.version == 2
    assert not seq.mark_written(0, 3)


def test_unplan_and_the_written_run():
    seq = Sequence(0, 1, None)
    seq.append(raw(*range(8)), [0, 1])
    seq.mark_planned()
    seq.unplan(0, 8)                        # that plan was discarded
    assert seq.num_computed_tokens == 0
    seq.mark_planned()
    seq.append(raw(8), [2])
    seq.mark_planned()
    seq.unplan(0, 8)                        # planned again since: kept
    assert seq.num_computed_tokens == 9
    assert not seq.mark_written(8, 9)       # [0, 8) never written: a hole
    assert seq.num_written_tokens == 0
    assert seq.mark_written(0, 8) and seq.num_written_tokens == 8
    assert list(seq.unindexed_pages(4)) == [0, 1]
    seq.add_link(b"a", ("a",))
    assert list(seq.unindexed_pages(4)) == [1] and seq.num_indexed_pages == 1
    assert seq.token_bytes(1, 3) == raw(1, 2)


def test_cache_answers_whether_a_batch_can_grow(cache_backend):
    cache = PagedKVCache(1, 3, 4, 1, 2, backend=cache_backend)
    a, b = cache.add_sequence([1] * 4), cache.add_sequence([2] * 3)
    cache.extend(a, [1] * 4)        # a full page: its next token needs a new one
    cache.extend(b, [2] * 3)        # room left in its page
    assert cache.can_extend_batch([a, b]) and cache.can_extend_batch([b])
    assert cache.can_extend(a, 4) and not cache.can_extend(a, 4, spare_pages=1)
    assert not cache.can_extend(a, 5)
    cache.extend(a, [1] * 4)        # the last free page, full
    assert cache.can_extend_batch([b]) and not cache.can_extend_batch([a, b])
    with pytest.raises(SequenceError, match="listed twice"):
        cache.can_extend_batch([b, b])
    cache.release(b)
    with pytest.raises(SequenceError, match="released"):
        cache.can_extend_batch([a, b])
