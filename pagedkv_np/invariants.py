"""The consistency check of a cache's parts: pool, prefix index and sequences.

O(pages + tokens); for tests and debugging, never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable

from .pool import PagePool
from .prefix import PrefixIndex
from .sequence import Sequence

__all__ = ["check_cache_invariants"]


def check_cache_invariants(pool: PagePool, index: PrefixIndex, seqs: Iterable[Sequence],
                           page_size: int) -> None:
    """Raise AssertionError if ``pool``, ``index`` and the live ``seqs`` disagree:
    each part's own invariants, no page held by more sequences than its
    reference count, and every indexed page cached in the pool."""
    pool.check_invariants()
    index.check_invariants()
    refs = [0] * pool.num_pages
    for seq in seqs:
        seq.check_invariants(page_size)
        for page_id in seq.page_list():
            refs[page_id] += 1
    for page_id, held in enumerate(refs):
        assert held <= pool.ref_count(page_id), (
            f"page {page_id}: sequences hold {held} refs, pool counts {pool.ref_count(page_id)}")
        if page_id in index:
            assert pool.is_cached(page_id), f"page {page_id} indexed but not cached"
