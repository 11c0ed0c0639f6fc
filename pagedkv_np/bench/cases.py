"""The standard cases of ``pagedkv bench`` and the runner that measures them.

Each case builds its data once, times the operation beside a plain copy of
the same bytes (:mod:`.timing`) and yields one record with the keys of
:data:`FIELDS`. The cases themselves are listed in the package docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import numpy as np

from ..backends import available_backends, get_backend
from ..backends.base import aligned_array
from ..cache import PagedKVCache
from ..errors import ConfigError
from ..layout import resolve_dtype
from ..pool import PagePool
from ..prefix import PrefixIndex
from .ops import DATA_OPS, DEFAULT_DTYPES, OPS
from .timing import CopyBaseline, best_times, is_host, round_times, sync_for

__all__ = ["OPS", "FIELDS", "run_benchmarks", "pool_cycle", "prefix_setup"]

PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
GATHER_SEQS, GATHER_TOKENS = 32, 2048
# Bytes a "fresh" write case and its copy write in turn before they come
# back to the same destination: twice a large L3 cache, so that every call
# writes memory that has left the caches, as a write into new pages does.
FRESH_SPAN = 64 << 20
POOL_SIZES = (1 << 10, 1 << 16, 1 << 20)


class _Settings(TypedDict):
    """How long and how often each case is timed, and which cases run."""

    repeat: int
    min_time: float
    max_time: float
    sweep: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    evict: bool


# quick: a smoke run of seconds; full: steadier figures and the plot sweep.
_SETTINGS: dict[bool, _Settings] = {
    False: dict(repeat=9, min_time=0.05, max_time=2.0, sweep=(1, 2, 4, 8, 16, 32),
                prompt_lens=(512, 4096, 32768), evict=True),
    True: dict(repeat=3, min_time=0.005, max_time=0.3, sweep=(1, 8, 32), prompt_lens=(4096,),
               evict=False),
}

# The keys of every record, in this order in the JSON output.
FIELDS = ("op", "backend", "dtype", "layout", "out_layout", "case", "params", "seconds",
          "us_per_call", "bytes", "gbps", "copy_gbps", "copy_threads", "ratio", "ratio_median",
          "rate", "rate_unit")


def _record(op: str, case: str, params: dict, seconds: float, **extra: Any) -> dict:
    rec = dict.fromkeys(FIELDS)
    rec.update(op=op, case=case, params=params, seconds=seconds, us_per_call=seconds * 1e6)
    rec.update(extra)
    return rec


def _decode_cache(backend, dtype, num_seqs: int, context: int) -> tuple[PagedKVCache, Any]:
    """A cache of ``num_seqs`` sequences of ``context`` written tokens, each
    with one more token reserved, and the plan of that decode step."""
    pages_per_seq = -(-(context + 1) // PAGE_SIZE)
    cache = PagedKVCache(1, num_seqs * pages_per_seq, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                         dtype=dtype, backend=backend, enable_prefix_caching=False)
    cache.k_cache[...] = 1  # touched: no first-write faults in the timings
    cache.v_cache[...] = 2
    seqs = []
    for b in range(num_seqs):
        tokens = np.arange(context, dtype=np.int64) + b * context
        seq = cache.add_sequence(tokens)
        cache.extend(seq, tokens[seq.num_cached_tokens:])
        seqs.append(seq)
    plan = cache.plan(seqs)
    kv = backend.zeros((plan.num_new_tokens, NUM_KV_HEADS, HEAD_DIM), dtype)
    cache.write(0, plan, kv, kv)
    for seq in seqs:
        cache.extend(seq, [7])
    return cache, cache.plan(seqs)


def _cycling(fn: Callable[[Any], Any], args: list) -> Callable[[], Any]:
    """A call of ``fn`` with each of ``args`` in turn, round and round."""
    turn = [0]

    def call():
        turn[0] = (turn[0] + 1) % len(args)
        return fn(args[turn[0]])

    return call


class _Runner:
    """Builds each case's data, times it and turns it into a record.

    The host cases share one set of buffers (a store, output buffers, the
    copy baseline's), allocated once and viewed at each case's shape and
    dtype: faulting in fresh memory for every case and backend would take
    longer than the timings. Device backends allocate their own.
    """

    def __init__(self, quick: bool) -> None:
        self.cfg = _SETTINGS[quick]
        self.copy = CopyBaseline()
        self._arena: dict[str, np.ndarray] = {}

    def close(self) -> None:
        self.copy.close()
        self._arena.clear()

    def times(self, fns, sync=None) -> list[float]:
        cfg = self.cfg
        return best_times(fns, cfg["repeat"], cfg["min_time"], sync, cfg["max_time"])

    def time(self, fn) -> float:
        return self.times([fn])[0]

    def array(self, backend, name: str, shape: tuple, dtype: np.dtype):
        """A C-contiguous array of ``backend``; a view of a shared, touched
        buffer for a host backend."""
        if not is_host(backend):
            out = backend.zeros(shape, dtype)
            out[...] = 1
            return out
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = self._arena.get(name)
        if buf is None or buf.size < nbytes:
            self._arena.pop(name, None)  # free the smaller one first
            # aligned as a store's arrays are (Backend.zeros)
            buf = self._arena[name] = aligned_array(np.empty, (nbytes,), np.uint8)
            buf.fill(1)
        return buf[:nbytes].view(dtype).reshape(shape)

    def store(self, backend, dtype, num_layers: int, num_pages: int, layout: str = "NHD"):
        shape = ((num_layers, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM) if layout == "NHD"
                 else (num_layers, num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM))
        return (self.array(backend, "store_k", shape, dtype),
                self.array(backend, "store_v", shape, dtype))

    def data_record(self, op, backend, dtype, layout, out_layout, case, params, fn, nbytes,
                    fresh: bool = False):
        copies = (self.copy.fresh_copies(nbytes, FRESH_SPAN) if fresh
                  else self.copy.copies(nbytes, backend))
        cfg = self.cfg
        rounds = round_times([fn] + [c for c, _ in copies], cfg["repeat"], cfg["min_time"],
                             sync_for(backend), cfg["max_time"])
        best = [min(column) for column in zip(*rounds)]
        seconds = best[0]
        copy_seconds, threads = min(zip(best[1:], (t for _, t in copies)))
        # The copy moves 2 * max(nbytes // 2, 64) bytes, nbytes for any real case.
        copy_bytes = 2 * max(nbytes // 2, 64)
        copy_gbps = copy_bytes / copy_seconds / 1e9
        gbps = nbytes / seconds / 1e9
        # The same ratio within each round, where the operation and its copy
        # ran back to back: a burst of load or of bandwidth in one round moves
        # the ratio of the bests, but hardly the median of these.
        per_round = [nbytes / r[0] / (copy_bytes / min(r[1:])) for r in rounds]
        return _record(op, case, params, seconds, backend=backend.name, dtype=dtype.name,
                       layout=layout, out_layout=out_layout, bytes=int(nbytes), gbps=gbps,
                       copy_gbps=copy_gbps, copy_threads=threads, ratio=gbps / copy_gbps,
                       ratio_median=float(np.median(per_round)))

    # Each generator yields records as soon as they are measured.
    def gather(self, backend, dtype) -> Iterator[dict]:
        pages_per_seq = -(-GATHER_TOKENS // PAGE_SIZE)
        # Pages in a shuffled order, as after a while of serving.
        page_table: np.ndarray = np.random.default_rng(0).permutation(GATHER_SEQS * pages_per_seq)
        page_table = page_table.astype(np.int32).reshape(GATHER_SEQS, pages_per_seq)
        seq_lens = np.full(GATHER_SEQS, GATHER_TOKENS, dtype=np.int32)
        cases = [(b, "NHD", "BHTD") for b in self.cfg["sweep"] if b != GATHER_SEQS]
        # (an HND store keeps each head's positions together, as BHTD wants)
        cases += [(GATHER_SEQS, "NHD", "BHTD"), (GATHER_SEQS, "NHD", "BTHD"),
                  (GATHER_SEQS, "HND", "BHTD")]
        for num_seqs, layout, out_layout in cases:
            k_cache, v_cache = self.store(backend, dtype, 1, GATHER_SEQS * pages_per_seq, layout)
            shape = ((num_seqs, NUM_KV_HEADS, GATHER_TOKENS, HEAD_DIM) if out_layout == "BHTD"
                     else (num_seqs, GATHER_TOKENS, NUM_KV_HEADS, HEAD_DIM))
            out = (self.array(backend, "out_k", shape, dtype),
                   self.array(backend, "out_v", shape, dtype))
            table, lens = page_table[:num_seqs], seq_lens[:num_seqs]

            def run():
                backend.gather(k_cache, v_cache, 0, table, lens, layout=layout,
                               out_layout=out_layout, out=out, check_indices=False)

            params = dict(num_seqs=num_seqs, seq_len=GATHER_TOKENS, num_kv_heads=NUM_KV_HEADS,
                          head_dim=HEAD_DIM, page_size=PAGE_SIZE)
            yield self.data_record("gather", backend, dtype, layout, out_layout,
                                   f"{num_seqs} seq x {GATHER_TOKENS} tok", params, run,
                                   2 * (out[0].nbytes + out[1].nbytes))

    def prefill_write(self, backend, dtype) -> Iterator[dict]:
        num_pages = -(-GATHER_TOKENS // PAGE_SIZE)
        shape = (GATHER_TOKENS, NUM_KV_HEADS, HEAD_DIM)
        k = self.array(backend, "new_k", shape, dtype)
        v = self.array(backend, "new_v", shape, dtype)
        nbytes = 2 * (k.nbytes + v.nbytes)
        # the same pages every call, and, on the host, fresh pages every call
        rounds = max(2, FRESH_SPAN // (k.nbytes + v.nbytes)) if is_host(backend) else 0
        k_cache, v_cache = self.store(backend, dtype, 1, num_pages * max(1, rounds))
        order = np.random.default_rng(0).permutation(num_pages * max(1, rounds))
        pos = np.arange(GATHER_TOKENS)
        mappings = [(order[r * num_pages:(r + 1) * num_pages][pos // PAGE_SIZE] * PAGE_SIZE
                     + pos % PAGE_SIZE).astype(np.int32) for r in range(max(1, rounds))]
        for fresh in (False, True) if rounds else (False,):
            params = dict(num_seqs=1, num_new_tokens=GATHER_TOKENS, num_kv_heads=NUM_KV_HEADS,
                          head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                          destination="fresh" if fresh else "reused")
            write = _cycling(lambda slots: backend.write(k_cache, v_cache, 0, slots, k, v,
                                                         check_indices=False),
                             mappings if fresh else mappings[:1])
            yield self.data_record(
                "prefill_write", backend, dtype, "NHD", None,
                f"1 seq x {GATHER_TOKENS} tok" + (", fresh" if fresh else ""), params,
                write, nbytes, fresh=fresh)

    def decode_write(self, backend, dtype) -> Iterator[dict]:
        cache, plan = _decode_cache(backend, dtype, GATHER_SEQS, 64)
        k = backend.zeros((GATHER_SEQS, NUM_KV_HEADS, HEAD_DIM), dtype)
        v = backend.zeros((GATHER_SEQS, NUM_KV_HEADS, HEAD_DIM), dtype)
        nbytes = 2 * (k.nbytes + v.nbytes)
        params = dict(num_seqs=GATHER_SEQS, num_new_tokens=1, num_kv_heads=NUM_KV_HEADS,
                      head_dim=HEAD_DIM, page_size=PAGE_SIZE, destination="reused")
        yield self.data_record("decode_write", backend, dtype, "NHD", None,
                               f"{GATHER_SEQS} seq x 1 tok", params,
                               lambda: cache.write(0, plan, k, v), nbytes)
        if not is_host(backend):
            return
        # Fresh slots, as in a decode loop: each call writes one token of
        # each of 32 sequences into rows nothing has touched for 64 MiB.
        # Through backend.write: a cache's plans cannot take turns like this.
        rounds = max(2, FRESH_SPAN // (k.nbytes + v.nbytes))
        num_pages = rounds * GATHER_SEQS // PAGE_SIZE
        k_cache, v_cache = self.store(backend, dtype, 1, num_pages)
        slots = np.random.default_rng(1).permutation(num_pages * PAGE_SIZE).astype(np.int32)
        mappings = [slots[r * GATHER_SEQS:(r + 1) * GATHER_SEQS] for r in range(rounds)]
        params = dict(params, destination="fresh")
        write = _cycling(lambda s: backend.write(k_cache, v_cache, 0, s, k, v,
                                                 check_indices=False), mappings)
        yield self.data_record("decode_write", backend, dtype, "NHD", None,
                               f"{GATHER_SEQS} seq x 1 tok, fresh",
                               params, write, nbytes, fresh=True)

    def copy_pages(self, backend, dtype) -> Iterator[dict]:
        num_pairs, num_layers = 256, 2
        k_cache, v_cache = self.store(backend, dtype, num_layers, 2 * num_pairs)
        pages = np.random.default_rng(0).permutation(2 * num_pairs).astype(np.int32)
        src, dst = pages[:num_pairs].copy(), pages[num_pairs:].copy()
        # Half the store's pages are read and the other half written.
        nbytes = k_cache.nbytes + v_cache.nbytes
        params = dict(num_pairs=num_pairs, num_layers=num_layers, num_kv_heads=NUM_KV_HEADS,
                      head_dim=HEAD_DIM, page_size=PAGE_SIZE)
        yield self.data_record(
            "copy_pages", backend, dtype, "NHD", None,
            f"{num_pairs} pages x {num_layers} layers", params,
            lambda: backend.copy_pages(k_cache, v_cache, src, dst, check_indices=False), nbytes)

    def alloc_free(self) -> Iterator[dict]:
        sources = ("free", "evict") if self.cfg["evict"] else ("free",)
        for source in sources:
            for num_pages in POOL_SIZES:
                pool, cycle = pool_cycle(num_pages, source)
                seconds = self.time(cycle)
                yield _record("alloc_free", f"{num_pages} pages, from {source}",
                              dict(num_pages=num_pages, source=source), seconds,
                              rate=1 / seconds, rate_unit="pairs/s")
                del pool

    def prefix_lookup(self) -> Iterator[dict]:
        for num_tokens in self.cfg["prompt_lens"]:
            index, hit, miss = prefix_setup(num_tokens)
            max_pages = (num_tokens - 1) // PAGE_SIZE
            for outcome, tokens in (("hit", hit), ("miss", miss)):
                seconds = self.time(
                    lambda: index.lookup(tokens, num_tokens, max_pages, count=False))
                yield _record("prefix_lookup", f"{num_tokens} tok, {outcome}",
                              dict(num_tokens=num_tokens, outcome=outcome,
                                   page_size=PAGE_SIZE), seconds,
                              rate=num_tokens / seconds, rate_unit="tokens/s")


def pool_cycle(num_pages: int, source: str) -> tuple[PagePool, Callable[[], None]]:
    """A pool of ``num_pages`` and one alloc+free pair that leaves it as it was.

    ``source="free"``: half the pages are in use, the page comes from the free
    list. ``"evict"``: every page is cached and evictable, so the page is
    evicted from the LRU head; marking it cached before freeing sends it back
    to the LRU tail.
    """
    pool = PagePool(num_pages)
    if source == "free":
        pool.allocate(num_pages // 2)

        def cycle():
            pool.free(pool.allocate(1))
    elif source == "evict":
        pages = pool.allocate(num_pages)
        for page_id in pages:
            pool.mark_cached(page_id)
        pool.free(pages)

        def cycle():
            pages = pool.allocate(1)
            pool.mark_cached(pages[0])
            pool.free(pages)
    else:
        raise ConfigError(f"Invalid source: expected 'free' or 'evict', got {source!r}")
    return pool, cycle


def prefix_setup(num_tokens: int, page_size: int = PAGE_SIZE) -> tuple[PrefixIndex, bytes, bytes]:
    """An index holding every full page of one prompt, that prompt's bytes (a
    hit on every page) and a prompt differing in its first token (a miss)."""
    index = PrefixIndex(page_size, secret=b"pagedkv-bench")
    tokens = np.random.default_rng(0).integers(0, 50_000, num_tokens).astype("<i8")
    hit = tokens.tobytes()
    digest, parent = index.root()
    step = 8 * page_size
    for page_id in range(num_tokens // page_size):
        chunk = hit[page_id * step:(page_id + 1) * step]
        digest = index.page_digest(digest, chunk)
        index.register(page_id, digest, chunk, parent)
        parent = index.identity(page_id)
    tokens[0] += 1
    return index, hit, tokens.tobytes()


def run_benchmarks(ops=None, backends=None, dtypes=None, quick: bool = False,
                   on_record: Callable[[dict], Any] | None = None) -> list[dict]:
    """Run the selected cases and return their records (see :data:`FIELDS`).

    Parameters
    ----------
    ops : iterable of str, optional
        Names from :data:`OPS`; all by default.
    backends : iterable of str, optional
        Backend names; every available backend by default.
    dtypes : iterable of str, optional
        Default float32 and float16.
    quick : bool
        A seconds-long smoke run: fewer repeats, a shorter sweep.
    on_record : callable, optional
        Called with each record as soon as it is measured.
    """
    ops = list(OPS if ops is None else ops)
    backends = [get_backend(b) for b in (available_backends() if backends is None else backends)]
    dtypes = [resolve_dtype(d) for d in (DEFAULT_DTYPES if dtypes is None else dtypes)]
    runner = _Runner(quick)
    if "gather" in ops and dtypes and any(is_host(b) for b in backends):
        # The largest host copy baseline, allocated once for every case.
        runner.copy.reserve(4 * GATHER_SEQS * GATHER_TOKENS * NUM_KV_HEADS * HEAD_DIM
                            * max(d.itemsize for d in dtypes))
    records: list[dict] = []

    def emit(stream):
        for rec in stream:
            records.append(rec)
            if on_record is not None:
                on_record(rec)

    try:
        for backend in backends:
            for dtype in dtypes:
                for op in DATA_OPS:
                    if op in ops:
                        emit(getattr(runner, op)(backend, dtype))
        if "alloc_free" in ops:
            emit(runner.alloc_free())
        if "prefix_lookup" in ops:
            emit(runner.prefix_lookup())
    finally:
        runner.close()
    return records

