"""Prefix reuse for sequences: what a new sequence takes from the prefix
index (and the storage tiers), and what a sequence's written pages give back.

A sequence's leading full pages form a chain in the index, each page linked
to its parent's content::

    root(salt) <- page 0 <- page 1 <- ... <- page n-1   | partly filled tail

A new prompt takes the longest chain of its pages found in RAM, then in the
tiers; with partial reuse, also a copy of the cached page that shares the most
leading tokens with what follows. A sequence offers each page once it is full
and written in every layer, and its partly filled tail when it is released.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .pool import PagePool
from .prefix import PrefixIndex
from .sequence import Sequence
from .store import KVStore

__all__ = ["PrefixReuse", "Prefix"]


class Prefix:
    """What a prompt takes from the cache: ``pages`` hold its first
    ``num_tokens`` tokens, the leading full ones linked by ``digests`` and
    ``identities``; ``copied`` tells that a page was copied for it."""

    __slots__ = ("pages", "digests", "identities", "num_tokens", "copied")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.digests: list[bytes] = []
        self.identities: list[Any] = []
        self.num_tokens = 0
        self.copied = False


class PrefixReuse:
    """Moves pages between sequences and the prefix index.

    Parameters
    ----------
    pool : PagePool
    index : PrefixIndex
    store : KVStore
        Where a partly shared page is copied.
    tiers : TierManager or None
        Storage below RAM, asked for the pages of a chain the index lacks.
    """

    def __init__(self, pool: PagePool, index: PrefixIndex, store: KVStore, tiers: Any) -> None:
        self.pool, self.index, self.store, self.tiers = pool, index, store, tiers

    def take(self, tokens: np.ndarray, salt: Any, partial: bool) -> Prefix:
        """The cached prefix of the prompt ``tokens`` (int64 [n], n >= 1), its
        pages referenced for the caller; at most ``n - 1`` tokens of it, so
        the last prompt token is always computed."""
        found = Prefix()
        page_size = self.store.page_size
        max_pages = (len(tokens) - 1) // page_size
        pages, digests = self.index.lookup(tokens.tobytes(), len(tokens), max_pages, salt)
        self.pool.inc_ref(pages)
        found.pages, found.digests = list(pages), list(digests)
        found.identities = [self.index.identity(p) for p in pages]
        if self.tiers is not None and len(pages) < max_pages:
            loaded = self.tiers.load(self.pool, salt, found.digests, found.identities,
                                     tokens.tobytes(), max_pages)
            found.pages += loaded[0]
            found.digests += loaded[1]
            found.identities += loaded[2]
        found.num_tokens = len(found.pages) * page_size
        if partial:
            parent = found.identities[-1] if found.identities else self.index.root(salt)[1]
            shared, page = self._copy_best_child(parent, tokens, found.num_tokens)
            if shared:
                found.pages.append(page)
                found.num_tokens += shared
                found.copied = True
        return found

    def _copy_best_child(self, parent: Any, tokens: np.ndarray, num_cached: int
                         ) -> tuple[int, int]:
        """Copy the cached child of ``parent`` sharing the most leading tokens
        with the rest of the prompt into a new page; return (tokens shared,
        the new page), (0, -1) when there is none."""
        limit = min(self.store.page_size, len(tokens) - 1 - num_cached)
        if limit <= 0:
            return 0, -1
        # identities fresh from the lookup, never None (a collision)
        match = self.index.best_child(parent, tokens[num_cached:num_cached + limit].tobytes())
        if match is None:
            return 0, -1
        src, shared = match
        self.pool.inc_ref([src])        # keeps it from being evicted by the allocation
        try:
            if not self.pool.can_allocate(1):
                return 0, -1
            dst = self.pool.allocate(1)[0]
            self.store.copy_pages(np.array([src], np.int32), np.array([dst], np.int32))
        finally:
            self.pool.free([src])
        self.index.count_hit(shared)
        return shared, dst

    def offer_full_pages(self, seq: Sequence) -> None:
        """Offer the sequence's newly full, written pages to the index, in order.

        Each page records the identity of its parent's content; once a page's
        hash is taken by other content (a collision), later pages of this
        sequence cannot be reached by a lookup and are not indexed.
        """
        page_size, index = self.store.page_size, self.index
        parent: tuple | None
        for i in seq.unindexed_pages(page_size):
            if i == 0:
                parent_digest, parent = index.root(seq.salt)
            else:
                parent_digest, parent = seq.link(i - 1)
                if parent is None:
                    return
            chunk = seq.token_bytes(i * page_size, (i + 1) * page_size)
            page_id = seq.page(i)
            digest, identity, indexed = index.insert(page_id, parent_digest, parent, chunk)
            if indexed:
                self.pool.mark_cached(page_id)
                if self.tiers is not None:
                    self.tiers.offer(page_id, digest, parent_digest, chunk, seq.salt)
            seq.add_link(digest, identity)

    def offer_partial_tail(self, seq: Sequence) -> None:
        """List a sequence's partly filled, written last page (before it is released)."""
        page_size = self.store.page_size
        num_full, tail = divmod(seq.num_written_tokens, page_size)
        if tail == 0 or seq.num_indexed_pages != num_full or seq.num_pages <= num_full:
            return
        parent = seq.link(num_full - 1)[1] if num_full else self.index.root(seq.salt)[1]
        page_id = seq.page(num_full)
        if parent is None or self.pool.ref_count(page_id) != 1:  # broken chain, or shared
            return
        start = num_full * page_size
        if self.index.register_partial(page_id, parent, seq.token_bytes(start, start + tail)):
            self.pool.mark_cached(page_id)
