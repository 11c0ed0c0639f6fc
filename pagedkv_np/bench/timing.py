"""Timing for every benchmark outside asv: rounds, summaries, the copy baseline.

One helper for ``pagedkv bench`` and every benchmark script
(``scripts/bench_*.py``); the asv suite keeps its own frozen copy in
``benchmarks/``, so that two commits are measured by the same code.

* Samples of fast operations: :func:`round_times` / :func:`best_times` time
  several functions in interleaved rounds, so that an operation and its
  copy baseline see the same load.
* The copy baseline: every bandwidth figure is reported beside a plain copy
  of the same number of bytes measured in the same process. On the host the
  copy is the better of ``np.copyto`` on one thread and split over several
  (NumPy releases the GIL while it copies, and a backend may use every core
  too); for a device backend it is one device-to-device copy
  (:class:`CopyBaseline`; :func:`against_copy` times an operation beside
  it, :func:`copy_bandwidth` gives the copy alone).
* Whole runs (a request, a decode, a process): :func:`interleave` runs each
  way once a round, the order rotating; :func:`timed` / :func:`timed_cpu`
  make a call return its time; :func:`spread`, :func:`fmt_spread`,
  :func:`medians` and :func:`percentile` summarise the rounds;
  :func:`run_json` runs one measurement in a fresh process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ..checks import is_int
from ..errors import ConfigError

__all__ = ["round_times", "best_times", "is_host", "sync_for", "CopyBaseline", "copy_bandwidth",
           "CopyRatio", "against_copy", "rotated", "interleave", "timed", "timed_cpu", "Spread",
           "spread", "fmt_spread", "medians", "percentile", "run_json"]

K = TypeVar("K")
T = TypeVar("T")


def round_times(fns: list[Callable[[], Any]], repeat: int, min_time: float,
                sync: Callable[[], Any] | None = None,
                max_time: float = float("inf")) -> list[list[float]]:
    """Seconds per call of each of ``fns``, round by round: ``out[r][i]`` is
    function ``i`` in round ``r``.

    Each function gets one warm-up call, then a number of calls per sample
    that lasts at least ``min_time`` (timer resolution stops mattering). The
    rounds interleave the functions, so that an operation and its copy
    baseline see the same load on a shared machine. No round starts once
    ``max_time`` seconds have passed (slow cases get fewer rounds), and at
    least one full round is always taken.
    """
    sync = sync or (lambda: None)
    start_all = time.perf_counter()

    def sample(fn, number: int) -> float:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        return time.perf_counter() - start

    numbers, first = [], []
    for fn in fns:
        sample(fn, 1)
        number, elapsed = 1, sample(fn, 1)
        while elapsed < min_time and number < 1 << 22:
            scale = min_time * 1.2 / max(elapsed, 1e-9)
            number = int(number * min(100.0, max(2.0, scale)))
            elapsed = sample(fn, number)
        numbers.append(number)
        first.append(elapsed / number)
    rounds = [first]
    for _ in range(repeat - 1):
        if time.perf_counter() - start_all > max_time:
            break
        rounds.append([sample(fn, n) / n for fn, n in zip(fns, numbers)])
    return rounds


def best_times(fns: list[Callable[[], Any]], repeat: int, min_time: float,
               sync: Callable[[], Any] | None = None,
               max_time: float = float("inf")) -> list[float]:
    """Best seconds per call of each of ``fns`` over the rounds of
    :func:`round_times` (same arguments)."""
    rounds = round_times(fns, repeat, min_time, sync, max_time)
    return [min(column) for column in zip(*rounds)]


def is_host(backend) -> bool:
    """Whether ``backend`` works on NumPy arrays (host memory)."""
    return all(issubclass(t, np.ndarray) for t in backend.array_types)


def sync_for(backend) -> Callable[[], Any] | None:
    """Wait for a device backend's queued work, so that timings are complete."""
    if backend is None or is_host(backend):
        return None
    sync = getattr(backend, "synchronize", None)
    if sync is None:
        import cupy  # the only device library the registry knows

        return lambda: cupy.cuda.get_current_stream().synchronize()
    return sync


class CopyBaseline:
    """Plain copies of N bytes (read + written): on one host thread and split
    over ``num_threads``, or one device-to-device copy for a device backend.
    The host buffers grow to the largest N asked for and smaller copies
    reuse them.

    Parameters
    ----------
    num_threads : int
        Threads of the split host copy (the caller's thread and a pool of
        ``num_threads - 1``); 2 matches a backend that uses two cores.
    """

    def __init__(self, num_threads: int = 2) -> None:
        if not is_int(num_threads) or num_threads < 2:
            raise ConfigError(f"Invalid num_threads: expected an int >= 2, got {num_threads!r}")
        self.num_threads = num_threads = int(num_threads)
        self._host_src = self._host_dst = np.empty(0, dtype=np.uint8)
        self._fresh_src = self._fresh_dst = self._host_src
        self._device_key: tuple | None = None
        self._device_fns: list[tuple[Callable[[], None], int]] = []
        self._pool = ThreadPoolExecutor(max_workers=num_threads - 1)

    def close(self) -> None:
        self._host_src = self._host_dst = np.empty(0, dtype=np.uint8)
        self._fresh_src = self._fresh_dst = self._host_src
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
        if backend is None or is_host(backend):
            self.reserve(nbytes)
            return self._host(half)
        key = (half, backend.name)
        if key != self._device_key:
            self._device_fns = []  # free the previous buffers first
            self._device_fns = self._device(half, backend)
            self._device_key = key
        return self._device_fns

    def fresh_copies(self, nbytes: int, span: int) -> list[tuple[Callable[[], None], int]]:
        """Host copies like :meth:`copies`, except that each call writes the
        next ``nbytes / 2`` of a ``span``-byte buffer, round and round: a
        destination that has left the caches since it was last written, as
        a write into fresh pages has. The source is the same each call."""
        half = max(nbytes // 2, 64)
        rounds = max(2, span // half)
        self._fresh_src = self._fresh_dst = np.empty(0, dtype=np.uint8)  # free first
        src = self._fresh_src = _page_offset_array(half, 0)
        dst = self._fresh_dst = _page_offset_array(rounds * half, 2048)
        src.fill(1)
        dst.fill(2)
        turn = [0]

        def next_dst():
            turn[0] = (turn[0] + 1) % rounds
            return dst[turn[0] * half:(turn[0] + 1) * half]

        def one_thread():
            np.copyto(next_dst(), src)

        def split():
            self._split_copy(next_dst(), src)

        return [(one_thread, 1), (split, self.num_threads)]

    def _host(self, half: int) -> list[tuple[Callable[[], None], int]]:
        src, dst = self._host_src[:half], self._host_dst[:half]

        def one_thread():
            np.copyto(dst, src)

        def split():
            self._split_copy(dst, src)

        return [(one_thread, 1), (split, self.num_threads)]

    def _split_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``np.copyto(dst, src)`` in ``num_threads`` cache-line aligned
        parts: the pool copies the later parts while this thread copies the
        first."""
        step = -(-src.size // self.num_threads // 64) * 64
        bounds = list(range(0, src.size, step)) + [src.size]
        parts = [self._pool.submit(np.copyto, dst[a:b], src[a:b])
                 for a, b in zip(bounds[1:-1], bounds[2:])]
        np.copyto(dst[:bounds[1]], src[:bounds[1]])
        for part in parts:
            part.result()

    def _device(self, half: int, backend) -> list[tuple[Callable[[], None], int]]:
        src, dst = backend.zeros((half,), np.uint8), backend.zeros((half,), np.uint8)
        memcpy = getattr(getattr(dst, "data", None), "copy_from_device_async", None)

        def copy():
            if memcpy is not None:  # CuPy: cudaMemcpyAsync, device to device
                memcpy(src.data, half)
            else:
                dst[...] = src

        return [(copy, 1)]


def _page_offset_array(nbytes: int, offset: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` starting ``offset`` bytes into a page."""
    buf = np.empty(nbytes + 8192, dtype=np.uint8)
    start = (-buf.ctypes.data) % 4096 + offset
    return buf[start:start + nbytes]


def copy_bandwidth(nbytes: int, repeat: int = 5, min_time: float = 0.05,
                   num_threads: int = 2) -> tuple[float, int]:
    """GB/s (bytes read + written) of a plain host copy of ``nbytes``: the
    better of one thread and ``num_threads``, and that number of threads."""
    baseline = CopyBaseline(num_threads)
    try:
        fns = baseline.copies(int(nbytes))
        times = best_times([f for f, _ in fns], repeat, min_time)
    finally:
        baseline.close()
    seconds, threads = min(zip(times, (t for _, t in fns)))
    return 2 * max(int(nbytes) // 2, 64) / seconds / 1e9, threads


# ------------------------------------------- an operation against its copy
class CopyRatio(NamedTuple):
    """An operation timed in rounds beside plain copies of the same bytes.

    ``ratios`` holds, round by round, the faster copy's time over the
    operation's time in that round (1.0: as fast as a copy): a burst of load
    in one round moves the ratio of the bests, but hardly their median.
    """

    seconds: float          # best seconds per call of the operation
    copy_seconds: float     # best seconds per call of the faster copy
    copy_threads: int       # the threads of that copy
    ratios: list[float]     # per round: copy seconds / operation seconds

    @property
    def ratio(self) -> float:
        """The best copy's time over the operation's best time."""
        return self.copy_seconds / self.seconds


def against_copy(fn: Callable[[], Any], copies: list[tuple[Callable[[], Any], int]],
                 repeat: int, min_time: float, sync: Callable[[], Any] | None = None,
                 max_time: float = float("inf")) -> CopyRatio:
    """Time ``fn`` in rounds with ``copies`` (``[(copy, threads), ...]`` from
    :class:`CopyBaseline`) as :func:`round_times` does, with the same
    ``repeat``, ``min_time``, ``sync`` and ``max_time``."""
    if not copies:
        raise ConfigError("Invalid copies: expected at least one copy to compare with, got none")
    rounds = round_times([fn] + [c for c, _ in copies], repeat, min_time, sync, max_time)
    best = [min(column) for column in zip(*rounds)]
    copy_seconds, threads = min(zip(best[1:], (t for _, t in copies)))
    return CopyRatio(best[0], copy_seconds, threads, [min(r[1:]) / r[0] for r in rounds])


# ------------------------------------- rounds of whole runs, and their summaries
def rotated(items: Sequence[K], round_idx: int) -> list[K]:
    """``items`` in the order of round ``round_idx``: round r starts at item
    r mod n, so that no item always runs first (on a cold cache, or right
    after another's allocations)."""
    start = round_idx % len(items) if len(items) else 0
    return list(items[start:]) + list(items[:start])


def interleave(fns: Mapping[K, Callable[[], T]], rounds: int, rotate: bool = True,
               on_result: Callable[[int, K, T], Any] | None = None) -> dict[K, list[T]]:
    """Call each of ``fns`` once a round for ``rounds`` rounds, so that all
    share the machine's load as it changes, and collect what they return.

    Parameters
    ----------
    fns : mapping of key to callable
        The ways to compare; wrap one in :func:`timed` to collect its time.
    rounds : int
        How many times each is called, at least 1.
    rotate : bool
        Rotate the order from round to round (:func:`rotated`); otherwise
        the mapping's order every round.
    on_result : callable, optional
        Called as ``on_result(round_idx, key, result)`` after each call, to
        print progress.

    Returns
    -------
    dict of key to list
        Each key's results, round by round, in the mapping's order.
    """
    if not is_int(rounds) or rounds < 1:
        raise ConfigError(f"Invalid rounds: expected an int >= 1, got {rounds!r}")
    keys = list(fns)
    out: dict[K, list[T]] = {key: [] for key in keys}
    for r in range(int(rounds)):
        for key in rotated(keys, r) if rotate else keys:
            result = fns[key]()
            out[key].append(result)
            if on_result is not None:
                on_result(r, key, result)
    return out


def timed(fn: Callable[[], Any]) -> Callable[[], float]:
    """``fn`` as a call that returns its wall-clock seconds."""
    def call() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return call


def timed_cpu(fn: Callable[[], Any]) -> Callable[[], tuple[float, float]]:
    """``fn`` as a call that returns its (wall-clock, process CPU) seconds."""
    def call() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    return call


class Spread(NamedTuple):
    """A figure over rounds: its median and its range."""

    median: float
    low: float
    high: float


def _figures(values: Iterable[float], name: str) -> list[float]:
    xs = [float(v) for v in values]
    if not xs:
        raise ConfigError(f"Invalid {name}: expected at least one figure, got none")
    return xs


def spread(values: Iterable[float]) -> Spread:
    """The median, min and max of ``values`` (at least one)."""
    xs = _figures(values, "values")
    return Spread(statistics.median(xs), min(xs), max(xs))


def fmt_spread(values: Iterable[float], digits: int = 1) -> str:
    """``"median (min-max)"`` of ``values``, the median alone when all are equal."""
    s = spread(values)
    if s.low == s.high:
        return f"{s.median:.{digits}f}"
    return f"{s.median:.{digits}f} ({s.low:.{digits}f}-{s.high:.{digits}f})"


def medians(runs: Sequence[Mapping[str, float]], keys: Iterable[str]) -> dict[str, float]:
    """The median over ``runs`` (one mapping a round) of each of ``keys``."""
    return {key: statistics.median(_figures((run[key] for run in runs), "runs"))
            for key in keys}


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, linear between
    neighbours, as ``numpy.percentile``'s default."""
    xs = sorted(_figures(values, "values"))
    if not 0 <= q <= 100:
        raise ConfigError(f"Invalid q: expected a percentile from 0 to 100, got {q!r}")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_json(argv: Sequence[str], timeout: float | None = None,
             env: Mapping[str, str] | None = None, marker: str = "") -> Any:
    """Run ``argv`` in a fresh process and parse the last line of its output
    that starts with ``marker`` (the marker removed) as JSON: one
    measurement, in a process that no other run has warmed up.

    Raises
    ------
    subprocess.CalledProcessError
        The process failed; its standard error is copied to ours first.
    ConfigError
        It printed no line starting with ``marker``.
    """
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else dict(env))
    if proc.returncode:
        sys.stderr.write(proc.stderr[-8000:])
        raise subprocess.CalledProcessError(proc.returncode, list(argv), proc.stdout,
                                            proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker) and ln.strip()]
    if not lines:
        raise ConfigError(f"Invalid output of {argv[:3]}: no line starts with {marker!r}")
    return json.loads(lines[-1][len(marker):])
