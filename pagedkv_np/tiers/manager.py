"""The cache's side of the tiers: what goes down, what comes back, and checks.

:class:`TierManager` is the one object :class:`~pagedkv_np.PagedKVCache`
calls. Three hooks, each called with the cache's lock held:

- :meth:`~TierManager.offer` when a full page enters the prefix index
  (write-through): it records the page and queues it, nothing more; the
  writer thread copies the page's K/V (under the cache's lock, if the page
  is still the same), encodes it and puts it to every tier;
- :meth:`~TierManager.evict_hook` wraps the pool's eviction callback: a
  page about to be reused whose copy has not been taken yet is copied now,
  and a page whose offer was dropped (queue full) is offered again;
- :meth:`~TierManager.load` when ``add_sequence`` misses in RAM: the keys of
  the following pages of the prompt's chain are asked of each tier in turn
  (nearest first, one batched call each, within ``read_timeout``); the
  longest run of entries that pass every check is loaded into pages from
  the pool and indexed as if computed here. Pages found in a farther tier
  are also queued for the nearer ones.

An entry is served only if its CRC holds and its key, chained digest,
parent digest, tokens and format all equal the requester's; anything else
is counted as ``rejected``, discarded from its tier (by the writer thread)
and never served.

No tier I/O runs in a thread that holds the cache's lock. Writes and
discards run in the writer thread, which takes the lock only to copy a
page from the store. A load's reads must happen while ``add_sequence``
holds the lock, because the pages they fill are allocated and chained
under the parent page its RAM lookup found, in one step that no other
caller may interleave with; so they run in the manager's reader thread,
and ``load`` waits for them ``read_timeout`` seconds at most in all. A read
still running then is abandoned (its pages are misses), and until it
returns the tiers are skipped at once: a hung file system or server costs
one ``read_timeout`` under the lock, never an unbounded wait. (Reading
without the lock would take a two-phase ``add_sequence``: keys under the
lock, reads without it, then the parent checked again and the pages
installed under it.)
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from ..checks import is_int
from ..prefix import encode_salt
from .base import (CorruptPage, PageFormat, Tier, TierUnavailable, decode_page, encode_page,
                   page_key, tier_scope)
from .worker import Reader, ReaderBusy, WriteQueue

__all__ = ["TierManager", "attach_tiers", "flat_stats"]


@dataclass
class _Pending:
    """A page offered to the tiers, its K/V not copied yet (``arrays`` None)."""

    page_id: int
    identity: tuple
    key: bytes
    digest: bytes
    parent_digest: bytes
    tokens: bytes
    arrays: list | None = None
    blob: bytes | memoryview | None = None    # an entry already encoded (a promotion)
    targets: tuple = ()             # tier indexes; () = every tier


@dataclass
class _Discard:
    """An entry of tier ``tier_idx`` that failed verification, to remove."""

    tier_idx: int
    key: bytes


class TierManager:
    """Tiers below the page pool of one cache.

    Parameters
    ----------
    tiers : list of Tier
        Nearest (cheapest to read) first.
    store : KVStore
        The cache's store (page format and arrays).
    index : PrefixIndex
        The cache's prefix index (secret, digests, identities).
    lock : lock
        The cache's lock (the writer thread takes it to copy a page).
    model_id : str
        Model fingerprint; part of every key.
    queue_size : int
        Pages waiting to be written at most; more are dropped and counted.
    read_timeout : float
        Seconds an admission waits for tier reads at most, all tiers
        together; a read still running then is abandoned and its pages are
        misses.
    """

    def __init__(self, tiers: Sequence[Tier], store: Any, index: Any, lock: Any, model_id: str,
                 queue_size: int = 256, read_timeout: float = 1.0) -> None:
        if not is_int(queue_size) or queue_size < 1:
            raise ConfigError(f"Invalid queue_size: expected an integer >= 1, got {queue_size!r}")
        queue_size = int(queue_size)
        if (isinstance(read_timeout, bool) or not isinstance(read_timeout, (int, float))
                or not read_timeout > 0):
            raise ConfigError(f"Invalid read_timeout: expected seconds > 0, got {read_timeout!r}")
        self.tiers = list(tiers)
        self.store, self.index, self._lock = store, index, lock
        self.format = PageFormat.from_store(store)
        self.model_id = model_id
        self.scope = tier_scope(model_id, self.format)
        entry_nbytes = self.format.entry_nbytes(len(self.key(None, b"")),
                                                len(index.root(None)[0]))
        for tier in self.tiers:   # anything larger under a key is not one of our entries
            tier.max_entry_bytes = entry_nbytes
        self.read_timeout = float(read_timeout)
        self._pending: dict[int, _Pending] = {}   # queued, not copied yet
        self._unsent: dict[int, _Pending] = {}    # dropped when offered; retried on eviction
        # the writer holds the manager weakly, so a dropped cache is collected
        write = weakref.WeakMethod(self._write)
        self._queue = WriteQueue(queue_size, lambda batch: _call_alive(write, batch))
        self._reader = Reader()
        self._finalizer = weakref.finalize(self, _close, self._queue, self._reader,
                                           list(self.tiers))

    # ------------------------------------------------------------- writing
    def key(self, salt: Any, digest: bytes) -> bytes:
        return page_key(self.index.secret, self.scope, encode_salt(salt), digest)

    def offer(self, page_id: int, digest: bytes, parent_digest: bytes, tokens: bytes,
              salt: Any) -> None:
        """A page was indexed: queue it for the tiers (cheap; no copy here)."""
        item = _Pending(page_id, self.index.identity(page_id), self.key(salt, digest), digest,
                        parent_digest, tokens)
        self._submit(item)

    def _submit(self, item: _Pending) -> None:
        if self._queue.submit(item):
            if item.arrays is None and item.blob is None:
                self._pending[item.page_id] = item
        else:
            for i, tier in enumerate(self.tiers):
                if not item.targets or i in item.targets:
                    tier.stats.add(drops=1)
            if item.blob is None:
                self._unsent[item.page_id] = item

    def _copy(self, page_id: int) -> list[np.ndarray]:
        """Host copies of the page's arrays (it is about to be reused)."""
        return [np.array(a) for a in self._views(page_id)]

    def _views(self, page_id: int) -> list[np.ndarray]:
        """The page's arrays on the host: views of a host store, copies of a
        device one."""
        s = self.store
        arrays = [s.k, s.v] if s.k_scale is None else [s.k, s.v, s.k_scale, s.v_scale]
        return [s.backend.to_numpy(a[:, page_id]) for a in arrays]

    def evict_hook(self, then: Any) -> Any:
        """The pool's eviction callback: save what the tiers still need of
        the page, then call ``then(page_id)``."""
        def on_evict(page_id: int) -> None:
            item = self._pending.pop(page_id, None)
            if item is not None:
                item.arrays = self._copy(page_id)
            unsent = self._unsent.pop(page_id, None)
            if unsent is not None and self.index.identity(page_id) == unsent.identity:
                unsent.arrays = self._copy(page_id)
                self._submit(unsent)
            then(page_id)
        return on_evict

    def _write(self, batch: list[_Pending | _Discard]) -> None:
        """In the writer thread: discard rejected entries, then copy, encode
        and put a batch of pages."""
        for tier_idx, tier in enumerate(self.tiers):
            keys = [d.key for d in batch if isinstance(d, _Discard) and d.tier_idx == tier_idx]
            if keys:
                try:
                    tier.discard(keys)
                except Exception:
                    tier.stats.add(errors=1)
        per_tier: list[list[tuple[bytes, bytes | memoryview]]] = [[] for _ in self.tiers]
        for item in batch:
            if isinstance(item, _Discard):
                continue
            blob = item.blob
            if blob is None and item.arrays is None:
                with self._lock:
                    # (an eviction since the batch was taken has copied the page)
                    if item.arrays is None:
                        if self._pending.get(item.page_id) is not item:
                            continue      # gone from the index: nothing to write
                        del self._pending[item.page_id]
                        if self.index.identity(item.page_id) != item.identity:
                            continue
                        # encoded from the store itself: one copy of the page
                        blob = self._encode(item, self._views(item.page_id))
            if blob is None:
                blob = self._encode(item, item.arrays)  # type: ignore[arg-type]
            for i in range(len(self.tiers)):
                if not item.targets or i in item.targets:
                    per_tier[i].append((item.key, blob))
        for tier, items in zip(self.tiers, per_tier):
            if not items:
                continue
            t0 = time.perf_counter()
            try:
                stored = tier.put(items)
            except TierUnavailable:
                tier.stats.add(drops=len(items))
                continue
            except Exception:
                tier.stats.add(errors=1, drops=len(items))
                continue
            ok = [len(b) for (_, b), s in zip(items, stored) if s]
            tier.stats.add(num_writes=1, write_seconds=time.perf_counter() - t0,
                           pages_written=len(ok), bytes_written=sum(ok),
                           drops=len(items) - len(ok))

    def _encode(self, item: _Pending, arrays: list) -> memoryview:
        return encode_page(item.key, item.digest, item.parent_digest, item.tokens,
                           self.format.descr, arrays)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued page is written; False on timeout."""
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Write what is queued (a few seconds at most), stop, close the tiers."""
        self._finalizer()

    # ------------------------------------------------------------- reading
    def load(self, pool: Any, salt: Any, digests: list, identities: list, token_bytes: bytes,
             max_pages: int) -> tuple[list[int], list[bytes], list[tuple]]:
        """Load the pages after ``digests`` of the prompt's chain from the tiers.

        Parameters
        ----------
        pool : PagePool
            Loaded pages are allocated from it (ref count 1, for the caller's
            sequence) and marked cached.
        digests, identities : lists
            The chain found in RAM so far.
        token_bytes : bytes
            The prompt as int64 token ids.
        max_pages : int
            Full pages the prompt may take from the cache in all.

        Returns
        -------
        page_ids, digests, identities : lists
            The pages loaded, in chain order, and their index entries.
        """
        start = len(digests)
        index, page_size = self.index, self.store.page_size
        if start:
            parent_digest, parent = digests[-1], identities[-1]
        else:
            parent_digest, parent = index.root(salt)
        num = min(max_pages - start, pool.num_available)
        if num <= 0 or parent is None:
            return [], [], []
        step = 8 * page_size
        chain, d = [], parent_digest
        for i in range(start, start + num):
            chunk = token_bytes[i * step:(i + 1) * step]
            nd = index.page_digest(d, chunk)
            chain.append((nd, d, chunk))
            d = nd
        keys = [self.key(salt, c[0]) for c in chain]
        found: list[list[np.ndarray]] = []
        blobs: list[bytes] = []
        deadline = time.monotonic() + self.read_timeout
        for tier_idx, tier in enumerate(self.tiers):
            if len(found) == num or time.monotonic() >= deadline:
                break
            first = len(found)
            got = self._read(tier, keys[first:], deadline)
            for j, blob in enumerate(got):
                if blob is None:
                    tier.stats.add(misses=len(got) - j)
                    break
                arrays = self._verify(tier, blob, keys[first + j], chain[first + j])
                if arrays is None:
                    tier.stats.add(misses=len(got) - j - 1)
                    break
                tier.stats.add(hits=1, bytes_read=len(blob))
                found.append(arrays)
                blobs.append(blob)
            if tier_idx and len(found) > first:   # promote to the nearer tiers
                for j in range(first, len(found)):
                    self._submit(_Pending(-1, (), keys[j], b"", b"", b"", blob=blobs[j],
                                          targets=tuple(range(tier_idx))))
        page_ids: list[int] = []
        new_digests: list[bytes] = []
        new_ids: list[tuple] = []
        for (digest, pdigest, chunk), arrays in zip(chain, found):
            page_id = pool.allocate(1)[0]
            self._store_page(page_id, arrays)
            digest, ident, indexed = index.insert(page_id, pdigest, parent, chunk)
            if not indexed or ident is None:
                pool.free([page_id])
                break
            pool.mark_cached(page_id)
            page_ids.append(page_id)
            new_digests.append(digest)
            new_ids.append(ident)
            parent = ident
        index.count_hit(len(page_ids) * page_size)
        return page_ids, new_digests, new_ids

    def _read(self, tier: Tier, keys: list[bytes], deadline: float) -> list[bytes | None]:
        """``tier.get(keys)`` in the reader thread, waited for until ``deadline``
        (``time.monotonic``); all misses when it fails or is late."""
        t0 = time.perf_counter()
        try:
            got = self._reader.call(tier.get, keys, timeout=deadline - time.monotonic())
        except (TierUnavailable, ReaderBusy):
            tier.stats.add(misses=len(keys))
            return [None] * len(keys)
        except Exception:
            tier.stats.add(errors=1, misses=len(keys))
            return [None] * len(keys)
        tier.stats.add(num_reads=1, read_seconds=time.perf_counter() - t0)
        if len(got) != len(keys):
            tier.stats.add(errors=1, misses=len(keys))
            return [None] * len(keys)
        return got

    def _verify(self, tier: Tier, blob: Any, key: bytes, link: tuple) -> list | None:
        """The entry's arrays if it is the page asked for, else None (counted)."""
        digest, parent_digest, chunk = link
        try:
            rec = decode_page(blob)
            ok = (rec.key == key and rec.digest == digest and rec.parent_digest == parent_digest
                  and rec.tokens == chunk and rec.descr == self.format.descr
                  and len(rec.payload) == self.format.nbytes)
        except CorruptPage:
            ok = False
        if not ok:
            tier.stats.add(rejected=1)
            self._queue.submit(_Discard(self.tiers.index(tier), key))   # dropped if full
            return None
        return self.format.split(rec.payload)

    def _store_page(self, page_id: int, arrays: list[np.ndarray]) -> None:
        s = self.store
        targets = [s.k, s.v] if s.k_scale is None else [s.k, s.v, s.k_scale, s.v_scale]
        for dst, src in zip(targets, arrays):
            dst[:, page_id] = s.backend.asarray(src)

    # --------------------------------------------------------------- stats
    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """Counters of each tier by name (see :class:`~pagedkv_np.tiers.base.TierStats`)."""
        out = {t.name: t.stats.as_dict() for t in self.tiers}
        for name in out:
            out[name]["queued"] = len(self._queue)
        return out


def _call_alive(method: Any, batch: list) -> None:
    fn = method()
    if fn is not None:
        fn(batch)


def _close(queue: Any, reader: Any, tiers: list) -> None:
    queue.close(5.0)
    reader.close()
    for tier in tiers:
        try:
            tier.close()
        except Exception:
            pass


def attach_tiers(tiers: list[Tier], pool: Any, store: Any, index: Any, lock: Any,
                 model_id: str, tier_options: dict | None) -> TierManager | None:
    """A manager for ``tiers`` (None when there are none), hooked into the
    pool's evictions."""
    if not tiers:
        return None
    options = {k: v for k, v in (tier_options or {}).items() if k != "redis"}
    try:
        manager = TierManager(tiers, store, index, lock, model_id, **options)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    pool.on_evict = manager.evict_hook(pool.on_evict or (lambda page_id: None))
    return manager


def flat_stats(manager: TierManager | None) -> dict[str, float]:
    """The tiers' counters as flat ``tier_<name>_<counter>`` entries."""
    if manager is None:
        return {}
    return {f"tier_{name}_{k}": v for name, d in manager.stats.items() for k, v in d.items()}
