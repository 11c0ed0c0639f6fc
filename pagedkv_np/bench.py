"""``pagedkv bench``: how fast pagedkv_np moves K/V, per backend and dtype.

Every bandwidth figure counts bytes read plus bytes written, and comes with
the bandwidth of a plain copy of the same number of bytes measured in the
same process (``copy GB/s``): the better of ``np.copyto`` on one thread and
on two threads (two halves copied at once; NumPy releases the GIL while it
copies), since a backend may use both cores too. ``x copy`` is the ratio of
the two: 1.0 is as fast as a plain copy. Times are the best of several
repeats of ``time.perf_counter``, after a warm-up call that keeps JIT
compilation and first-touch page faults out of the figures.

Standard cases, run by default (the project's published figures)::

    gather         32 sequences x 2048 tokens, 8 KV heads x 128, one layer,
                   NHD store -> preallocated BHTD and BTHD buffers
                   (plus a sweep over batch size, BHTD, for --plot)
    prefill_write  2048 tokens of one sequence (8 x 128), one layer
    decode_write   32 sequences x 1 token, one layer, per call of
                   PagedKVCache.write (Python overhead included)
    copy_pages     256 copy-on-write page pairs, 2 layers
    alloc_free     PagePool.allocate(1) + free at 1K, 64K and 1M pages
    prefix_lookup  PrefixIndex.lookup throughput in tokens/s, hit and miss

``gather``, ``prefill_write`` and ``copy_pages`` call the backend on arrays
laid out like the cache's store, with ``check_indices=False`` as the cache
calls them; pages are in a shuffled order, as after a while of serving.
``decode_write`` goes through :meth:`PagedKVCache.write`, whose overhead is
most of a decode step. ``alloc_free`` and ``prefix_lookup`` do not depend on
the backend or dtype (those fields are null).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np

from .backends import available_backends, get_backend
from .cache import PagedKVCache
from .errors import BackendUnavailable, ConfigError, DTypeError
from .layout import resolve_dtype
from .pool import PagePool
from .prefix import PrefixIndex

__all__ = ["OPS", "run_benchmarks", "format_table", "plot_gather", "copy_bandwidth", "main"]

OPS = ("gather", "prefill_write", "decode_write", "copy_pages", "alloc_free", "prefix_lookup")
DATA_OPS = OPS[:4]
DEFAULT_DTYPES = ("float32", "float16")
PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
GATHER_SEQS, GATHER_TOKENS = 32, 2048
POOL_SIZES = (1 << 10, 1 << 16, 1 << 20)

# quick: a smoke run of seconds; full: steadier figures and the plot sweep.
_SETTINGS = {
    False: dict(repeat=5, min_time=0.05, max_time=1.0, sweep=(1, 2, 4, 8, 16, 32),
                prompt_lens=(512, 4096, 32768), evict=True),
    True: dict(repeat=3, min_time=0.005, max_time=0.3, sweep=(1, 8, 32), prompt_lens=(4096,),
               evict=False),
}

FIELDS = ("op", "backend", "dtype", "layout", "out_layout", "case", "params", "seconds",
          "us_per_call", "bytes", "gbps", "copy_gbps", "copy_threads", "ratio", "rate",
          "rate_unit")


# ------------------------------------------------------------------ timing
def best_times(fns: list[Callable[[], Any]], repeat: int, min_time: float,
               sync: Callable[[], Any] | None = None,
               max_time: float = float("inf")) -> list[float]:
    """Best seconds per call of each of ``fns`` over ``repeat`` rounds.

    Each function gets one warm-up call, then a number of calls per sample
    that lasts at least ``min_time`` (timer resolution stops mattering). The
    rounds interleave the functions, so that an operation and its copy
    baseline see the same load on a shared machine. No round starts once
    ``max_time`` seconds have passed (slow cases get fewer rounds).
    """
    sync = sync or (lambda: None)
    start_all = time.perf_counter()

    def sample(fn, number: int) -> float:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        return time.perf_counter() - start

    numbers, best = [], []
    for fn in fns:
        sample(fn, 1)
        number, elapsed = 1, sample(fn, 1)
        while elapsed < min_time and number < 1 << 22:
            scale = min_time * 1.2 / max(elapsed, 1e-9)
            number = int(number * min(100.0, max(2.0, scale)))
            elapsed = sample(fn, number)
        numbers.append(number)
        best.append(elapsed / number)
    for _ in range(repeat - 1):
        if time.perf_counter() - start_all > max_time:
            break
        for i, fn in enumerate(fns):
            best[i] = min(best[i], sample(fn, numbers[i]) / numbers[i])
    return best


def _is_host(backend) -> bool:
    return all(issubclass(t, np.ndarray) for t in backend.array_types)


def _sync_for(backend) -> Callable[[], Any] | None:
    """Wait for a device backend's queued work, so that timings are complete."""
    if backend is None or _is_host(backend):
        return None
    sync = getattr(backend, "synchronize", None)
    if sync is None:
        import cupy  # the only device library the registry knows

        return lambda: cupy.cuda.get_current_stream().synchronize()
    return sync


class _CopyBaseline:
    """Plain copies of N bytes (read + written): on one and two host threads,
    or one device copy for a device backend. The host buffers grow to the
    largest N asked for and smaller copies reuse them."""

    def __init__(self) -> None:
        self._host_src = self._host_dst = np.empty(0, dtype=np.uint8)
        self._device_key: tuple | None = None
        self._device_fns: list[tuple[Callable[[], None], int]] = []
        self._pool = ThreadPoolExecutor(max_workers=1)

    def close(self) -> None:
        self._host_src = self._host_dst = np.empty(0, dtype=np.uint8)
        self._device_fns = []
        self._pool.shutdown()

    def reserve(self, nbytes: int) -> None:
        """Allocate (and touch) host buffers for copies of up to ``nbytes``
        once, so that smaller copies reuse them instead of faulting in fresh
        memory each time."""
        half = max(nbytes // 2, 64)
        if half > self._host_src.size:
            self._host_src = self._host_dst = np.empty(0, dtype=np.uint8)  # free first
            # Half a page apart: glibc's memcpy on some AMD CPUs runs 10x
            # slower when dst lies just after src modulo 4096, which is what
            # two fresh allocations of one size give; a ceiling must not.
            self._host_src = _page_offset_array(half, 0)
            self._host_dst = _page_offset_array(half, 2048)
            self._host_src.fill(1)
            self._host_dst.fill(2)

    def copies(self, nbytes: int, backend=None) -> list[tuple[Callable[[], None], int]]:
        """``[(copy, threads), ...]`` each moving ``nbytes`` (half read, half written)."""
        half = max(nbytes // 2, 64)
        if backend is None or _is_host(backend):
            self.reserve(nbytes)
            return self._host(half)
        key = (half, backend.name)
        if key != self._device_key:
            self._device_fns = []  # free the previous buffers first
            self._device_fns = self._device(half, backend)
            self._device_key = key
        return self._device_fns

    def _host(self, half: int) -> list[tuple[Callable[[], None], int]]:
        src, dst = self._host_src[:half], self._host_dst[:half]
        mid = half // 2 // 64 * 64  # cache-line aligned split
        pool = self._pool

        def one_thread():
            np.copyto(dst, src)

        def two_threads():
            # The main thread copies one half while a worker copies the other.
            done = pool.submit(np.copyto, dst[mid:], src[mid:])
            np.copyto(dst[:mid], src[:mid])
            done.result()

        return [(one_thread, 1), (two_threads, 2)]

    def _device(self, half: int, backend) -> list[tuple[Callable[[], None], int]]:
        src, dst = backend.zeros((half,), np.uint8), backend.zeros((half,), np.uint8)

        def copy():
            dst[...] = src

        return [(copy, 1)]


def _page_offset_array(nbytes: int, offset: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` starting ``offset`` bytes into a page."""
    buf = np.empty(nbytes + 8192, dtype=np.uint8)
    start = (-buf.ctypes.data) % 4096 + offset
    return buf[start:start + nbytes]


def copy_bandwidth(nbytes: int, repeat: int = 5, min_time: float = 0.05) -> tuple[float, int]:
    """GB/s (bytes read + written) of a plain host copy of ``nbytes``: the
    better of one and two threads, and that number of threads."""
    baseline = _CopyBaseline()
    try:
        fns = baseline.copies(int(nbytes))
        times = best_times([f for f, _ in fns], repeat, min_time)
    finally:
        baseline.close()
    seconds, threads = min(zip(times, (t for _, t in fns)))
    return 2 * max(int(nbytes) // 2, 64) / seconds / 1e9, threads


# ------------------------------------------------------------------- cases
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


class _Runner:
    """Builds each case's data, times it and turns it into a record.

    The host cases share one set of buffers (a store, output buffers, the
    copy baseline's), allocated once and viewed at each case's shape and
    dtype: faulting in fresh memory for every case and backend would take
    longer than the timings. Device backends allocate their own.
    """

    def __init__(self, quick: bool) -> None:
        self.cfg = _SETTINGS[quick]
        self.copy = _CopyBaseline()
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
        if not _is_host(backend):
            out = backend.zeros(shape, dtype)
            out[...] = 1
            return out
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = self._arena.get(name)
        if buf is None or buf.size < nbytes:
            self._arena.pop(name, None)  # free the smaller one first
            buf = self._arena[name] = np.ones(nbytes, dtype=np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def store(self, backend, dtype, num_layers: int, num_pages: int):
        shape = (num_layers, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)  # NHD
        return (self.array(backend, "store_k", shape, dtype),
                self.array(backend, "store_v", shape, dtype))

    def data_record(self, op, backend, dtype, layout, out_layout, case, params, fn, nbytes):
        copies = self.copy.copies(nbytes, backend)
        times = self.times([fn] + [c for c, _ in copies], _sync_for(backend))
        seconds = times[0]
        copy_seconds, threads = min(zip(times[1:], (t for _, t in copies)))
        # The copy moves 2 * max(nbytes // 2, 64) bytes, nbytes for any real case.
        copy_gbps = 2 * max(nbytes // 2, 64) / copy_seconds / 1e9
        gbps = nbytes / seconds / 1e9
        return _record(op, case, params, seconds, backend=backend.name, dtype=dtype.name,
                       layout=layout, out_layout=out_layout, bytes=int(nbytes), gbps=gbps,
                       copy_gbps=copy_gbps, copy_threads=threads, ratio=gbps / copy_gbps)

    # Each generator yields records as soon as they are measured.
    def gather(self, backend, dtype) -> Iterator[dict]:
        pages_per_seq = -(-GATHER_TOKENS // PAGE_SIZE)
        k_cache, v_cache = self.store(backend, dtype, 1, GATHER_SEQS * pages_per_seq)
        # Pages in a shuffled order, as after a while of serving.
        page_table = np.random.default_rng(0).permutation(GATHER_SEQS * pages_per_seq)
        page_table = page_table.astype(np.int32).reshape(GATHER_SEQS, pages_per_seq)
        seq_lens = np.full(GATHER_SEQS, GATHER_TOKENS, dtype=np.int32)
        cases = [(b, "BHTD") for b in self.cfg["sweep"] if b != GATHER_SEQS]
        cases += [(GATHER_SEQS, "BHTD"), (GATHER_SEQS, "BTHD")]
        for num_seqs, out_layout in cases:
            shape = ((num_seqs, NUM_KV_HEADS, GATHER_TOKENS, HEAD_DIM) if out_layout == "BHTD"
                     else (num_seqs, GATHER_TOKENS, NUM_KV_HEADS, HEAD_DIM))
            out = (self.array(backend, "out_k", shape, dtype),
                   self.array(backend, "out_v", shape, dtype))
            table, lens = page_table[:num_seqs], seq_lens[:num_seqs]

            def run():
                backend.gather(k_cache, v_cache, 0, table, lens, out_layout=out_layout,
                               out=out, check_indices=False)

            params = dict(num_seqs=num_seqs, seq_len=GATHER_TOKENS, num_kv_heads=NUM_KV_HEADS,
                          head_dim=HEAD_DIM, page_size=PAGE_SIZE)
            yield self.data_record("gather", backend, dtype, "NHD", out_layout,
                                   f"{num_seqs} seq x {GATHER_TOKENS} tok", params, run,
                                   2 * (out[0].nbytes + out[1].nbytes))

    def prefill_write(self, backend, dtype) -> Iterator[dict]:
        num_pages = -(-GATHER_TOKENS // PAGE_SIZE)
        k_cache, v_cache = self.store(backend, dtype, 1, num_pages)
        pages = np.random.default_rng(0).permutation(num_pages)
        pos = np.arange(GATHER_TOKENS)
        slot_mapping = (pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).astype(np.int32)
        shape = (GATHER_TOKENS, NUM_KV_HEADS, HEAD_DIM)
        k = self.array(backend, "new_k", shape, dtype)
        v = self.array(backend, "new_v", shape, dtype)
        params = dict(num_seqs=1, num_new_tokens=GATHER_TOKENS, num_kv_heads=NUM_KV_HEADS,
                      head_dim=HEAD_DIM, page_size=PAGE_SIZE)
        yield self.data_record(
            "prefill_write", backend, dtype, "NHD", None, f"1 seq x {GATHER_TOKENS} tok", params,
            lambda: backend.write(k_cache, v_cache, 0, slot_mapping, k, v, check_indices=False),
            2 * (k.nbytes + v.nbytes))

    def decode_write(self, backend, dtype) -> Iterator[dict]:
        cache, plan = _decode_cache(backend, dtype, GATHER_SEQS, 64)
        k = backend.zeros((GATHER_SEQS, NUM_KV_HEADS, HEAD_DIM), dtype)
        v = backend.zeros((GATHER_SEQS, NUM_KV_HEADS, HEAD_DIM), dtype)
        params = dict(num_seqs=GATHER_SEQS, num_new_tokens=1, num_kv_heads=NUM_KV_HEADS,
                      head_dim=HEAD_DIM, page_size=PAGE_SIZE)
        yield self.data_record("decode_write", backend, dtype, "NHD", None,
                               f"{GATHER_SEQS} seq x 1 tok", params,
                               lambda: cache.write(0, plan, k, v), 2 * (k.nbytes + v.nbytes))

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
    if "gather" in ops and dtypes and any(_is_host(b) for b in backends):
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


# ----------------------------------------------------------------- output
_COLUMNS = (("op", 14), ("backend", 8), ("dtype", 9), ("layout", 10), ("case", 26),
            ("time", 10), ("throughput", 16), ("copy GB/s", 10), ("x copy", 7))


def _fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _fmt_rate(value: float, unit: str) -> str:
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix} {unit}"
    return f"{value:.3g} {unit}"


def format_row(rec: dict) -> str:
    layout = rec["layout"] or "-"
    if rec["out_layout"]:
        layout += ">" + rec["out_layout"]
    if rec["gbps"] is not None:
        throughput = f"{rec['gbps']:.3g} GB/s"
        copy, ratio = f"{rec['copy_gbps']:.3g}", f"{rec['ratio']:.2f}"
    else:
        throughput, copy, ratio = _fmt_rate(rec["rate"], rec["rate_unit"]), "", ""
    cells = (rec["op"], rec["backend"] or "-", rec["dtype"] or "-", layout, rec["case"],
             _fmt_time(rec["seconds"]), throughput, copy, ratio)
    return "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, _COLUMNS)).rstrip()


def format_header() -> str:
    return "  ".join(name.ljust(w) for name, w in _COLUMNS).rstrip()


def format_table(records: list[dict]) -> str:
    """The records as a fixed-width text table."""
    return "\n".join([format_header()] + [format_row(r) for r in records])


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib; install it with: pip install 'pagedkv-np[plot]'"
        ) from exc
    return plt


def plot_gather(records: list[dict], path: str) -> None:
    """Plot gather bandwidth (BHTD) against batch size, one line per backend
    and one panel per dtype, with the copy ceiling as a dashed line.

    Parameters
    ----------
    records : list of dict
        From :func:`run_benchmarks`; the ``gather`` records are plotted.
    path : str
        Where to write the image; the format follows the extension.

    Raises
    ------
    ImportError
        matplotlib is not installed (the message says what to install).
    """
    plt = _import_pyplot()
    rows = [r for r in records if r["op"] == "gather" and r["out_layout"] == "BHTD"]
    if not rows:
        raise ConfigError("Invalid records: no gather results to plot")
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))  # in run order
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        mine = sorted((r for r in rows if r["dtype"] == dtype),
                      key=lambda r: r["params"]["num_seqs"])
        for name in sorted({r["backend"] for r in mine}):
            pts = [r for r in mine if r["backend"] == name]
            ax.plot([r["params"]["num_seqs"] for r in pts], [r["gbps"] for r in pts],
                    marker="o", label=name)
        ceiling = {r["params"]["num_seqs"]: r["copy_gbps"] for r in mine}
        xs = sorted(ceiling)
        ax.plot(xs, [ceiling[x] for x in xs], "k--", label="plain copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(f"batch size (sequences of {GATHER_TOKENS} tokens)")
        ax.set_ylabel("GB/s (read + written)")
        ax.set_title(f"gather, {dtype}, {NUM_KV_HEADS}x{HEAD_DIM}, NHD -> BHTD")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------- CLI
def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv bench``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="pagedkv bench",
        description="Time pagedkv_np's operations per backend and dtype, beside a plain "
                    "copy of the same bytes measured in the same process.")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of records instead of the table")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw gather bandwidth against batch size (needs matplotlib)")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend(s) to run, repeatable or comma-separated "
                             "(default: every available one)")
    parser.add_argument("--dtype", action="append", metavar="NAME",
                        help="dtype(s) of the data cases (default: float32,float16)")
    parser.add_argument("--op", action="append", metavar="NAME",
                        help=f"operation(s) to run, from: {', '.join(OPS)} (default: all)")
    args = parser.parse_args(argv)

    ops = _split(args.op)
    for op in ops or ():
        if op not in OPS:
            parser.error(f"argument --op: unknown operation {op!r}; choose from {', '.join(OPS)}")
    backends = _split(args.backend)
    skipped: list[str] = []
    if backends is None:
        backends = available_backends()
        for name in ("numpy", "numba", "cupy"):
            if name not in backends:
                try:
                    get_backend(name)
                except BackendUnavailable as exc:
                    skipped.append(str(exc))
    for name in backends:
        try:
            get_backend(name)
        except (ConfigError, BackendUnavailable) as exc:
            parser.error(f"argument --backend: {exc}")
    dtypes = _split(args.dtype)
    for name in dtypes or ():
        try:
            resolve_dtype(name)
        except DTypeError as exc:
            parser.error(f"argument --dtype: {exc}")
    for flag, names in (("--op", ops), ("--backend", backends), ("--dtype", dtypes)):
        if names == []:
            parser.error(f"argument {flag}: expected at least one name")
    if args.plot:
        if ops is not None and "gather" not in ops:
            parser.error("argument --plot: the plot shows gather; add --op gather")
        try:
            _import_pyplot()
        except ImportError as exc:
            parser.error(str(exc))
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            parser.error(f"argument --plot: no such directory for {args.plot!r}")

    out = sys.stdout
    if args.json:
        for reason in skipped:
            print(f"skipped: {reason}", file=sys.stderr)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"pagedkv bench{' --quick' if args.quick else ''}: numpy {np.__version__}, "
              f"{cpus} CPU(s). copy GB/s: best of np.copyto on 1 and 2 threads over the same "
              "bytes, in this process; x copy = GB/s / copy GB/s.", file=out)
        for reason in skipped:
            print(f"skipped: {reason}", file=out)
        print(format_header(), file=out, flush=True)
    on_record = None if args.json else (lambda rec: print(format_row(rec), file=out, flush=True))
    records = run_benchmarks(ops, backends, dtypes, args.quick, on_record)
    if args.json:
        json.dump(records, out, indent=1)
        out.write("\n")
    if args.plot:  # the checks above guarantee gather records
        plot_gather(records, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0

