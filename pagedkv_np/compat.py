"""The seed's API on NumPy arrays: ``PagedCache`` and ``CacheView``.

Method names, arguments and return values follow the seed design, with its
flaws fixed; each method's docstring says where it differs and why. New code
should prefer :class:`pagedkv_np.PagedKVCache`, which tracks sequences itself.
A ``PagedCache`` is built on one: the cache composes the store, the page pool
and the prefix index, and this API moves pages and records prefixes through
their public methods.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backends import Backend
from .cache import PagedKVCache
from .chains import ChainEnds
from .errors import (DTypeError, OutOfPages, PagedKVError, PageIdError, PageStateError,
                     ShapeError)
from .layout import OutputLayout, StoreLayout, check_array
from .checks import check_nonneg_int, is_int, shown
from .quant import resolve_quant
from .tokens import as_tokens

__all__ = ["PagedCache", "CacheView"]


def _as_page_table(page_table: Any, num_pages: int) -> np.ndarray:
    try:
        arr = np.asarray(page_table)
    except ValueError:  # ragged nested lists
        raise ShapeError("Invalid page_table: expected a 2-D table, got ragged rows") from None
    if arr.ndim != 2:
        raise ShapeError(f"Invalid shape of page_table: expected 2 dimensions, "
                         f"got {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise DTypeError(f"Invalid dtype of page_table: expected integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < -1 or int(arr.max()) >= num_pages):
        raise PageIdError(f"Invalid page_table: page ids must be -1 or in [0, {num_pages})")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _page_id(value: Any, name: str, num_pages: int) -> int:
    if not is_int(value):
        raise DTypeError(f"Invalid {name}: expected an integer page id, "
                         f"got {type(value).__name__}")
    page_id = int(value)
    if not 0 <= page_id < num_pages:
        raise PageIdError(
            f"Invalid {name}: expected 0 <= page id < {num_pages}, got {shown(page_id)}")
    return page_id


def _token_sequence(token_ids: Any) -> Any:
    """``token_ids`` if it can be sliced without reading all of it (a list,
    tuple or 1-D array), else all of it as checked int64 ids."""
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
        return token_ids
    return as_tokens(token_ids, "token_ids")


class PagedCache:
    """A :class:`PagedKVCache`'s store, page pool and prefix index behind the
    seed's method names.

    Parameters
    ----------
    n_layers, n_pages, page_size, n_kv_heads, head_dim : int
    dtype : {"float32", "float16", "bfloat16"}
    backend : str or Backend
        Where the seed took ``device``; the store is NHD, as in the seed.
    hash_secret : bytes, optional
        Key of the chained prefix hashes.

    Notes
    -----
    Differences from the seed: page ids are validated everywhere; a double
    free raises :class:`PageStateError`; prefix hashes are chained and keyed
    and every hit is verified against the stored tokens; ``alloc_n`` is
    atomic; ``write`` takes a start position per row; ``gather`` zero-fills;
    recording the next page of a sequence hashes that page only.
    """

    def __init__(self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int,
                 head_dim: int, dtype: Any = "float32",
                 backend: str | Backend | None = "auto",
                 hash_secret: bytes | None = None) -> None:
        if resolve_quant(dtype) is not None:
            # write and gather move the seed's float arrays as they are
            raise DTypeError(f"Invalid dtype: PagedCache stores float32, float16 or bfloat16 "
                             f"K/V, got {dtype!r} (PagedKVCache keeps int8 pages)")
        self._kv = PagedKVCache(n_layers, n_pages, page_size, n_kv_heads, head_dim,
                                dtype=dtype, layout=StoreLayout.NHD, backend=backend,
                                hash_secret=hash_secret)
        # the cache's parts, moved directly: this API has no sequences
        self._backend = self._kv.backend
        self._store = self._kv.store
        self._pool = self._kv.pool
        self._index = self._kv.index
        self.page_size = self._store.page_size
        self.lookup_hits = 0
        self.lookup_misses = 0
        self._chains = ChainEnds(self._index)
        # an evicted page ends the chains through it; the cache's own hook runs first
        self._next_on_evict = self._pool.on_evict
        self._pool.on_evict = self._on_evict

    k_cache = property(lambda self: self._store.k,
                       doc="K store, shape [n_layers, n_pages, page_size, n_kv_heads, head_dim].")
    v_cache = property(lambda self: self._store.v, doc="V store, same shape as ``k_cache``.")
    pool = property(lambda self: self._pool, doc="The page pool (a :class:`PagePool`).")
    index = property(lambda self: self._index, doc="The prefix index (a :class:`PrefixIndex`).")

    def _on_evict(self, page_id: int) -> None:
        if self._next_on_evict is not None:
            self._next_on_evict(page_id)
        self._chains.forget(page_id)

    # ------------------------------------------------------------- the pool
    def alloc(self) -> int:
        """One page with ref count 1, evicting the least recently used cached
        page if none is free.

        Differs from the seed: raises :class:`OutOfPages` instead of
        returning -1, which the seed's ``write`` then treated as the last page.
        """
        return self._pool.allocate(1)[0]

    def alloc_n(self, n: int) -> list[int]:
        """``n`` pages, or ``[]`` if fewer are available.

        Differs from the seed: all or nothing; on shortage nothing is evicted.
        """
        n = check_nonneg_int(n, "n")
        try:
            return self._pool.allocate(n)
        except OutOfPages:
            return []

    def free(self, idx: int) -> None:
        """Drop one reference; at 0 a cached page becomes evictable, others free.

        Differs from the seed: freeing a page that is not in use raises
        :class:`PageStateError` and changes nothing (the seed's count went
        negative and the page was lost).
        """
        self._pool.free([idx], "idx")

    def inc_ref(self, idx: int) -> None:
        """Add a reference; an evictable page is taken out of the LRU.

        Differs from the seed: a free page raises (its contents are garbage).
        """
        self._pool.inc_ref([idx], "idx")

    # ---------------------------------------------------------- prefix index
    def record_page(self, page_idx: int, token_ids: Any, logical_page_idx: int) -> None:
        """Register page ``page_idx`` as holding logical page
        ``logical_page_idx`` of ``token_ids``.

        Recording the pages of a sequence one after another hashes one page
        per call, not every earlier page again: the cache keeps where the
        chains of recent sequences end (:class:`pagedkv_np.chains.ChainEnds`)
        and checks the earlier tokens against that chain's in one C-level
        comparison (pointer by pointer for a list the caller left as it was).

        Differs from the seed: the hash chains over every earlier page, so
        the earlier pages must be recorded first (a page whose parent is not
        indexed is not recorded); the page must be in use (the seed silently
        leaked a recorded page with ref count 0); the logical page must be
        full. A valid call checks the tokens up to the end of the page only:
        the page's own and the one before it as token ids, the earlier ones
        by comparing their values with those of the chain they were recorded
        in (or as token ids, when no chain of theirs is kept).
        """
        tokens = _token_sequence(token_ids)
        try:
            page_id, logical, page = self._check_record(page_idx, tokens, logical_page_idx)
        except PagedKVError:
            as_tokens(token_ids, "token_ids")  # invalid token ids anywhere are named first
            raise
        chain = self._chains.parent(tokens, logical)
        if chain is None:
            return
        before = self._index.identity(page_id)
        digest, identity, indexed = self._index.insert(page_id, chain.digest, chain.identity,
                                                       page)
        if self._index.identity(page_id) != before:  # it left the prefix it held
            self._chains.forget(page_id)
        if indexed:
            self._pool.mark_cached(page_id)
        if identity is not None:  # None: a colliding hash, no child can follow
            self._chains.extend(chain, tokens, page, digest, identity)

    def _check_record(self, page_idx: Any, tokens: Any,
                      logical_page_idx: Any) -> tuple[int, int, bytes]:
        """The page id, the logical page index and that page's int64 token
        bytes of a valid :meth:`record_page` call."""
        page_id = _page_id(page_idx, "page_idx", self._pool.num_pages)
        if not is_int(logical_page_idx):
            raise DTypeError("Invalid logical_page_idx: expected an integer")
        logical = int(logical_page_idx)
        num_full = len(tokens) // self.page_size
        if not 0 <= logical < num_full:
            raise PageIdError(
                f"Invalid logical_page_idx: expected 0 <= idx < {num_full} (full pages of "
                f"token_ids), got {shown(logical)}")
        start = logical * self.page_size
        page = as_tokens(tokens[start:start + self.page_size], "token_ids").tobytes()
        if self._pool.ref_count(page_id) == 0:
            raise PageStateError(f"Invalid page_idx: page {page_id} is not in use")
        return page_id, logical, page

    def lookup_prefix(self, token_ids: Any) -> list[int]:
        """Pages holding the longest cached prefix of ``token_ids``.

        Takes no references (call :meth:`inc_ref` on the pages you keep);
        evictable hits move to the recently used end of the LRU.
        ``lookup_hits`` counts pages hit, ``lookup_misses`` lookups that
        stopped on a miss, as in the seed.

        Differs from the seed: a hit needs equal tokens and an equal chain of
        earlier pages, not just an equal hash; at most ``len(token_ids) - 1``
        tokens are reported, so the last token is always recomputed.
        """
        tokens = as_tokens(token_ids, "token_ids")
        max_pages = max(len(tokens) - 1, 0) // self.page_size
        pages, _ = self._index.lookup(tokens.tobytes(), len(tokens), max_pages)
        for page_id in pages:
            self._pool.touch(page_id)
        self.lookup_hits += len(pages)
        if len(pages) < max_pages:
            self.lookup_misses += 1
        return pages

    # ------------------------------------------------------------- data moves
    def bind(self, page_table: Any, total_len: int | None = None,
             seq_lens: Any = None) -> CacheView:
        """A :class:`CacheView` over ``page_table``.

        Differs from the seed: ``total_len=None`` (not 0) means "no trim".
        """
        return CacheView(self, page_table, total_len, seq_lens)

    def _slots(self, page_table: np.ndarray, start_pos: Any, num_rows: int, num_tokens: int,
               lengths: Any) -> np.ndarray:
        starts = np.asarray(start_pos)
        if starts.dtype.kind not in "iu":
            raise DTypeError(f"Invalid start_pos: expected integers, got {starts.dtype}")
        starts = np.broadcast_to(starts.astype(np.int64), (num_rows,)) if starts.ndim == 0 \
            else starts.astype(np.int64)
        if starts.shape != (num_rows,):
            raise ShapeError(f"Invalid shape of start_pos: expected [{num_rows}] or a scalar, "
                             f"got {list(starts.shape)}")
        if lengths is None:
            lens = np.full(num_rows, num_tokens, np.int64)
        else:
            lens = np.asarray(lengths)
            if lens.dtype.kind not in "iu" or lens.shape != (num_rows,):
                raise ShapeError(f"Invalid lengths: expected [{num_rows}] integers")
            lens = lens.astype(np.int64)
            if (lens < 0).any() or (lens > num_tokens).any():
                raise ShapeError(f"Invalid lengths: expected 0 <= length <= {num_tokens}")
        if (starts < 0).any():
            raise PageIdError("Invalid start_pos: positions must be >= 0")
        pos = starts[:, None] + np.arange(num_tokens)[None, :]
        valid = np.arange(num_tokens)[None, :] < lens[:, None]
        page_col = pos // self.page_size
        if (valid & (page_col >= page_table.shape[1])).any():
            raise PageIdError("Invalid start_pos: tokens reach past the page_table's columns")
        pages = np.take_along_axis(page_table.astype(np.int64),
                                   np.minimum(page_col, max(page_table.shape[1] - 1, 0)), axis=1) \
            if page_table.shape[1] else np.full(pos.shape, -1, np.int64)
        if (valid & (pages < 0)).any():
            raise PageIdError("Invalid page_table: a token would be written to page -1")
        slots = np.where(valid, pages * self.page_size + pos % self.page_size, -1).reshape(-1)
        used = slots[slots >= 0]
        if np.unique(used).size != used.size:
            raise PageIdError("Invalid page_table: two tokens would be written to the same slot")
        return slots.astype(np.int32)

    def write(self, layer_id: int, page_table: Any, start_pos: Any, k: Any, v: Any,
              lengths: Any = None) -> None:
        """Write ``k``, ``v`` of shape [B, T, n_kv_heads, head_dim] at positions
        ``start_pos[b] + t`` of row ``b`` of ``page_table``.

        Differs from the seed: ``start_pos`` may be one int or one per row
        (ragged batches), ``lengths`` [B] limits each row's tokens, and a
        token that would land in page -1 raises :class:`PageIdError` instead
        of overwriting the last page.
        """
        table = _as_page_table(page_table, self._store.num_pages)
        shape = (table.shape[0], None, self._store.num_kv_heads, self._store.head_dim)
        for name, x in (("k", k), ("v", v)):
            check_array(x, name, shape=shape, dtype=self._store.dtype,
                        array_type=self._backend.array_types)
        if v.shape != k.shape:
            raise ShapeError(f"Invalid shape of v: expected {list(k.shape)}, got {list(v.shape)}")
        num_rows, num_tokens = k.shape[:2]
        slots = self._slots(table, start_pos, num_rows, num_tokens, lengths)
        flat = (num_rows * num_tokens, self._store.num_kv_heads, self._store.head_dim)
        self._backend.write(self._store.k, self._store.v, layer_id, slots,
                            k.reshape(flat), v.reshape(flat), layout=StoreLayout.NHD)

    def gather(self, layer_id: int, page_table: Any, seq_lens: Any = None) -> tuple[Any, Any]:
        """K, V of shape [B, T, n_kv_heads, head_dim] for each row's pages.

        Without ``seq_lens``, row ``b`` is its leading non-negative pages
        (whole pages) and ``T`` covers the widest row, as in the seed.

        Differs from the seed: positions past a row's length (including rows
        whose table entries are -1) are zeros, never uninitialised memory or
        data of page -1.
        """
        table = _as_page_table(page_table, self._store.num_pages)
        if seq_lens is None:
            leading = np.cumprod(table >= 0, axis=1).sum(axis=1) if table.size \
                else np.zeros(table.shape[0], np.int64)
            lens = (leading * self.page_size).astype(np.int32)
        else:
            lens = np.asarray(seq_lens)
            if lens.dtype.kind not in "iu":
                raise DTypeError(f"Invalid dtype of seq_lens: expected integers, got {lens.dtype}")
            if lens.shape != (table.shape[0],):
                raise ShapeError(f"Invalid shape of seq_lens: expected [{table.shape[0]}], "
                                 f"got {list(lens.shape)}")
            limit = table.shape[1] * self.page_size
            if lens.size and (int(lens.min()) < 0 or int(lens.max()) > limit):
                raise ShapeError(f"Invalid seq_lens: expected 0 <= len <= {limit} "
                                 "(page_table columns * page_size)")
            lens = lens.astype(np.int32)
        return self._backend.gather(self._store.k, self._store.v, layer_id, table, lens,
                                    layout=StoreLayout.NHD, out_layout=OutputLayout.BTHD)


class CacheView:
    """A batch's page table (and length) bound to a :class:`PagedCache`.

    Attention layers receive this and only see ``write`` and ``gather``.

    Differs from the seed: ``total_len=None`` means no trim (the seed did not
    trim when ``total_len`` was 0); ``seq_lens`` [B] zero-fills per row.
    """

    __slots__ = ("_cache", "_page_table", "_total_len", "_seq_lens")

    def __init__(self, cache: PagedCache, page_table: Any, total_len: int | None = None,
                 seq_lens: Any = None) -> None:
        if not isinstance(cache, PagedCache):
            raise DTypeError(f"Invalid cache: expected a PagedCache, got {type(cache).__name__}")
        if total_len is not None and (not is_int(total_len) or total_len < 0):
            raise DTypeError(f"Invalid total_len: expected an integer >= 0 or None, "
                             f"got {shown(total_len)}")
        self._cache = cache
        self._page_table = _as_page_table(page_table, cache._store.num_pages)
        self._total_len = total_len
        self._seq_lens = seq_lens

    def write(self, layer_id: int, start_pos: Any, k: Any, v: Any, lengths: Any = None) -> None:
        self._cache.write(layer_id, self._page_table, start_pos, k, v, lengths)

    def gather(self, layer_id: int) -> tuple[Any, Any]:
        k, v = self._cache.gather(layer_id, self._page_table, self._seq_lens)
        if self._total_len is not None:
            if self._total_len > k.shape[1]:
                raise ShapeError(f"Invalid total_len: {self._total_len} exceeds the "
                                 f"{k.shape[1]} gathered positions")
            k, v = k[:, :self._total_len], v[:, :self._total_len]
        return k, v
