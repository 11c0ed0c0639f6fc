"""Timing for ``pagedkv bench``: interleaved rounds of samples and the plain-copy baseline.

Every bandwidth figure is reported beside a plain copy of the same number of
bytes measured in the same process, interleaved with the operation so that
both see the same load. On the host the copy is the better of ``np.copyto``
on one thread and on two (NumPy releases the GIL while it copies, and a
backend may use both cores too); for a device backend it is one device copy.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

__all__ = ["round_times", "best_times", "is_host", "sync_for", "CopyBaseline", "copy_bandwidth"]


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
    """Plain copies of N bytes (read + written): on one and two host threads,
    or one device copy for a device backend. The host buffers grow to the
    largest N asked for and smaller copies reuse them."""

    def __init__(self) -> None:
        self._host_src = self._host_dst = np.empty(0, dtype=np.uint8)
        self._fresh_src = self._fresh_dst = self._host_src
        self._device_key: tuple | None = None
        self._device_fns: list[tuple[Callable[[], None], int]] = []
        self._pool = ThreadPoolExecutor(max_workers=1)

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
        mid = half // 2 // 64 * 64
        pool, turn = self._pool, [0]

        def next_dst():
            turn[0] = (turn[0] + 1) % rounds
            return dst[turn[0] * half:(turn[0] + 1) * half]

        def one_thread():
            np.copyto(next_dst(), src)

        def two_threads():
            out = next_dst()
            done = pool.submit(np.copyto, out[mid:], src[mid:])
            np.copyto(out[:mid], src[:mid])
            done.result()

        return [(one_thread, 1), (two_threads, 2)]

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
    baseline = CopyBaseline()
    try:
        fns = baseline.copies(int(nbytes))
        times = best_times([f for f, _ in fns], repeat, min_time)
    finally:
        baseline.close()
    seconds, threads = min(zip(times, (t for _, t in fns)))
    return 2 * max(int(nbytes) // 2, 64) / seconds / 1e9, threads
