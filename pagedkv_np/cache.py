"""PagedKVCache: sequences over the page pool, the prefix index and the store.

This is the one module that composes the others. A generation loop uses it
like this (one step of a batch)::

    seq = cache.add_sequence(prompt)          # takes the cached prefix's pages
    cache.extend(seq, prompt[seq.num_cached_tokens:])   # reserve new slots
    plan = cache.plan([seq])                  # index arrays, once per step
    for layer in range(num_layers):
        cache.write(layer, plan, k_new, v_new)
        k, v = cache.gather(layer, plan)      # contiguous [B, H, T, D]
    cache.release(seq)                        # full pages stay for reuse

A decode step of a batch reserves one slot per running sequence with
``cache.extend_batch(seqs, next_tokens)``, then plans and writes the same way.

Full pages enter the prefix index once their K/V is written: when every
layer of the plan that covers them has been written. Until then no other
sequence can be served them.

Every public method holds one re-entrant lock, so a cache can be shared by
threads; each call is atomic. A plan stays valid until one of its own
sequences is extended or released, whatever other threads do meanwhile.
"""

from __future__ import annotations

import itertools
import numbers
import sys
import threading
from collections.abc import Sequence as SequenceT
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .backends import Backend, get_backend
from .backends.base import _check_layer
from .errors import (AllocationError, ConfigError, DTypeError, OutOfPages, PagedKVError,
                     PageIdError, SequenceError, ShapeError, StalePlanError)
from .layout import (OutputLayout, StoreLayout, check_array, check_nonneg_int, resolve_dtype,
                     shown)
from .plan import LIST_MAX_ENTRIES, Plan, build_plan
from .plan_state import PlanState, PlanTable
from .pool import PagePool
from .prefix import PrefixIndex, encode_salt
from .sequence import Sequence
from .store import KVStore
from .tiers.config import open_tiers
from .tiers.manager import attach_tiers
from .tokens import as_tokens

__all__ = ["PagedKVCache", "Sequence", "CacheStats"]

_owner_ids = itertools.count(1)

# NumPy refuses arrays of more bytes than a signed pointer can count.
_MAX_ARRAY_BYTES = sys.maxsize


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters."""

    num_pages: int
    pages_used: int
    pages_free: int
    pages_evictable: int
    num_sequences: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tiers: dict = field(default_factory=dict)   # per tier: hits, misses, bytes, drops, ...

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any query)."""
        queried = self.prefix_query_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        if not d["tiers"]:   # listed only for a cache with tiers
            del d["tiers"]
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d

    def __getitem__(self, key: str):
        return self.as_dict()[key]


class PagedKVCache:
    """A paged K/V cache with prefix reuse.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int
        Sizes. ``num_pages`` may be ``None`` when ``memory_bytes`` is given.
    dtype : {"float32", "float16", "bfloat16", "int8"}
        ``"int8"`` stores codes and scales (see :mod:`pagedkv_np.quant`):
        :meth:`write` quantizes float32, float16 or bfloat16 K/V and
        :meth:`gather` dequantizes into any of those.
    layout : {"NHD", "HND"}
        Store layout (see :mod:`pagedkv_np.layout`).
    backend : str or Backend
        ``"auto"`` (Numba when available, else NumPy), ``"numpy"``,
        ``"numba"`` or ``"cupy"``.
    memory_bytes : int, optional
        Size the store from a budget for K and V together.
    hash_secret : bytes, optional
        Key of the prefix hashes; random when omitted.
    enable_prefix_caching : bool
        When False, nothing is looked up or indexed.
    disk_cache, disk_cache_bytes, redis_url, model_id, tier_options : optional
        Storage tiers below RAM, keyed by ``model_id`` (see :mod:`pagedkv_np.tiers`).
    partial_page_reuse : bool
        Also reuse the leading tokens of a page that a prompt shares only in
        part (copying that page), so that a shared prefix shorter than a page,
        or one that ends inside a page, still hits.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int | None,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: Any = "float32",
        layout: str | StoreLayout = "NHD",
        backend: str | Backend | None = "auto",
        memory_bytes: int | None = None,
        hash_secret: bytes | None = None,
        enable_prefix_caching: bool = True,
        partial_page_reuse: bool = True,
        disk_cache: Any = None, disk_cache_bytes: int | None = None, redis_url: str | None = None,
        model_id: str | None = None, tier_options: dict | None = None,
        _hash_fn=None,
    ) -> None:
        for flag, name in ((enable_prefix_caching, "enable_prefix_caching"),
                           (partial_page_reuse, "partial_page_reuse")):
            if not isinstance(flag, (bool, np.bool_, int)):
                raise DTypeError(f"Invalid {name}: expected a bool, got {type(flag).__name__}")
        if backend is not None and not isinstance(backend, (str, Backend)):
            # ConfigError, as get_backend answers an unknown name
            raise ConfigError(f"Invalid backend: expected a name or a Backend, "
                             f"got {type(backend).__name__}")
        self.backend = get_backend(backend)
        self.store = KVStore(num_layers, page_size, num_kv_heads, head_dim,
                             num_pages=num_pages, memory_bytes=memory_bytes,
                             dtype=dtype, layout=layout, backend=self.backend)
        self._kernel_store = self.backend._kernel_views(self.store.k, self.store.v)
        self.pool = PagePool(self.store.num_pages)
        tiers, hash_secret = open_tiers(disk_cache, disk_cache_bytes, redis_url, model_id,
                                        hash_secret, tier_options)
        self.index = PrefixIndex(self.store.page_size, hash_secret, _hash_fn)
        self.pool.on_evict = self.index.remove
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.partial_page_reuse = bool(partial_page_reuse)
        self._lock = threading.RLock()
        self.tiers = attach_tiers(tiers, self.pool, self.store, self.index, self._lock,
                                  model_id, tier_options)  # type: ignore[arg-type]
        self._owner = next(_owner_ids)
        self._epoch = 0
        self._seq_ids = itertools.count()
        self._live: dict[int, Sequence] = {}
        self._plans = PlanTable()

    # ------------------------------------------------------------ properties
    num_layers = property(lambda self: self.store.num_layers)
    num_pages = property(lambda self: self.store.num_pages)
    page_size = property(lambda self: self.store.page_size)
    num_kv_heads = property(lambda self: self.store.num_kv_heads)
    head_dim = property(lambda self: self.store.head_dim)
    dtype = property(lambda self: self.store.dtype)
    layout = property(lambda self: self.store.layout)
    nbytes = property(lambda self: self.store.nbytes)
    k_cache = property(lambda self: self.store.k, doc="The K store array.")
    v_cache = property(lambda self: self.store.v, doc="The V store array.")

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_evictable_pages(self) -> int:
        return self.pool.num_evictable

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                num_pages=self.pool.num_pages,
                pages_used=self.pool.num_used,
                pages_free=self.pool.num_free,
                pages_evictable=self.pool.num_evictable,
                num_sequences=len(self._live),
                prefix_hit_tokens=self.index.hit_tokens,
                prefix_query_tokens=self.index.query_tokens,
                tiers=self.tiers.stats if self.tiers is not None else {},
            )

    # ------------------------------------------------------------- sequences
    def add_sequence(self, prompt: Any, salt: str | bytes | int | None = None) -> Sequence:
        """Start a sequence for ``prompt``, holding the pages of its cached prefix.

        At most ``len(prompt) - 1`` tokens are served from the cache, so the
        last prompt token is always computed and yields logits. Whole pages
        are shared by reference; with ``partial_page_reuse``, the page where
        the prompt leaves the cached prefix is copied and its shared leading
        tokens kept::

            prompt:  | page 0 (hit) | page 1 (hit) | 5 shared, then different ... |
            seq:     | shared page  | shared page  | copy: 5 tokens kept | extend ->

        The caller then extends the sequence with
        ``prompt[seq.num_cached_tokens:]``.

        Parameters
        ----------
        prompt : sequence of int, length >= 1
        salt : str, bytes or int, optional
            Sequences share pages only with sequences of the same salt (for
            example one per tenant).
        """
        tokens = as_tokens(prompt, "prompt", allow_empty=False)
        encode_salt(salt)  # type check before any change
        with self._lock:
            seq_id = next(self._seq_ids)
            pages: list[int] = []
            digests: list[bytes] = []
            identities: list = []
            num_cached = 0
            if self.enable_prefix_caching:
                max_pages = (len(tokens) - 1) // self.page_size
                found, found_digests = self.index.lookup(tokens.tobytes(), len(tokens),
                                                         max_pages, salt)
                self.pool.inc_ref(found)
                pages, digests = list(found), list(found_digests)
                identities = [self.index.identity(p) for p in pages]
                if self.tiers is not None and len(pages) < max_pages:
                    loaded = self.tiers.load(self.pool, salt, digests, identities,
                                             tokens.tobytes(), max_pages)
                    pages += loaded[0]
                    digests += loaded[1]
                    identities += loaded[2]
                num_cached = len(pages) * self.page_size
                if self.partial_page_reuse:
                    parent = identities[-1] if identities else self.index.root(salt)[1]
                    shared, page = self._reuse_partial(parent, tokens, num_cached)
                    if shared:
                        pages.append(page)
                        num_cached += shared
            seq = Sequence(seq_id, self._owner, salt, tokens[:num_cached].tobytes(), pages,
                           digests, identities)
            self._live[seq.seq_id] = seq
            return seq

    def num_pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pages that ``extend(seq, <num_new_tokens tokens>)`` would allocate."""
        num_new_tokens = check_nonneg_int(num_new_tokens, "num_new_tokens")
        with self._lock:
            self._check_seq(seq)
            return self._pages_needed(seq, num_new_tokens)

    def can_extend(self, seq: Sequence, num_new_tokens: int, spare_pages: int = 0) -> bool:
        """Whether ``extend`` of that many tokens would succeed now and leave
        at least ``spare_pages`` pages to allocate."""
        spare_pages = check_nonneg_int(spare_pages, "spare_pages")
        with self._lock:
            return (self.num_pages_needed(seq, num_new_tokens) + spare_pages
                    <= self.pool.num_available)

    def can_extend_batch(self, seqs: SequenceT[Sequence]) -> bool:
        """Whether :meth:`extend_batch` of ``seqs`` (a token each) would
        succeed now."""
        with self._lock:
            return self._batch_pages_needed(seqs) <= self.pool.num_available

    def extend(self, seq: Sequence, tokens: Any) -> None:
        """Reserve slots for ``tokens`` after the sequence's current tokens.

        All or nothing: on :class:`OutOfPages` nothing changes. If the
        sequence's partly filled last page is shared (after :meth:`fork`),
        it is copied first so neither side sees the other's new tokens.
        """
        new = as_tokens(tokens, "tokens")
        with self._lock:
            self._check_seq(seq)
            n = len(new)
            if n == 0:
                return
            needed = self._pages_needed(seq, n)
            if needed > self.pool.num_available:
                raise OutOfPages(needed, self.pool.num_available, f"extend by {n} token(s)")
            self._extend(seq, new.tobytes(), n)
            self._epoch += 1

    def extend_batch(self, seqs: SequenceT[Sequence], tokens: Any) -> None:
        """Reserve one slot per sequence: ``tokens[i]`` after the tokens of
        ``seqs[i]``, as a decode step does.

        The same as :meth:`extend` of each sequence by its token, checked
        once for the batch and all or nothing for it: on an error (such as
        :class:`OutOfPages`) no sequence changes.
        """
        if isinstance(seqs, Sequence) or not isinstance(seqs, (list, tuple)):
            raise DTypeError("Invalid seqs: expected a list of sequences")
        new = as_tokens(tokens, "tokens")
        if new.shape[0] != len(seqs):
            raise ShapeError(f"Invalid shape of tokens: expected one token per sequence "
                             f"[{len(seqs)}], got [{new.shape[0]}]")
        with self._lock:
            total = self._batch_pages_needed(seqs)
            if total > self.pool.num_available:
                raise OutOfPages(total, self.pool.num_available,
                                 f"extend {len(seqs)} sequence(s) by a token each")
            # the sum is an upper bound: forks of one sequence, listed
            # together, copy their shared last page only until one of them
            # holds it alone
            raw = new.tobytes()
            for i, seq in enumerate(seqs):
                self._extend(seq, raw[8 * i:8 * i + 8], 1)
            if seqs:
                self._epoch += 1

    def _extend(self, seq: Sequence, raw: bytes, n: int) -> None:
        """Append ``n`` tokens (``raw``: their int64 bytes); the caller made
        sure the pool has the pages."""
        shared = self._shared_tail(seq)
        needed = seq.pages_needed(n, self.page_size) + (shared is not None)
        pages = self.pool.allocate(needed) if needed else []
        if shared is None:
            seq.append(raw, pages)
            return
        dst = pages.pop()
        self.store.copy_pages(np.array([shared], np.int32), np.array([dst], np.int32))
        seq.append(raw, pages, replace_last=dst)
        self.pool.free([shared])

    def fork(self, seq: Sequence) -> Sequence:
        """A new sequence with the same tokens, sharing every page by reference.

        Full pages stay shared; the partly filled last page is copied by
        whichever side extends first. The sequence must have no reserved,
        unplanned tokens, and every plan of it must be written in every
        layer: a copy of its last page taken before a write lands would miss
        that write, and a plan discarded after the fork would leave the child
        counting tokens that were never written. So a fork between ``plan``
        and the last ``write`` is refused rather than followed.
        """
        with self._lock:
            self._check_seq(seq)
            child = seq.fork(self._seq_ids)
            self.pool.inc_ref(child.page_list())
            self._live[child.seq_id] = child
            return child

    def release(self, seq: Sequence) -> None:
        """Drop the sequence and its page references.

        Its full, written pages stay in the prefix index (evictable once no
        sequence holds them), and so does its partly filled last page when
        ``partial_page_reuse`` is on; pages are freed tail first, so a
        prefix's tail is evicted before its head. A released sequence cannot be used again.
        """
        with self._lock:
            self._check_seq(seq)
            if self.enable_prefix_caching and self.partial_page_reuse:
                self._index_partial_tail(seq)
            self.pool.free(reversed(seq.release()))
            del self._live[seq.seq_id]
            self._epoch += 1

    # ------------------------------------------------------------------ steps
    def plan(self, seqs: SequenceT[Sequence]) -> Plan:
        """Index arrays for one step over ``seqs`` (see :mod:`pagedkv_np.plan`).

        The tokens reserved since each sequence's last plan become this
        step's new tokens, in the order of ``seqs``. Build the plan once and
        pass it to :meth:`write` and :meth:`gather` for every layer; it is
        stale once the cache reserves or releases pages.
        """
        with self._lock:
            self._check_batch(seqs)
            page_lists = [s.page_list() for s in seqs]
            # the arrays fill only a large page table (and cost a call each)
            big = len(seqs) * max(map(len, page_lists), default=0) > LIST_MAX_ENTRIES
            plan = build_plan(page_lists, [s.num_tokens for s in seqs],
                              [s.num_computed_tokens for s in seqs], self.page_size,
                              [s.seq_id for s in seqs],
                              page_arrays=[s.page_array() for s in seqs] if big else None)
            self._plans.add(plan, PlanState(self._epoch, tuple(seqs), self.num_layers))
            for seq in seqs:
                seq.mark_planned()
            return plan

    def write(self, layer: int, plan: Plan, k: Any, v: Any) -> None:
        """Write one layer's K/V of the plan's new tokens.

        Parameters
        ----------
        layer : int
        plan : Plan
            From :meth:`plan` of this cache, still current.
        k, v : array, shape [plan.num_new_tokens, num_kv_heads, head_dim], dtype of the cache
            New tokens of the plan's sequences, concatenated in plan order
            (for an int8 cache: float32, float16 or bfloat16). They must not
            share memory with the store.
        """
        with self._lock:
            state = self._check_plan(plan)
            # The store was checked when it was made and the plan when it was
            # built: what is left to check is the layer and the data, and then
            # the backend's kernel can be called directly.
            store, backend = self.store, self.backend
            if type(layer) is not int or not 0 <= layer < store.num_layers:
                layer = self._layer_id(layer)
            if store.quant is not None:
                backend.write_quantized(store.k, store.v, store.k_scale, store.v_scale, layer,
                                        plan.slot_mapping, k, v, layout=store.layout,
                                        check_indices=False)
                if state.mark_written(layer):
                    self._plan_written(plan, state)
                return
            shape = (plan.slot_mapping.shape[0], store.num_kv_heads, store.head_dim)
            check_array(k, "k", shape=shape, dtype=store.dtype, array_type=backend.array_types)
            check_array(v, "v", shape=shape, dtype=store.dtype, array_type=backend.array_types)
            backend.check_sources((k, v), (store.k, store.v))
            if shape[0]:
                backend._write(*self._kernel_store, layer, plan.slot_mapping, k, v, store.layout)
            if state.mark_written(layer):
                self._plan_written(plan, state)

    def gather(self, layer: int, plan: Plan, layout: str | OutputLayout = "BHTD",
               out: tuple[Any, Any] | None = None,
               num_positions: int | None = None, dtype: Any = None) -> tuple[Any, Any]:
        """Gather one layer's K/V of the plan's sequences into contiguous arrays.

        Parameters
        ----------
        layout : {"BHTD", "BTHD"}
            ``[B, num_kv_heads, T, head_dim]`` (ONNX ``past_key_values``,
            the default) or ``[B, T, num_kv_heads, head_dim]``.
        out : (k, v), optional
            C-contiguous buffers to fill, ``T >= max(plan.seq_lens)``.
        num_positions : int, optional
            ``T`` of newly allocated buffers (default ``max(plan.seq_lens)``).
        dtype : {"float32", "float16", "bfloat16"}, optional
            For an int8 cache, the dtype K/V are dequantized into (that of
            ``out`` when given, else float32); otherwise the cache's dtype.

        Returns
        -------
        k, v : arrays
            Positions past each sequence's length are zero.
        """
        with self._lock:
            self._check_plan(plan)
            layer = self._layer_id(layer)
            if out is None:
                self._check_gather_size(plan, num_positions)
            try:
                return self._gather(layer, plan, layout, out, num_positions, dtype)
            except MemoryError as exc:
                if isinstance(exc, PagedKVError):
                    raise
                raise AllocationError(
                    f"Invalid num_positions: the gathered K and V of {plan.num_seqs} "
                    f"sequence(s) could not be allocated ({exc})") from None

    def _check_gather_size(self, plan: Plan, num_positions: Any) -> None:
        """Refuse output buffers whose size no allocator can take (the
        backend checks the type and lower bound of ``num_positions``)."""
        if not isinstance(num_positions, numbers.Integral) or isinstance(num_positions, bool):
            return
        max_len = int(plan.seq_lens.max()) if plan.num_seqs else 0
        if int(num_positions) < max_len:
            raise ShapeError(f"Invalid num_positions: expected >= max(seq_lens) = {max_len}, "
                             f"got {shown(num_positions)}")
        store = self.store
        nbytes = (2 * plan.num_seqs * int(num_positions) * store.num_kv_heads * store.head_dim
                  * 4)   # at most 4 bytes an element, whatever the output dtype
        if nbytes > _MAX_ARRAY_BYTES:
            raise ConfigError(
                f"Invalid num_positions: {shown(num_positions)} positions of {plan.num_seqs} "
                f"sequence(s) need {shown(nbytes)} bytes for K and V, more than an array "
                "can hold")

    def _layer_id(self, layer: Any) -> int:
        """``layer`` as an index of the store's layers, else a typed error."""
        num_layers = self.store.num_layers
        if isinstance(layer, numbers.Integral) and not isinstance(layer, bool) \
                and not 0 <= int(layer) < num_layers:
            raise PageIdError(f"Invalid layer: expected 0 <= layer < {num_layers}, "
                              f"got {shown(layer)}")
        return _check_layer(layer, num_layers)

    def _gather(self, layer: Any, plan: Plan, layout: Any, out: Any, num_positions: Any,
                dtype: Any) -> tuple[Any, Any]:
        """:meth:`gather` once the plan is checked (the lock held)."""
        store = self.store
        if store.quant is not None:
            return self.backend.gather_quantized(
                store.k, store.v, store.k_scale, store.v_scale, layer, plan.page_table,
                plan.seq_lens, layout=store.layout, out_layout=layout, out=out,
                num_positions=num_positions, dtype=dtype, check_indices=False)
        if dtype is not None and resolve_dtype(dtype) != store.dtype:
            raise DTypeError(f"Invalid dtype: a {store.dtype} cache gathers {store.dtype}, "
                             f"got {dtype!r}")
        return self.backend.gather(self.store.k, self.store.v, layer, plan.page_table,
                                   plan.seq_lens, layout=self.store.layout,
                                   out_layout=layout, out=out,
                                   num_positions=num_positions, check_indices=False)

    def is_written(self, plan: Plan) -> bool:
        """Whether every layer has been written through ``plan`` (a plan of
        this cache)."""
        with self._lock:
            return self._plan_state(plan).is_written

    def discard(self, plan: Plan) -> None:
        """Take back ``plan``: its K/V was not (fully) written, say because
        the model call failed.

        Its sequences' new tokens return to reserved-but-unplanned, so the
        next plan covers them again, and the plan can no longer be written.
        A plan written in every layer cannot be discarded.
        A sequence planned again since keeps its state; its unwritten tokens
        are then never indexed.
        """
        with self._lock:
            state = self._plan_state(plan)
            if state.is_written and plan.num_new_tokens:
                raise StalePlanError(
                    "Invalid plan: every layer of it was written, so its pages may already "
                    "be shared; release the sequences instead")
            state.discarded = True
            context_lens = plan.context_lens
            for b, seq in enumerate(state.seqs):
                seq.unplan(int(context_lens[b]), int(plan.seq_lens[b]))

    # ------------------------------------------------------------ internals
    def _reuse_partial(self, parent: Any, tokens: np.ndarray, num_cached: int
                       ) -> tuple[int, int]:
        """Copy the cached child of ``parent`` sharing the most leading tokens
        with the rest of the prompt into a new page; return (tokens shared,
        the new page), (0, -1) when there is none."""
        limit = min(self.page_size, len(tokens) - 1 - num_cached)
        if limit <= 0:
            return 0, -1
        # identities fresh from add_sequence's lookup, never None (a collision)
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
        self._epoch += 1
        return shared, dst

    def _index_partial_tail(self, seq: Sequence) -> None:
        """List a released sequence's partly filled, written last page."""
        num_full, tail = divmod(seq.num_written_tokens, self.page_size)
        if tail == 0 or seq.num_indexed_pages != num_full or seq.num_pages <= num_full:
            return
        parent = seq.link(num_full - 1)[1] if num_full else self.index.root(seq.salt)[1]
        page_id = seq.page(num_full)
        if parent is None or self.pool.ref_count(page_id) != 1:  # broken chain, or shared
            return
        start = num_full * self.page_size
        tokens = seq.token_bytes(start, start + tail)
        if self.index.register_partial(page_id, parent, tokens):
            self.pool.mark_cached(page_id)

    def _check_seq(self, seq: Any, name: str = "seq") -> None:
        if not isinstance(seq, Sequence):
            raise DTypeError(f"Invalid {name}: expected a Sequence, got {type(seq).__name__}")
        if seq.owner != self._owner:
            raise SequenceError(f"Invalid {name}: sequence {seq.seq_id} belongs to another cache")
        if seq.is_released:
            raise SequenceError(f"Invalid {name}: sequence {seq.seq_id} was released")

    def _plan_state(self, plan: Any) -> PlanState:
        """This cache's record of ``plan``, else a typed error."""
        if not isinstance(plan, Plan):
            raise DTypeError(f"Invalid plan: expected a Plan, got {type(plan).__name__}")
        state = self._plans.get(plan)
        if state is None:
            raise StalePlanError("Invalid plan: it was built by another cache")
        return state

    def _check_plan(self, plan: Any) -> PlanState:
        """The record of ``plan`` if it may be written or gathered now."""
        state = self._plan_state(plan)
        if state.discarded:
            raise StalePlanError("Invalid plan: it was discarded")
        if state.epoch != self._epoch and not state.is_current():
            # (the same epoch: nothing was reserved or released since)
            raise StalePlanError(
                "Invalid plan: one of its sequences was extended or released since it "
                "was built; build a new plan")
        return state

    def _check_batch(self, seqs: Any) -> None:
        """Refuse anything but a list (or tuple) of distinct live sequences of this cache."""
        if isinstance(seqs, Sequence) or not isinstance(seqs, (list, tuple)):
            raise DTypeError("Invalid seqs: expected a list of sequences")
        seen = set()
        for seq in seqs:
            self._check_seq(seq, "seqs")
            if seq.seq_id in seen:
                raise SequenceError(f"Invalid seqs: sequence {seq.seq_id} is listed twice")
            seen.add(seq.seq_id)

    def _batch_pages_needed(self, seqs: Any) -> int:
        """Pages that a token more for each of ``seqs`` takes, at most (checked)."""
        self._check_batch(seqs)
        return sum(self._pages_needed(seq, 1) for seq in seqs)

    def _shared_tail(self, seq: Sequence) -> int | None:
        """The sequence's partly filled last page if another sequence holds it too."""
        page = seq.shared_tail(self.page_size)
        return page if page is not None and self.pool.ref_count(page) > 1 else None

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        if n <= 0:
            return 0
        return seq.pages_needed(n, self.page_size) + (self._shared_tail(seq) is not None)

    def _plan_written(self, plan: Plan, state: PlanState) -> None:
        """Every layer of ``plan`` is written: its full pages may be shared."""
        context_lens, seq_lens = plan.context_lens.tolist(), plan.seq_lens.tolist()
        for b, seq in enumerate(state.seqs):
            # a hole (a discarded plan before this one) stops the written run
            if seq.mark_written(context_lens[b], seq_lens[b]) and self.enable_prefix_caching:
                self._index_full_pages(seq)

    def _index_full_pages(self, seq: Sequence) -> None:
        """Offer the sequence's newly full pages to the index, in order.

        Each page records the identity of its parent's content; once a page's
        hash is taken by other content (a collision), later pages of this
        sequence cannot be reached by a lookup and are not indexed.
        """
        page_size, index = self.page_size, self.index
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

    def check_invariants(self) -> None:
        """Raise AssertionError if pool, index and sequences disagree (O(n))."""
        with self._lock:
            self.pool.check_invariants()
            self.index.check_invariants()
            refs = [0] * self.num_pages
            for seq in self._live.values():
                assert not seq.is_released
                assert seq.num_pages == -(-seq.num_tokens // self.page_size)
                assert seq.num_cached_tokens <= seq.num_computed_tokens <= seq.num_tokens
                assert seq.num_written_tokens <= seq.num_computed_tokens
                assert seq.num_indexed_pages <= seq.num_written_tokens // self.page_size
                for page_id in seq.page_list():
                    refs[page_id] += 1
            for page_id in range(self.num_pages):
                assert refs[page_id] <= self.pool.ref_count(page_id), (
                    f"page {page_id}: sequences hold {refs[page_id]} refs, "
                    f"pool counts {self.pool.ref_count(page_id)}")
                if page_id in self.index:
                    assert self.pool.is_cached(page_id), f"page {page_id} indexed but not cached"

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, pages={self.num_pages}, "
                f"page_size={self.page_size}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, layout={self.layout.value}, "
                f"backend={self.backend.name!r})")
