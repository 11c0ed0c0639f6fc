"""Where the page chains of recently recorded sequences end.

The seed API records a sequence's pages one call at a time
(:meth:`pagedkv_np.PagedCache.record_page`), each call naming the page, the
whole token list and the page's logical index. A page's parent in the prefix
index is the page holding the logical page before it, found by walking the
chained hashes from the root: a walk per call makes recording a sequence
quadratic in its length. :class:`ChainEnds` keeps the ends of recent chains,
so that recording the next page hashes that page only::

    record_page(p0, t, 0)   parent: the root
                            keeps (1, t's page 0) -> [p0] and a copy of t
    record_page(p1, t, 1)   parent: [p0], found under (1, t's page 0) once
                            t's first page equals the copy's
                            keeps (2, t's page 1) -> [p0, p1]
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from .errors import PagedKVError
from .prefix import PrefixIndex
from .tokens import as_tokens

__all__ = ["Chain", "ChainEnds"]


class Chain:
    """The end of a recorded chain of pages: what the page after it records
    as its parent, and the tokens that lead to it.

    ``tokens`` is a copy of the whole sequence a caller passed (a list, the
    caller's own tuple, or an int64 array), of which this chain is the first
    ``num_pages`` pages; ``positions`` (page id -> the lowest logical page
    index it held) is shared by the chains over the same copy.
    """

    __slots__ = ("key", "num_pages", "digest", "identity", "tokens", "positions")

    def __init__(self, key: tuple[int, bytes] | None, num_pages: int, digest: bytes,
                 identity: tuple, tokens: Any, positions: dict[int, int]) -> None:
        self.key = key
        self.num_pages = num_pages
        self.digest = digest
        self.identity = identity
        self.tokens = tokens
        self.positions = positions

    def matches(self, tokens: Any, num_tokens: int) -> bool:
        """Whether ``tokens[:num_tokens]`` equals this chain's tokens (False
        for a value that does not compare as an int).

        One C-level pass: a sequence equal to the copy as a whole is compared
        without slicing, which for a caller's unchanged list compares
        pointers only.
        """
        have = self.tokens
        if isinstance(tokens, np.ndarray) != isinstance(have, np.ndarray):
            return False
        if isinstance(have, np.ndarray):
            # as int64: an out-of-range uint64 id wraps and differs
            return bool(np.array_equal(tokens[:num_tokens].astype(np.int64, copy=False),
                                       have[:num_tokens]))
        try:
            if type(tokens) is type(have) and len(tokens) == len(have) and tokens == have:
                return True
            head = tokens[:num_tokens]
            return bool((head if type(head) is type(have) else type(have)(head))
                        == have[:num_tokens])
        except (TypeError, ValueError):  # e.g. an array among the ids
            return False


def _copy_tokens(tokens: Any) -> Any:
    """What a chain keeps of a caller's sequence: never the caller's list or
    array itself, which it may change or reuse."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64)
    return tokens if type(tokens) is tuple else list(tokens)


class ChainEnds:
    """Where the chains of recently recorded sequences end, so that recording
    the next page of one hashes that page instead of walking the index from
    the root.

    A chain is found by its length and the tokens of its last page, and used
    only if the caller's earlier tokens equal its own: a caller may change or
    reuse its list between calls, and a parent is never trusted unverified.
    That check is one C-level comparison, not a hash per page. A page that
    leaves the index (evicted, or recorded again under another prefix) drops
    the chains through it, so none is extended where a walk would stop.
    """

    MAX_CHAINS = 16
    """Sequences recorded in turn that each keep their chain."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._by_end: OrderedDict[tuple[int, bytes], Chain] = OrderedDict()

    def parent(self, tokens: Any, logical_page_idx: int) -> Chain | None:
        """The chain of the pages before ``logical_page_idx`` of ``tokens``,
        or None when they are not all indexed. Raises :class:`DTypeError`,
        changing nothing, for invalid ids among the tokens it reads."""
        if logical_page_idx == 0:
            return Chain(None, 0, *self._index.root(), None, {})
        size = self._index.page_size
        num_tokens = logical_page_idx * size
        last = as_tokens(tokens[num_tokens - size:num_tokens], "token_ids")
        key = (logical_page_idx, last.tobytes())
        chain = self._by_end.get(key)
        if chain is not None and chain.matches(tokens, num_tokens):
            self._by_end.move_to_end(key)
            return chain
        head = as_tokens(tokens[:num_tokens], "token_ids")
        pages, digests = self._index.lookup(head.tobytes(), num_tokens, logical_page_idx,
                                            count=False)
        if len(pages) < logical_page_idx:
            return None
        positions: dict[int, int] = {}
        for i, page_id in enumerate(pages):
            positions.setdefault(page_id, i)
        chain = Chain(key, logical_page_idx, digests[-1], self._index.identity(pages[-1]),
                       _copy_tokens(tokens), positions)
        self._put(chain)
        return chain

    def extend(self, chain: Chain, tokens: Any, page: bytes, digest: bytes,
               identity: tuple) -> None:
        """Keep the chain of ``chain`` and its next page of ``tokens`` (int64
        bytes ``page``), indexed with this digest and identity."""
        if chain.key is not None and self._by_end.get(chain.key) is not chain:
            return  # a page of it left the index meanwhile
        num_pages = chain.num_pages
        key = (num_pages + 1, page)
        kept, copy, positions = self._by_end.get(key), chain.tokens, chain.positions
        if kept is not None and kept.tokens is copy and kept.identity == identity:
            self._by_end.move_to_end(key)  # the same page recorded again
            return
        if not self._holds(copy, num_pages, page):
            # the caller's sequence goes on differently from (or past) the copy
            copy = _copy_tokens(tokens)
            positions = {p: i for p, i in positions.items() if i < num_pages}
        positions[identity[1]] = min(positions.get(identity[1], num_pages), num_pages)
        self._put(Chain(key, num_pages + 1, digest, identity, copy, positions))

    def _holds(self, copy: Any, num_pages: int, page: bytes) -> bool:
        """Whether page ``num_pages`` of ``copy`` holds these int64 ids."""
        size = self._index.page_size
        if copy is None or len(copy) < (num_pages + 1) * size:
            return False
        try:
            ids = as_tokens(copy[num_pages * size:(num_pages + 1) * size], "tokens")
        except PagedKVError:  # past the ids the caller's call checked
            return False
        return ids.tobytes() == page

    def forget(self, page_id: int) -> None:
        """Drop the chains through ``page_id``."""
        for key in [key for key, chain in self._by_end.items()
                    if chain.positions.get(page_id, chain.num_pages) < chain.num_pages]:
            del self._by_end[key]

    def _put(self, chain: Chain) -> None:
        assert chain.key is not None, "the root chain is not kept"
        self._by_end[chain.key] = chain
        self._by_end.move_to_end(chain.key)
        if len(self._by_end) > self.MAX_CHAINS:
            self._by_end.popitem(last=False)
