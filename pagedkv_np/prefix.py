"""The prefix index: which page already holds the K/V of a given prefix.

Pages are identified by chained, keyed hashes over full pages only::

    tokens:  | page 0      | page 1      | page 2      | tail (partial, never indexed)
    hash:      h0 = H(root, t0)  h1 = H(h0, t1)  h2 = H(h1, t2)
    root = H("root", salt)

``H`` is BLAKE2b keyed with a per-index secret (random unless given, so that
separate processes can agree on it), so prompts cannot be crafted to collide
without the secret. Chaining makes a page's hash depend on everything before
it: equal tokens after different prefixes, or at different positions, hash
differently. A ``salt`` enters the root, so requests with different salts
never share a page.

A prompt that diverges inside a page can still reuse that page's leading
tokens: the index also lists, for each parent, its children (full pages and
the partly filled last pages of released sequences), and
:meth:`PrefixIndex.best_child` finds the child that shares the longest run
of tokens with the prompt. The cache copies that page and keeps only the
shared tokens, so a shared prefix shorter than a page still hits.

A hash is never trusted on its own. Each indexed page stores its tokens and
the identity of its parent page ``(page_id, generation)``; a lookup accepts a
page only if its tokens equal the prompt's and its parent is the page accepted
one step earlier (or the same salt, for the first page). The generation of a
page id changes whenever the page leaves the index, so a child whose parent
was evicted and reused can never be served. Even a hash that maps every page
to the same value returns only exact matches; the cache then merely shares
less.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from .errors import ConfigError, DTypeError
from .checks import check_int, check_nonneg_int, check_positive_int, is_int

__all__ = ["PrefixIndex", "blake2b_page_hash", "encode_salt"]

MAX_CHILDREN = 32
"""Children listed per parent for partial matches (bounds the search)."""

HashFn = Callable[[bytes, bytes, bytes], bytes]

# Ints up to this many bits have at most 617 decimal digits: below the lowest
# limit Python allows on int -> str conversion (640), so their encoding does
# not depend on the interpreter's setting.
_MAX_DECIMAL_SALT_BITS = 2048


def blake2b_page_hash(secret: bytes, parent: bytes, tokens: bytes) -> bytes:
    """Keyed BLAKE2b of a parent hash and a page's int64 token bytes (16 bytes)."""
    h = hashlib.blake2b(key=secret, digest_size=16)
    h.update(parent)
    h.update(tokens)
    return h.digest()


def encode_salt(salt: str | bytes | int | None) -> bytes:
    """The bytes a salt contributes to the root hash (``None`` -> empty).

    Raises :class:`DTypeError` for a salt of another type and
    :class:`ConfigError` for a str that UTF-8 cannot encode (a lone
    surrogate).
    """
    if salt is None:
        return b""
    if isinstance(salt, bytes):
        return b"b" + salt
    if isinstance(salt, str):
        try:
            return b"s" + salt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"Invalid salt: a str salt must be encodable as UTF-8 "
                              f"({exc.reason} at index {exc.start})") from None
    if is_int(salt):
        salt = int(salt)   # a NumPy int salt is the same salt as the Python int
        if salt.bit_length() <= _MAX_DECIMAL_SALT_BITS:
            return b"i" + str(salt).encode("ascii")
        # past Python's (configurable) limit on int -> decimal str conversion
        # hex has none; its own prefix keeps the two encodings apart
        return b"x" + format(salt, "x").encode("ascii")
    raise DTypeError(f"Invalid salt: expected str, bytes, int or None, got {type(salt).__name__}")


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    tokens: bytes        # int64 little-endian token ids of the page
    parent: tuple        # ("root", salt bytes) or ("page", page_id, generation)


class PrefixIndex:
    """Maps chained page hashes to the pages that hold them.

    Invariant: ``page_id in entries`` iff ``by_hash[entries[page_id].digest]
    == page_id``; at most one page is indexed per hash.

    Parameters
    ----------
    page_size : int
        Tokens per page.
    secret : bytes, optional
        Key of the hash (up to 64 bytes); random when omitted. Give the same
        secret to processes that must agree on hashes.
    hash_fn : callable, optional
        ``hash_fn(secret, parent, tokens) -> bytes``; default
        :func:`blake2b_page_hash`. Lookups stay exact whatever it returns.
    """

    def __init__(self, page_size: int, secret: bytes | None = None,
                 hash_fn: HashFn | None = None) -> None:
        self.page_size = check_positive_int(page_size, "page_size")
        if secret is None:
            secret = os.urandom(32)
        if not isinstance(secret, (bytes, bytearray)) or not 1 <= len(secret) <= 64:
            raise ConfigError("Invalid secret: expected 1 to 64 bytes")
        self.secret = bytes(secret)
        if hash_fn is not None and not callable(hash_fn):
            raise DTypeError(f"Invalid hash_fn: expected a callable, got {type(hash_fn).__name__}")
        self._hash = hash_fn or blake2b_page_hash
        self._by_hash: dict[bytes, int] = {}
        self._entries: dict[int, _Entry] = {}
        self._generation: dict[int, int] = {}
        self._partials: dict[int, _Entry] = {}      # partly filled pages (no digest)
        self._children: dict[tuple, dict[int, None]] = {}
        self.hit_tokens = 0
        self.query_tokens = 0
        self.num_rejected = 0
        """Candidates whose hash matched but whose tokens or parent did not."""

    # --------------------------------------------------------------- hashing
    def root(self, salt: str | bytes | int | None = None) -> tuple[bytes, tuple]:
        """Root hash and parent identity for a salt."""
        salt_bytes = encode_salt(salt)
        return self._hash(self.secret, b"root", salt_bytes), ("root", salt_bytes)

    def page_digest(self, parent_digest: bytes, tokens: bytes) -> bytes:
        return self._hash(self.secret, parent_digest, tokens)

    def identity(self, page_id: int) -> tuple:
        """The parent identity a child of ``page_id`` records."""
        return ("page", page_id, self._generation.get(page_id, 0))

    # ---------------------------------------------------------------- lookup
    def lookup(self, token_bytes: bytes, num_tokens: int, max_pages: int,
               salt: str | bytes | int | None = None,
               count: bool = True) -> tuple[list[int], list[bytes]]:
        """Longest run of indexed pages that holds this prompt's prefix.

        Parameters
        ----------
        token_bytes : bytes
            The prompt as little-endian int64 token ids.
        num_tokens : int
            Prompt length (counted as queried tokens).
        max_pages : int
            Look at most this many pages (callers pass
            ``(num_tokens - 1) // page_size`` so the last token is recomputed).

        Returns
        -------
        page_ids, digests : lists
            The pages hit, in order, and their hashes.
        """
        if not isinstance(token_bytes, (bytes, bytearray, memoryview)):
            raise DTypeError(f"Invalid token_bytes: expected bytes of int64 token ids, "
                             f"got {type(token_bytes).__name__}")
        num_tokens = check_nonneg_int(num_tokens, "num_tokens")
        max_pages = check_nonneg_int(max_pages, "max_pages")
        digest, parent = self.root(salt)
        step = 8 * self.page_size
        pages: list[int] = []
        digests: list[bytes] = []
        for i in range(max_pages):
            chunk = token_bytes[i * step:(i + 1) * step]
            digest = self._hash(self.secret, digest, chunk)
            page_id = self._by_hash.get(digest)
            if page_id is None:
                break
            entry = self._entries[page_id]
            if entry.tokens != chunk or entry.parent != parent:
                self.num_rejected += 1
                break
            pages.append(page_id)
            digests.append(digest)
            parent = self.identity(page_id)
        if count:
            self.query_tokens += num_tokens
            self.hit_tokens += len(pages) * self.page_size
        return pages, digests

    # ---------------------------------------------------------- registration
    def register(self, page_id: int, digest: bytes, tokens: bytes, parent: tuple) -> bool:
        """Index ``page_id`` under ``digest``; return whether it was indexed.

        Nothing changes (and False is returned) when another page already
        holds this hash: the first copy of a prefix stays canonical.
        """
        page_id = check_int(page_id, "page_id")
        if len(tokens) != 8 * self.page_size:
            raise ConfigError("Invalid tokens: only full pages can be indexed")
        current = self._by_hash.get(digest)
        if current is not None:
            return current == page_id
        old = self._entries.get(page_id)
        if old is not None:  # a page moves to a new prefix: drop the old one
            self.remove(page_id)
        self._by_hash[digest] = page_id
        self._entries[page_id] = _Entry(digest, tokens, parent)
        self._add_child(parent, page_id)
        return True

    def register_partial(self, page_id: int, parent: tuple, tokens: bytes) -> bool:
        """List a partly filled page (``0 < tokens < page_size``) as a child of
        ``parent`` for partial matches; return whether it was listed.

        Nothing changes when the page is already indexed, or when a listed
        child of ``parent`` already starts with these tokens.
        """
        if not 0 < len(tokens) < 8 * self.page_size or len(tokens) % 8:
            raise ConfigError("Invalid tokens: a partial page holds 1 to page_size - 1 tokens")
        if page_id in self._entries or page_id in self._partials:
            return False
        for child in self._children.get(parent, ()):
            if self._child_tokens(child).startswith(tokens):
                return False
        if not self._add_child(parent, page_id):
            return False
        self._partials[page_id] = _Entry(b"", tokens, parent)
        return True

    def best_child(self, parent: tuple, tokens: bytes) -> tuple[int, int] | None:
        """The child of ``parent`` sharing the longest leading run with
        ``tokens`` (int64 bytes), as ``(page_id, num_shared_tokens)``; None
        when no child shares a token."""
        children = self._children.get(parent)
        if not children or not tokens:
            return None
        want = np.frombuffer(tokens, dtype="<i8")
        best_page, best_len = -1, 0
        for child in children:
            have = np.frombuffer(self._child_tokens(child), dtype="<i8")
            n = min(have.shape[0], want.shape[0])
            differ = np.flatnonzero(have[:n] != want[:n])
            shared = int(differ[0]) if differ.size else n
            if shared > best_len:
                best_page, best_len = child, shared
        return (best_page, best_len) if best_len else None

    def count_hit(self, num_tokens: int) -> None:
        """Add tokens served by a partial match to the hit counter."""
        self.hit_tokens += num_tokens

    def _child_tokens(self, page_id: int) -> bytes:
        entry = self._entries.get(page_id) or self._partials[page_id]
        return entry.tokens

    def _add_child(self, parent: tuple, page_id: int) -> bool:
        children = self._children.setdefault(parent, {})
        if len(children) >= MAX_CHILDREN:
            return False
        children[page_id] = None
        return True

    def insert(self, page_id: int, parent_digest: bytes, parent: tuple,
               tokens: bytes) -> tuple[bytes, tuple | None, bool]:
        """Offer ``page_id`` as the page after ``parent`` holding ``tokens``.

        Returns
        -------
        digest : bytes
            The page's chained hash.
        identity : tuple or None
            The identity that children of this content record: this page's,
            or that of an indexed page holding the same tokens after the same
            parent. ``None`` when another content holds the hash (a
            collision): children of this page cannot be indexed.
        indexed : bool
            Whether ``page_id`` itself is now indexed.
        """
        digest = self._hash(self.secret, parent_digest, tokens)
        current = self._by_hash.get(digest)
        if current is None:
            self.register(page_id, digest, tokens, parent)
            return digest, self.identity(page_id), True
        if current == page_id:
            return digest, self.identity(page_id), True
        entry = self._entries[current]
        if entry.tokens == tokens and entry.parent == parent:
            return digest, self.identity(current), False
        self.num_rejected += 1
        return digest, None, False

    def canonical(self, digest: bytes) -> int | None:
        """The page indexed under ``digest``, if any."""
        return self._by_hash.get(digest)

    def remove(self, page_id: int) -> None:
        """Forget ``page_id`` (it was evicted or is being reused)."""
        entry = self._entries.pop(page_id, None)
        if entry is not None:
            del self._by_hash[entry.digest]
        else:
            entry = self._partials.pop(page_id, None)
            if entry is None:
                return
        children = self._children.get(entry.parent)
        if children is not None:
            children.pop(page_id, None)
            if not children:
                del self._children[entry.parent]
        self._generation[page_id] = self._generation.get(page_id, 0) + 1

    def __contains__(self, page_id: int) -> bool:
        return page_id in self._entries or page_id in self._partials

    def __len__(self) -> int:
        return len(self._entries)

    def entry_tokens(self, page_id: int) -> bytes | None:
        entry = self._entries.get(page_id)
        return None if entry is None else entry.tokens

    def check_invariants(self) -> None:
        """Raise AssertionError if the two maps disagree."""
        assert len(self._by_hash) == len(self._entries)
        for page_id, entry in self._entries.items():
            assert self._by_hash.get(entry.digest) == page_id
        assert not set(self._entries) & set(self._partials)
        listed = set()
        for parent, children in self._children.items():
            assert children and len(children) <= MAX_CHILDREN
            for child in children:
                child_entry = self._entries.get(child) or self._partials.get(child)
                assert child_entry is not None and child_entry.parent == parent
                listed.add(child)
        assert set(self._partials) <= listed
