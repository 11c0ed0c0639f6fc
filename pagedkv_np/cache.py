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

Why ~470 lines in one module: one concept, the lock-holding facade over the
pool, index, planner, store and tiers; splitting it would put one lock's
invariants in two files.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence as SequenceT
from typing import Any

import numpy as np

from .backends import Backend, get_backend
from .cache_stats import CacheStats
from .errors import ConfigError, DTypeError, OutOfPages, ShapeError, StalePlanError
from .layout import OutputLayout, StoreLayout
from .checks import check_nonneg_int
from .invariants import check_cache_invariants
from .layer_io import LayerIO
from .plan import LIST_MAX_ENTRIES, Plan, build_plan
from .plan_state import PlanState, PlanTable
from .pool import PagePool
from .prefix import PrefixIndex, encode_salt
from .reuse import PrefixReuse
from .sequence import Sequence, check_sequence, mark_all_planned, one_more_token, step_inputs
from .store import KVStore
from .tiers.config import open_tiers
from .tiers.manager import attach_tiers
from .tokens import as_tokens

__all__ = ["PagedKVCache", "Sequence", "CacheStats"]

_owner_ids = itertools.count(1)


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
    layout : {"NHD", "HND"}, optional
        Store layout (see :mod:`pagedkv_np.layout`); by default the one that
        ``gather_layout`` reads in whole runs: HND for BHTD, NHD for BTHD (a
        mismatched pair transposes every page it gathers, which is slower).
    gather_layout : {"BHTD", "BTHD"}
        Layout that :meth:`gather` returns when it is not told one.
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
        layout: str | StoreLayout | None = None,
        gather_layout: str | OutputLayout = "BHTD",
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
        self.gather_layout = OutputLayout.parse(gather_layout, "gather_layout")
        if layout is None:
            layout = self.gather_layout.store_layout
        self.store = KVStore(num_layers, page_size, num_kv_heads, head_dim,
                             num_pages=num_pages, memory_bytes=memory_bytes,
                             dtype=dtype, layout=layout, backend=self.backend)
        self._io = LayerIO(self.store, self.backend)
        self._page_size = self.store.page_size   # read on every step: one lookup, not a property
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
        self._reuse = PrefixReuse(self.pool, self.index, self.store, self.tiers)
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
            return CacheStats.of(self.pool, self.index, self.tiers, len(self._live))

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
            if self.enable_prefix_caching:
                found = self._reuse.take(tokens, salt, self.partial_page_reuse)
                if found.copied:
                    self._epoch += 1
                seq = Sequence(seq_id, self._owner, salt, tokens[:found.num_tokens].tobytes(),
                               found.pages, found.digests, found.identities)
            else:
                seq = Sequence(seq_id, self._owner, salt)
            self._live[seq.seq_id] = seq
            return seq

    def num_pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pages that ``extend(seq, <num_new_tokens tokens>)`` would allocate."""
        num_new_tokens = check_nonneg_int(num_new_tokens, "num_new_tokens")
        with self._lock:
            check_sequence(seq, self._owner)
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
            check_sequence(seq, self._owner)
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
        needed = seq.pages_needed(n, self._page_size) + (shared is not None)
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
            check_sequence(seq, self._owner)
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
            check_sequence(seq, self._owner)
            if self.enable_prefix_caching and self.partial_page_reuse:
                self._reuse.offer_partial_tail(seq)
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
            page_lists, lens, computed, versions, max_pages = step_inputs(seqs, self._owner)
            # the arrays fill only a large page table (and cost a call each)
            big = len(seqs) * max_pages > LIST_MAX_ENTRIES
            plan = build_plan(page_lists, lens, computed, self._page_size,
                              [s.seq_id for s in seqs],
                              page_arrays=[s.page_array() for s in seqs] if big else None)
            self._plans.add(plan, PlanState(self._epoch, tuple(seqs), versions,
                                            self.num_layers, self.backend.prepare(plan)))
            mark_all_planned(seqs, lens)
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
            if type(layer) is not int or not 0 <= layer < self.store.num_layers:
                layer = self._io.layer_id(layer)
            self._io.write(layer, plan, k, v, state.prepared)
            if state.mark_written(layer):
                self._plan_written(plan, state)

    def gather(self, layer: int, plan: Plan, layout: str | OutputLayout | None = None,
               out: tuple[Any, Any] | None = None,
               num_positions: int | None = None, dtype: Any = None,
               host: bool = False) -> tuple[Any, Any]:
        """Gather one layer's K/V of the plan's sequences into contiguous arrays.

        Parameters
        ----------
        layout : {"BHTD", "BTHD"}, optional
            ``[B, num_kv_heads, T, head_dim]`` (ONNX ``past_key_values``) or
            ``[B, T, num_kv_heads, head_dim]``; by default the cache's
            ``gather_layout`` (BHTD unless it was given another).
        out : (k, v), optional
            C-contiguous buffers to fill, ``T >= max(plan.seq_lens)``.
        num_positions : int, optional
            ``T`` of newly allocated buffers (default ``max(plan.seq_lens)``).
        dtype : {"float32", "float16", "bfloat16"}, optional
            For an int8 cache, the dtype K/V are dequantized into (that of
            ``out`` when given, else float32); otherwise the cache's dtype.
        host : bool
            Return host NumPy arrays (``out``, when given, is host memory):
            a device backend gathers on its device and copies down.

        Returns
        -------
        k, v : arrays
            Positions past each sequence's length are zero.
        """
        with self._lock:
            state = self._check_plan(plan)
            if layout is None:
                layout = self.gather_layout
            return self._io.gather(layer, plan, layout, out, num_positions, dtype,
                                   state.prepared, host)

    def is_written(self, plan: Plan) -> bool:
        """Whether every layer has been written through ``plan`` (a plan of
        this cache)."""
        with self._lock:
            return self._plans.state(plan).is_written

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
            state = self._plans.state(plan)
            if state.is_written and plan.num_new_tokens:
                raise StalePlanError(
                    "Invalid plan: every layer of it was written, so its pages may already "
                    "be shared; release the sequences instead")
            state.discarded = True
            context_lens = plan.context_lens
            for b, seq in enumerate(state.seqs):
                seq.unplan(int(context_lens[b]), int(plan.seq_lens[b]))

    # ------------------------------------------------------------ internals
    def _check_plan(self, plan: Any) -> PlanState:
        """The record of ``plan`` if it may be written or gathered now."""
        return self._plans.current(plan, self._epoch)

    def _batch_pages_needed(self, seqs: Any) -> int:
        """Pages that a token more for each of ``seqs`` takes, at most (checked)."""
        total, tails = one_more_token(seqs, self._owner, self._page_size)
        return total + sum(self.pool.ref_count(page) > 1 for page in tails)

    def _shared_tail(self, seq: Sequence) -> int | None:
        """The sequence's partly filled last page if another sequence holds it too."""
        page = seq.shared_tail(self._page_size)
        return page if page is not None and self.pool.ref_count(page) > 1 else None

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        if n <= 0:
            return 0
        return seq.pages_needed(n, self._page_size) + (self._shared_tail(seq) is not None)

    def _plan_written(self, plan: Plan, state: PlanState) -> None:
        """Every layer of ``plan`` is written: its full pages may be shared."""
        context_lens, seq_lens = plan.context_lens.tolist(), plan.seq_lens.tolist()
        for b, seq in enumerate(state.seqs):
            # a hole (a discarded plan before this one) stops the written run
            if seq.mark_written(context_lens[b], seq_lens[b]) and self.enable_prefix_caching:
                self._reuse.offer_full_pages(seq)

    def check_invariants(self) -> None:
        """Raise AssertionError if pool, index and sequences disagree (O(n))."""
        with self._lock:
            check_cache_invariants(self.pool, self.index, self._live.values(), self.page_size)

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, pages={self.num_pages}, "
                f"page_size={self.page_size}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, layout={self.layout.value}, "
                f"backend={self.backend.name!r})")
