"""Sequence: one request's tokens, the pages that hold their K/V, and its
progress through plans and writes.

A sequence's token positions split into ranges that only grow::

    0 ... num_written ... num_computed ........ num_tokens
    | written in every layer | planned, being written | reserved, not planned |

Its pages cover ``num_tokens`` positions, ``page_size`` a page. The leading
full, written pages are offered to the prefix index in order; each offered
page keeps a link (its chained digest and index identity) so that the next
page can name its parent.

A :class:`Sequence` changes only through its own transitions, called by the
cache that made it (:class:`pagedkv_np.cache.PagedKVCache`), which holds the
pool and the store those transitions refer to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .errors import DTypeError, SequenceError

__all__ = ["Sequence", "check_sequence", "step_inputs", "mark_all_planned", "one_more_token"]

_TOKEN_BYTES = 8   # int64 little-endian token ids


class Sequence:
    """One request's tokens and the pages that hold their K/V.

    Created by :meth:`PagedKVCache.add_sequence` or :meth:`PagedKVCache.fork`;
    read-only for callers. Token positions split into three ranges::

        0 ...... num_computed_tokens ...... num_tokens
        | planned (written or being written) | reserved, not yet planned |

    ``num_cached_tokens`` is how many leading tokens came from the prefix
    index when the sequence was added.

    Parameters
    ----------
    seq_id : int
    owner : int
        Id of the cache that made the sequence.
    salt : str, bytes, int or None
    tokens : bytes
        The prefix served from the cache, int64 little-endian token ids; it
        counts as cached, planned and written.
    pages : list of int
        Pages holding those tokens.
    digests, identities : lists
        Links of the leading pages found in the prefix index (one each).
    """

    __slots__ = ("seq_id", "salt", "_owner", "_tokens", "_page_ids", "_num_computed",
                 "_num_written", "_version", "_num_cached", "_digests", "_identities",
                 "_released", "_may_share_tail", "_page_arr", "_num_synced")

    def __init__(self, seq_id: int, owner: int, salt: Any, tokens: bytes = b"",
                 pages: Iterable[int] = (), digests: Iterable[bytes] = (),
                 identities: Iterable[tuple | None] = ()) -> None:
        self.seq_id = seq_id
        self.salt = salt
        self._owner = owner
        self._tokens = bytearray(tokens)
        self._page_ids: list[int] = list(pages)
        self._num_cached = self._num_computed = self._num_written = len(tokens) // _TOKEN_BYTES
        self._version = 0                   # bumped when pages are reserved or released
        self._digests: list[bytes] = list(digests)           # chained hashes of full pages
        self._identities: list[tuple | None] = list(identities)   # their index identities
        self._released = False
        # Set by a fork: the partly filled last page may then be held by the
        # other side too. Only then is the pool asked for its reference count,
        # which keeps that lookup off every decode step.
        self._may_share_tail = False
        # An int32 copy of the page list, grown in place, entries from
        # _num_synced on out of date. A plan of long sequences fills its page
        # table from these arrays: converting the whole list every step would
        # cost O(pages) Python work per sequence per step.
        self._page_arr = np.empty(0, dtype=np.int32)
        self._num_synced = 0

    # ------------------------------------------------------------ reading
    @property
    def owner(self) -> int:
        """Id of the cache that made the sequence."""
        return self._owner

    @property
    def num_tokens(self) -> int:
        """Tokens with a reserved slot."""
        return len(self._tokens) // _TOKEN_BYTES

    @property
    def num_computed_tokens(self) -> int:
        """Tokens covered by a plan (their K/V is written or being written)."""
        return self._num_computed

    @property
    def num_written_tokens(self) -> int:
        """Leading tokens whose K/V is written in every layer."""
        return self._num_written

    @property
    def num_cached_tokens(self) -> int:
        """Leading prompt tokens served by the prefix index."""
        return self._num_cached

    @property
    def num_indexed_pages(self) -> int:
        """Leading pages offered to the prefix index (each has a link)."""
        return len(self._digests)

    @property
    def version(self) -> int:
        """Bumped whenever the sequence reserves or releases pages."""
        return self._version

    @property
    def num_pages(self) -> int:
        return len(self._page_ids)

    @property
    def page_ids(self) -> tuple[int, ...]:
        return tuple(self._page_ids)

    @property
    def tokens(self) -> np.ndarray:
        """int64 [num_tokens]: a copy of the token ids."""
        return np.frombuffer(bytes(self._tokens), dtype="<i8").astype(np.int64)

    @property
    def is_released(self) -> bool:
        return self._released

    def page(self, i: int) -> int:
        """Id of the sequence's ``i``-th page."""
        return self._page_ids[i]

    def link(self, i: int) -> tuple[bytes, tuple | None]:
        """(digest, index identity) of the ``i``-th indexed page; the identity
        is None when another page's content took that hash."""
        return self._digests[i], self._identities[i]

    def links(self) -> tuple[list[bytes], list[tuple | None]]:
        """Copies of the digests and identities of the indexed pages."""
        return list(self._digests), list(self._identities)

    def token_bytes(self, start: int, stop: int) -> bytes:
        """Tokens ``[start, stop)`` as int64 little-endian bytes."""
        return bytes(self._tokens[_TOKEN_BYTES * start:_TOKEN_BYTES * stop])

    def page_list(self) -> list[int]:
        """The page ids, for building a plan (the sequence's own list: do not change it)."""
        return self._page_ids

    def page_array(self) -> np.ndarray:
        """int32 [num pages]: the page ids as an array (amortised O(new pages)),
        read-only for the caller."""
        n = len(self._page_ids)
        if self._num_synced < n:
            if self._page_arr.shape[0] < n:
                grown = np.empty(max(16, 2 * n), dtype=np.int32)
                grown[:self._num_synced] = self._page_arr[:self._num_synced]
                self._page_arr = grown
            self._page_arr[self._num_synced:n] = self._page_ids[self._num_synced:]
            self._num_synced = n
        return self._page_arr[:n]

    def pages_needed(self, n: int, page_size: int) -> int:
        """New pages that ``n`` more tokens need, not counting a copy of a
        shared last page (see :meth:`shared_tail`)."""
        if n <= 0:
            return 0
        return -(-(len(self._tokens) // _TOKEN_BYTES + n) // page_size) - len(self._page_ids)

    def shared_tail(self, page_size: int) -> int | None:
        """The partly filled last page when a fork may share it, else None;
        whoever holds the page's reference count decides whether it is shared."""
        if not self._may_share_tail or (len(self._tokens) // _TOKEN_BYTES) % page_size == 0:
            return None
        return self._page_ids[-1]

    # -------------------------------------------------------- transitions
    def append(self, raw: bytes, pages: list[int], replace_last: int | None = None) -> None:
        """Reserve slots for tokens (``raw``: their int64 little-endian bytes).

        ``pages`` are appended to the page list; ``replace_last`` first takes
        the place of the last page (a private copy of a shared one).
        """
        if replace_last is not None:
            self._page_ids[-1] = replace_last
            self._num_synced = min(self._num_synced, len(self._page_ids) - 1)
        self._page_ids.extend(pages)
        self._tokens += raw
        if raw:
            # the last page is now private: a copy, a new page, or held alone
            self._may_share_tail = False
        self._version += 1

    def fork(self, ids: Iterator[int]) -> Sequence:
        """A new sequence with the same tokens and pages (the caller takes
        the page references); its id is drawn from ``ids`` once the fork is
        allowed, so a refused fork uses up none.

        Raises
        ------
        SequenceError
            The sequence has reserved, unplanned tokens, or planned tokens
            not yet written in every layer.
        """
        if self._num_computed != self.num_tokens:
            raise SequenceError(
                "Invalid seq: it has reserved tokens not yet planned; plan them before fork")
        if self._num_written != self._num_computed:
            raise SequenceError(
                f"Invalid seq: {self._num_computed - self._num_written} of its planned "
                "tokens are not written in every layer; write (or discard) the plan "
                "before fork")
        child = Sequence(next(ids), self._owner, self.salt, bytes(self._tokens), self._page_ids,
                         self._digests, self._identities)
        child._num_cached = self._num_cached
        self._may_share_tail = child._may_share_tail = True
        return child

    def release(self) -> list[int]:
        """Mark the sequence released; returns the pages it held, in order."""
        pages, self._page_ids = self._page_ids, []
        self._released = True
        self._version += 1
        return pages

    def mark_planned(self) -> None:
        """Every reserved token is now covered by a plan."""
        self._num_computed = self.num_tokens

    def unplan(self, context_len: int, seq_len: int) -> None:
        """A plan covering ``[context_len, seq_len)`` was discarded: those
        tokens return to reserved, unless the sequence was planned since."""
        if not self._released and self._num_computed == seq_len:
            self._num_computed = context_len

    def mark_written(self, context_len: int, seq_len: int) -> bool:
        """Every layer of a plan covering ``[context_len, seq_len)`` is
        written; False (nothing changes) when the sequence is released or an
        earlier range was never written."""
        if self._released or self._num_written < context_len:
            return False
        self._num_written = max(self._num_written, seq_len)
        return True

    def unindexed_pages(self, page_size: int) -> range:
        """Positions of the full, written pages not yet offered to the index."""
        return range(len(self._digests), self._num_written // page_size)

    def add_link(self, digest: bytes, identity: tuple | None) -> None:
        """The next page was offered to the index under ``digest``."""
        self._digests.append(digest)
        self._identities.append(identity)

    def check_invariants(self, page_size: int) -> None:
        """Raise AssertionError if the counters and pages of a live sequence disagree."""
        assert not self._released
        assert len(self._page_ids) == -(-self.num_tokens // page_size)
        assert self._num_cached <= self._num_computed <= self.num_tokens
        assert self._num_written <= self._num_computed
        assert len(self._digests) == len(self._identities)
        assert len(self._digests) <= self._num_written // page_size

    def __repr__(self) -> str:
        state = "released" if self._released else f"pages={len(self._page_ids)}"
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"cached={self._num_cached}, {state})")


def check_sequence(seq: Any, owner: int, name: str = "seq") -> None:
    """Refuse anything but a live sequence of the cache ``owner``."""
    if not isinstance(seq, Sequence):
        raise DTypeError(f"Invalid {name}: expected a Sequence, got {type(seq).__name__}")
    if seq.owner != owner:
        raise SequenceError(f"Invalid {name}: sequence {seq.seq_id} belongs to another cache")
    if seq.is_released:
        raise SequenceError(f"Invalid {name}: sequence {seq.seq_id} was released")


# A decode step reserves, plans and marks its whole batch: the functions below
# check and read (or update) its sequences in one pass each, without a call
# per sequence and field (together a few us a step at batch 32). Each refuses
# anything but a list or tuple of distinct live sequences of ``owner``.

def step_inputs(seqs: Any, owner: int
                ) -> tuple[list[list[int]], list[int], list[int], tuple[int, ...], int]:
    """For a plan over ``seqs``: each one's page
    list (its own: not to be changed), token count, planned token count and
    version, and the most pages any of them holds."""
    if isinstance(seqs, Sequence) or not isinstance(seqs, (list, tuple)):
        raise DTypeError("Invalid seqs: expected a list of sequences")
    seen = set()
    pages, lens, ctx, versions = [], [], [], []
    max_pages = 0
    for s in seqs:
        if type(s) is not Sequence or s._owner != owner or s._released:
            check_sequence(s, owner, "seqs")   # raises, or passes a subclass
        if s.seq_id in seen:
            raise SequenceError(f"Invalid seqs: sequence {s.seq_id} is listed twice")
        seen.add(s.seq_id)
        pages.append(s._page_ids)
        max_pages = max(max_pages, len(s._page_ids))
        lens.append(len(s._tokens) // _TOKEN_BYTES)
        ctx.append(s._num_computed)
        versions.append(s._version)
    return pages, lens, ctx, tuple(versions), max_pages


def mark_all_planned(seqs: Any, lens: list[int]) -> None:
    """:meth:`Sequence.mark_planned` of each of ``seqs``, ``lens`` being their token counts."""
    for s, n in zip(seqs, lens):
        s._num_computed = n


def one_more_token(seqs: Any, owner: int, page_size: int) -> tuple[int, list[int]]:
    """What a token more for each of ``seqs`` takes:
    the new pages, and the partly filled last pages that a fork may share
    (each one more page if its reference count says it is shared)."""
    if isinstance(seqs, Sequence) or not isinstance(seqs, (list, tuple)):
        raise DTypeError("Invalid seqs: expected a list of sequences")
    seen = set()
    total = 0
    tails = []
    for s in seqs:
        if type(s) is not Sequence or s._owner != owner or s._released:
            check_sequence(s, owner, "seqs")   # raises, or passes a subclass
        if s.seq_id in seen:
            raise SequenceError(f"Invalid seqs: sequence {s.seq_id} is listed twice")
        seen.add(s.seq_id)
        n = len(s._tokens) // _TOKEN_BYTES
        total += -(-(n + 1) // page_size) - len(s._page_ids)
        if s._may_share_tail and n % page_size:
            tails.append(s._page_ids[-1])
    return total, tails
