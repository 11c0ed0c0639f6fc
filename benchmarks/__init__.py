"""asv benchmarks of pagedkv_np, one file per module of the package.

The suite imports only the public API of ``pagedkv_np`` and keeps its own
timing and copy-baseline helpers here, so that comparing two commits never
compares two versions of the measuring code.

Setup and asv_runner: recent asv_runner versions re-run ``setup`` before
every timed call (so that no call sees state left by the one before). The
classes whose timed calls leave the data as they found it (data moves, an
alloc+free pair, a lookup) therefore build their data once per process
through :func:`memo` and hand the same objects back on every later
``setup``; classes whose calls change state rebuild it in ``setup`` and set
``number = 1``.

Smoke runs: asv's ``--quick`` makes each ``time_*`` benchmark one call,
but the suite's own measurements (:func:`best_times`, the ``track_*``
figures) cannot see it. ``.ci/bench_smoke.sh`` therefore also sets
``PAGEDKV_ASV_QUICK=1`` (:data:`QUICK_ENV`; ``.ci/run`` sets it for that
script), and under it every such
measurement takes one sample, with no warm-up, and a size parameter keeps
its smallest value (:func:`sizes`): the run checks that each
benchmark runs, its figures mean nothing. Without the variable every
benchmark measures as before.

Beside the suite, ``pagedkv bench`` (``pagedkv_np/bench/``) prints the
standard cases on one machine, and ``scripts/bench_*.py`` run what is too
long for a commit-by-commit suite or needs a peer runtime (see
``docs/benchmarks.md``); those share ``pagedkv_np.bench.timing``, which this
suite does not import.
"""

from __future__ import annotations

import abc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from collections.abc import Callable

import numpy as np

BACKENDS = ["numpy", "numba", "cupy"]
DTYPES = ["float32", "float16"]
PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128

QUICK_ENV = "PAGEDKV_ASV_QUICK"

_memo: dict[Any, Any] = {}


def quick() -> bool:
    """Whether this is a smoke run: :data:`QUICK_ENV` set to anything but
    ``""`` or ``"0"`` (``.ci/run`` sets it for ``.ci/bench_smoke.sh``, which
    runs ``asv run --quick``)."""
    return os.environ.get(QUICK_ENV, "") not in ("", "0")


def sizes(values: list) -> list:
    """A size parameter's values; in a smoke run (:func:`quick`) the first
    (smallest) only: the run checks that each benchmark runs on every
    backend, dtype and layout, and each size would be one more process
    (the NumPy reference takes seconds a call at the largest)."""
    return values[:1] if quick() else values


def _preimport_numba() -> None:
    """Import Numba and the Numba backend in the process asv forks every
    benchmark process from (``"launch_method": "forkserver"``): each fork
    would otherwise import them again, 1-2 s of a 2-core machine per
    process. No kernel runs, so Numba's threads do not start before the
    fork."""
    from pagedkv_np import BackendUnavailable, get_backend

    try:
        get_backend("numba")
    except BackendUnavailable:
        pass


_preimport_numba()


def memo(key: Any, build: Callable[[], Any]) -> Any:
    """``build()`` the first time ``key`` is asked for in this process, the
    same object afterwards. Holds one entry: asv runs one parameter
    combination per process, and big stores must not pile up."""
    if key not in _memo:
        _memo.clear()
        _memo[key] = build()
    return _memo[key]


def backend_or_skip(name: str):
    """The backend called ``name``; ``NotImplementedError`` (asv: skipped)
    when it is unavailable here."""
    from pagedkv_np import BackendUnavailable, get_backend

    try:
        return get_backend(name)
    except BackendUnavailable as exc:
        raise NotImplementedError(str(exc)) from None


def is_host(backend) -> bool:
    return all(issubclass(t, np.ndarray) for t in backend.array_types)


def with_sync(backend, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` followed by a wait for a device backend's queued work."""
    if is_host(backend):
        return fn
    sync = getattr(backend, "synchronize", None)
    if sync is None:
        import cupy

        sync = cupy.cuda.get_current_stream().synchronize

    def run():
        fn()
        sync()

    return run


def best_times(fns: list[Callable[[], Any]], repeat: int = 3,
               min_time: float = 0.02) -> list[float]:
    """Best seconds per call of each function, samples interleaved so that
    an operation and its baseline see the same machine load. In a smoke run
    (:func:`quick`), one call of each, not warmed up."""
    smoke = quick()
    if smoke:
        repeat, min_time = 1, 0.0
    numbers, best = [], []
    for fn in fns:
        if not smoke:
            fn()  # warm-up
        number = 1
        while True:
            start = time.perf_counter()
            for _ in range(number):
                fn()
            elapsed = time.perf_counter() - start
            if elapsed >= min_time or number >= 1 << 22:
                break
            number *= max(2, min(100, int(min_time * 1.2 / max(elapsed, 1e-9))))
        numbers.append(number)
        best.append(elapsed / number)
    for _ in range(repeat - 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(numbers[i]):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / numbers[i])
    return best


def _page_offset_array(nbytes: int, offset: int) -> np.ndarray:
    buf = np.empty(nbytes + 8192, dtype=np.uint8)
    start = (-buf.ctypes.data) % 4096 + offset
    return buf[start:start + nbytes]


def copy_half_bytes(nbytes: int) -> int:
    """Bytes a plain copy for a move of ``nbytes`` reads (and writes): half
    of them; at most 64 MiB in a smoke run (:func:`quick`), which would
    otherwise fill two half-GiB buffers in each process of a 32x2048 int8
    move."""
    half = max(nbytes // 2, 64)
    return min(half, 64 << 20) if quick() else half


def copy_fns(nbytes: int, backend=None) -> list[Callable[[], None]]:
    """Plain copies that read ``nbytes / 2`` and write ``nbytes / 2``: one
    and two host threads (NumPy releases the GIL while copying), or one
    device copy for a device backend."""
    half = copy_half_bytes(nbytes)
    if backend is not None and not is_host(backend):
        src, dst = backend.zeros((half,), np.uint8), backend.zeros((half,), np.uint8)

        def device_copy():
            dst[...] = src

        return [with_sync(backend, device_copy)]
    # Half a page apart: glibc's memcpy on some AMD CPUs is 10x slower when
    # dst lies just after src modulo 4096, as two fresh allocations do.
    src, dst = _page_offset_array(half, 0), _page_offset_array(half, 2048)
    src.fill(1)
    dst.fill(2)
    mid = half // 2 // 64 * 64
    pool = ThreadPoolExecutor(max_workers=1)

    def one_thread():
        np.copyto(dst, src)

    def two_threads():
        done = pool.submit(np.copyto, dst[mid:], src[mid:])
        np.copyto(dst[:mid], src[:mid])
        done.result()

    return [one_thread, two_threads]


def bandwidth(run: Callable[[], Any], nbytes: int, backend=None) -> tuple[float, float]:
    """(GB/s of ``run``, GB/s of the best plain copy of the same bytes),
    both counting bytes read plus bytes written, measured side by side."""
    copies = copy_fns(nbytes, backend)
    times = best_times([run] + copies)
    copied = 2 * copy_half_bytes(nbytes)
    return nbytes / times[0] / 1e9, copied / min(times[1:]) / 1e9


class MoveCase(abc.ABC):
    """A data move, built once per process and warmed up (JIT compilation
    and first-touch page faults stay out of the timings; not in a smoke
    run, see :func:`quick`), timed by the
    subclass's ``time_*`` method and compared with a plain copy of the same
    bytes (``track_ratio_to_copy``).

    A subclass gives ``params``, ``param_names`` (the backend name first)
    and ``build(backend, *params) -> (run, nbytes, backend)``, where ``run``
    is one synchronised call and ``nbytes`` the bytes it reads plus writes.
    Abstract, so that asv does not take the base class for a benchmark.
    """

    # One call per sample under recent asv_runner: take more samples than
    # asv's default 10, within 2 s.
    repeat: Any = (10, 200, 2.0)

    @staticmethod
    @abc.abstractmethod
    def build(backend, *params) -> tuple[Callable[[], Any], int, Any]:
        """``(run, nbytes, backend)`` of one parameter combination."""

    def setup(self, backend_name, *params):
        backend = backend_or_skip(backend_name)

        def build_and_warm_up():
            case = self.build(backend, *params)
            if not quick():
                case[0]()
            return case

        key = (type(self).__name__, backend_name) + params
        self.run, self.nbytes, self.backend = memo(key, build_and_warm_up)

    def track_ratio_to_copy(self, *params):
        gbps, copy_gbps = bandwidth(self.run, self.nbytes, self.backend)
        return gbps / copy_gbps

    track_ratio_to_copy.unit = "ratio"
