"""The page pool: reference counts, a free list and an LRU of evictable pages.

Every page is in exactly one of three states::

    FREE       ref_count == 0, holds nothing worth keeping   -> in the free list
    USED       ref_count >= 1                                -> in neither list
    EVICTABLE  ref_count == 0, holds a registered prefix     -> in the LRU list

Allocation takes free pages first and evicts evictable pages, least recently
used first, only when no free page is left. Every operation is O(1) per page
whatever the pool size: the free list is a stack, and the LRU is an intrusive
doubly linked list over two int lists with one sentinel, so a page can be
unlinked from the middle (when a prefix hit revives it) without a search and
without allocating.

The pool knows page ids only; whoever registers prefixes learns about
evictions through :attr:`PagePool.on_evict`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from .errors import DTypeError, OutOfPages, PageIdError, PageStateError
from .checks import check_nonneg_int, check_positive_int, is_int, shown

__all__ = ["PagePool", "FREE", "USED", "EVICTABLE"]

FREE, USED, EVICTABLE = 0, 1, 2
_STATE_NAMES = {FREE: "free", USED: "in use", EVICTABLE: "evictable"}


class PagePool:
    """Ref-counted pages with O(1) alloc, free and LRU eviction.

    Invariants (checked by :meth:`check_invariants`):

    * a page is in the free list iff its state is FREE;
    * a page is in the LRU list iff its state is EVICTABLE, i.e. it is
      cached and its ref count is 0;
    * ``num_free + num_used + num_evictable == num_pages``.

    Parameters
    ----------
    num_pages : int
        Pool size, >= 1.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = check_positive_int(num_pages, "num_pages")
        n = self.num_pages
        self._ref = [0] * n
        self._state = bytearray(n)  # FREE
        self._cached = bytearray(n)
        # Popping from the end hands out the lowest ids first.
        self._free = list(range(n - 1, -1, -1))
        # LRU: node n is the sentinel; head (next of sentinel) is the oldest.
        self._prev = [n] * (n + 1)
        self._next = [n] * (n + 1)
        self._num_evictable = 0
        self.on_evict: Callable[[int], None] | None = None
        """Called with a page id when an evictable page is taken for reuse."""

    # ---------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free) - self._num_evictable

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: free plus evictable."""
        return len(self._free) + self._num_evictable

    def ref_count(self, page_id: int) -> int:
        return self._ref[self._check_id(page_id, "page_id")]

    def state(self, page_id: int) -> int:
        """FREE, USED or EVICTABLE."""
        return self._state[self._check_id(page_id, "page_id")]

    def is_cached(self, page_id: int) -> bool:
        return bool(self._cached[self._check_id(page_id, "page_id")])

    # ------------------------------------------------------------ allocation
    def can_allocate(self, num: int) -> bool:
        return check_nonneg_int(num, "num") <= self.num_available

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` pages (ref count 1 each), all or none.

        Raises
        ------
        OutOfPages
            Fewer than ``num`` pages are free or evictable; nothing changed.
        """
        num = check_nonneg_int(num, "num")
        if num > self.num_available:
            raise OutOfPages(num, self.num_available, "allocation")
        pages = []
        free = self._free
        for _ in range(num):
            if free:
                page_id = free.pop()
            else:
                page_id = self._next[self.num_pages]
                self._lru_unlink(page_id)
                self._cached[page_id] = 0
                if self.on_evict is not None:
                    self.on_evict(page_id)
            self._state[page_id] = USED
            self._ref[page_id] = 1
            pages.append(page_id)
        return pages

    def free(self, page_ids: Iterable[int], name: str = "page_ids") -> None:
        """Drop one reference per listed page (a page may be listed twice).

        A page whose count reaches 0 becomes EVICTABLE (most recently used
        end of the LRU) if it is cached, else FREE. Pages are processed in
        the order given, so freeing a sequence tail first puts its tail pages
        ahead of its head pages in eviction order.

        Raises
        ------
        PageIdError, PageStateError
            An id is out of range, or a page would be freed more times than
            it is referenced (double free); nothing changed.
        """
        page_ids = self._check_ids(page_ids, name)
        counts = Counter(page_ids) if len(page_ids) > 1 else {p: 1 for p in page_ids}
        for page_id, times in counts.items():
            if self._ref[page_id] < times:
                raise PageStateError(
                    f"Invalid {name}: page {page_id} is {_STATE_NAMES[self._state[page_id]]} "
                    f"with ref count {self._ref[page_id]} and cannot be freed {times} time(s) "
                    "(double free?)")
        ref, cached = self._ref, self._cached
        for page_id in page_ids:
            ref[page_id] -= 1
            if ref[page_id] == 0:
                if cached[page_id]:
                    self._state[page_id] = EVICTABLE
                    self._lru_append(page_id)
                else:
                    self._state[page_id] = FREE
                    self._free.append(page_id)

    def inc_ref(self, page_ids: Iterable[int], name: str = "page_ids") -> None:
        """Add one reference per listed page; an evictable page is revived.

        Raises
        ------
        PageIdError, PageStateError
            An id is out of range or a page is FREE (its contents are not
            worth keeping); nothing changed.
        """
        page_ids = self._check_ids(page_ids, name)
        for page_id in page_ids:
            if self._state[page_id] == FREE:
                raise PageStateError(
                    f"Invalid {name}: page {page_id} is free; allocate it instead")
        for page_id in page_ids:
            if self._state[page_id] == EVICTABLE:
                self._lru_unlink(page_id)
                self._state[page_id] = USED
            self._ref[page_id] += 1

    def touch(self, page_id: int) -> None:
        """Mark an evictable page as recently used (no-op for other states)."""
        page_id = self._check_id(page_id, "page_id")
        if self._state[page_id] == EVICTABLE:
            self._lru_unlink(page_id)
            self._lru_append(page_id)

    # --------------------------------------------------------------- caching
    def mark_cached(self, page_id: int) -> None:
        """Flag a page in use as holding a registered prefix, so that it is
        kept (evictable) rather than freed when its count reaches 0."""
        page_id = self._check_id(page_id, "page_id")
        if self._state[page_id] == FREE:
            raise PageStateError(
                f"Invalid page_id: page {page_id} is free; only a page in use can be cached")
        self._cached[page_id] = 1

    def uncache(self, page_id: int) -> None:
        """Clear the cached flag; an evictable page becomes free."""
        page_id = self._check_id(page_id, "page_id")
        if not self._cached[page_id]:
            return
        self._cached[page_id] = 0
        if self._state[page_id] == EVICTABLE:
            self._lru_unlink(page_id)
            self._state[page_id] = FREE
            self._free.append(page_id)

    # ------------------------------------------------------------ LRU links
    def _lru_append(self, page_id: int) -> None:
        sentinel = self.num_pages
        last = self._prev[sentinel]
        self._next[last] = page_id
        self._prev[page_id] = last
        self._next[page_id] = sentinel
        self._prev[sentinel] = page_id
        self._num_evictable += 1

    def _lru_unlink(self, page_id: int) -> None:
        prev, nxt = self._prev[page_id], self._next[page_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._num_evictable -= 1

    def lru_order(self) -> list[int]:
        """Evictable pages, next to be evicted first (O(n); for tests)."""
        order, node = [], self._next[self.num_pages]
        while node != self.num_pages:
            order.append(node)
            node = self._next[node]
        return order

    # ------------------------------------------------------------ validation
    def _check_id(self, page_id, name: str) -> int:
        if type(page_id) is int and 0 <= page_id < self.num_pages:  # the common case, fast
            return page_id
        if not is_int(page_id):
            raise DTypeError(f"Invalid {name}: expected an integer page id, "
                             f"got {type(page_id).__name__}")
        # compared as an int: the numbers.Integral ABC declares no ordering against int
        value = int(page_id)
        if not 0 <= value < self.num_pages:
            raise PageIdError(
                f"Invalid {name}: expected 0 <= page id < {self.num_pages}, got {shown(value)}")
        return value

    def _check_ids(self, page_ids, name: str) -> list[int]:
        if isinstance(page_ids, (str, bytes)) or not hasattr(page_ids, "__iter__"):
            raise DTypeError(f"Invalid {name}: expected an iterable of page ids, "
                             f"got {type(page_ids).__name__}")
        return [self._check_id(p, name) for p in page_ids]

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's structures disagree (O(n))."""
        n = self.num_pages
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a page is twice in the free list"
        lru = self.lru_order()
        assert len(lru) == self._num_evictable, "LRU length != num_evictable"
        lru_set = set(lru)
        assert len(lru_set) == len(lru), "a page is twice in the LRU"
        for page_id in range(n):
            state, ref = self._state[page_id], self._ref[page_id]
            assert (page_id in free_set) == (state == FREE), f"page {page_id}: free list"
            assert (page_id in lru_set) == (state == EVICTABLE), f"page {page_id}: LRU"
            assert (ref > 0) == (state == USED), f"page {page_id}: ref {ref}, state {state}"
            assert ref >= 0, f"page {page_id}: negative ref count"
            if state == EVICTABLE:
                assert self._cached[page_id], f"page {page_id}: evictable but not cached"
            if state == FREE:
                assert not self._cached[page_id], f"page {page_id}: free but cached"
        for page_id in lru:
            assert self._prev[self._next[page_id]] == page_id, "LRU links broken"
        assert self.num_free + self.num_used + self.num_evictable == n

    def __repr__(self) -> str:
        return (f"PagePool(num_pages={self.num_pages}, free={self.num_free}, "
                f"used={self.num_used}, evictable={self.num_evictable})")
