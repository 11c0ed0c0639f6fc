"""One thread budget for onnxruntime's sessions and the cache's Numba kernels.

An engine step runs the model (onnxruntime's intra-op threads), then moves
K/V between the model's buffers and the pages (the Numba kernels, which split
moves of :data:`~pagedkv_np.backends.numba_cpu.PARALLEL_MIN_BYTES` or more
over Numba's threads). Left to their defaults, the two pools each take one
thread per core, and onnxruntime's idle threads spin-wait after every run:
the kernels' threads then wait for cores that spinning threads hold. A
:class:`ThreadBudget` gives both pools their share of the same cores:

* ``threads`` intra-op threads for onnxruntime (one inter-op thread: the
  engine's graphs run sequentially), spinning as ``spin`` says;
* ``kernel_threads`` Numba threads for the kernels the engine calls, set in
  the engine's own thread for the duration of its call and restored after
  (``numba.set_num_threads`` is per calling thread, so other threads, and the
  caller's own setting outside the engine, never change).

:func:`thread_budget` resolves the measured policy (``scripts/bench_threads.py``,
README "Threads"): onnxruntime gets every core the process may run on, its
idle threads spin for at most :data:`DEFAULT_SPIN_US` microseconds before
they sleep, and the kernels run serially while a model holds the cores.

This module imports neither onnxruntime nor Numba until a method needs it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import statistics
from collections.abc import Iterator
from typing import Any

from .errors import ConfigError, DTypeError
from .checks import is_int

__all__ = ["SPIN_KEY", "SPIN_US_KEY", "DEFAULT_GOMP_SPINCOUNT", "StepThreads", "ThreadBudget",
           "available_cores", "openmp_defaults", "thread_budget"]

#: The onnxruntime session config entry that lets idle intra-op threads spin.
SPIN_KEY = "session.intra_op.allow_spinning"

#: The onnxruntime session config entry (1.21 and later) that bounds how long
#: an idle intra-op thread spins before it sleeps, in microseconds.
SPIN_US_KEY = "session.intra_op.spin_duration_us"

#: Whether onnxruntime's idle threads spin under :func:`thread_budget`'s
#: policy: yes, for at most :data:`DEFAULT_SPIN_US`. Unbounded spinning
#: decoded one request at 89-96 tokens/s against 68-74 without on a
#: near-idle 2-core machine, but at 13 against 50 beside two busy processes
#: (README "Threads"): a spin long enough to catch the next operator of a
#: run, and no longer, keeps the first without the second.
DEFAULT_SPIN = True

#: Microseconds an idle intra-op thread spins under the policy: operators of
#: a run follow each other within microseconds; between two runs (Python,
#: sampling, HTTP, other processes) the threads sleep.
DEFAULT_SPIN_US = 50

#: Numba threads for the engine's kernels under :func:`thread_budget`'s policy.
DEFAULT_KERNEL_THREADS = 1


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):   # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def _count(value: Any, name: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if not is_int(value):
        raise DTypeError(f"Invalid {name}: expected a positive integer"
                         f"{' or None' if allow_none else ''}, got {type(value).__name__}")
    if int(value) < 1:
        raise ConfigError(f"Invalid {name}: expected a positive integer, got {int(value)}")
    return int(value)


def _flag(value: Any, name: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise DTypeError(f"Invalid {name}: expected True, False or None, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class ThreadBudget:
    """Threads for onnxruntime and for the cache's Numba kernels.

    A field left None leaves that library's own default: ``ThreadBudget()``
    is onnxruntime's and Numba's defaults untouched. :func:`thread_budget`
    gives the resolved policy.

    Parameters
    ----------
    threads : int, optional
        onnxruntime intra-op threads (the calling thread included); with it,
        one inter-op thread. None: onnxruntime's choice (one per physical
        core) and its inter-op default.
    spin : bool, optional
        Whether idle intra-op threads spin-wait for work. None: onnxruntime's
        default (they spin).
    spin_us : int, optional
        With ``spin``, the most microseconds an idle thread spins before it
        sleeps (:data:`SPIN_US_KEY`). None: onnxruntime's own spin.
    kernel_threads : int, optional
        Numba threads for the kernels the engine calls, capped at Numba's pool
        size (``NUMBA_NUM_THREADS``); with fewer than 2 the kernels run
        serially. None: the calling thread's Numba setting as it is.

    Raises
    ------
    DTypeError
        A field of the wrong type.
    ConfigError
        A count below 1, or ``spin_us`` without ``spin``.
    """

    threads: int | None = None
    spin: bool | None = None
    kernel_threads: int | None = None
    spin_us: int | None = None

    def __post_init__(self) -> None:
        _count(self.threads, "threads")
        _flag(self.spin, "spin")
        _count(self.kernel_threads, "kernel_threads")
        _count(self.spin_us, "spin_us")
        if self.spin_us is not None and self.spin is False:
            raise ConfigError("Invalid spin_us: idle threads that do not spin have no spin "
                              "duration; give spin=True or None with it")

    def session_options(self, options: Any = None) -> Any:
        """onnxruntime ``SessionOptions`` carrying this budget.

        Parameters
        ----------
        options : onnxruntime.SessionOptions, optional
            Returned unchanged when given: options of the caller's own are
            never edited behind its back.
        """
        import onnxruntime as ort

        if options is not None:
            return options
        options = ort.SessionOptions()
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        if self.spin is not None:
            options.add_session_config_entry(SPIN_KEY, "1" if self.spin else "0")
        if self.spin_us is not None:
            options.add_session_config_entry(SPIN_US_KEY, str(self.spin_us))
        return options

    def numba_threads(self) -> int | None:
        """The Numba thread count the kernels run with, or None to leave it."""
        if self.kernel_threads is None:
            return None
        import numba

        # set in numba.config's globals at run time, so unknown to mypy
        return min(self.kernel_threads,
                   int(numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def kernels(self) -> Iterator[None]:
        """Run the body with the kernels' Numba thread count in this thread.

        The calling thread's previous count is restored on exit, also when
        the body raises. Nests: an inner use restores the outer one's count.
        """
        want = self.numba_threads()
        if want is None:
            yield
            return
        import numba

        before = numba.get_num_threads()
        if before == want:
            yield
            return
        numba.set_num_threads(want)
        try:
            yield
        finally:
            numba.set_num_threads(before)


def thread_budget(threads: Any = None, spin: Any = None, *,
                  session_options: Any = None) -> ThreadBudget:
    """The policy's budget: ``threads`` cores shared by onnxruntime and the kernels.

    Parameters
    ----------
    threads : int or ThreadBudget, optional
        Cores the engine may use: onnxruntime's intra-op threads. None: the
        cores of this process's affinity (:func:`available_cores`). A
        :class:`ThreadBudget` is returned as it is (then ``spin`` must be None).
    spin : bool, optional
        Let onnxruntime's idle threads spin-wait: True as long as onnxruntime
        does, False never. None: the policy, :data:`DEFAULT_SPIN` for at most
        :data:`DEFAULT_SPIN_US` microseconds.
    session_options : onnxruntime.SessionOptions, optional
        The caller's own options, which onnxruntime then uses as they are:
        ``threads`` (as a count) and ``spin`` must be None with them, since
        they would change nothing there; the kernels still follow the policy
        (or the fields of a ThreadBudget given as ``threads``).

    Returns
    -------
    ThreadBudget
        ``threads`` intra-op threads, spinning as resolved, and
        :data:`DEFAULT_KERNEL_THREADS` Numba threads for the kernels: the
        engine's kernels run between model runs, never beside one, and on a
        shared machine waking Numba's pool cost more than it gained (2 busy
        cores, cached-prefix admission of SmolLM2: 68 ms serial, 635 ms with
        the pool and spinning off).

    Raises
    ------
    DTypeError
        ``threads`` not an integer, ThreadBudget or None; ``spin`` not a bool
        or None.
    ConfigError
        ``threads`` below 1, a ThreadBudget given together with ``spin``, or
        a count or ``spin`` given together with ``session_options``.
    """
    if session_options is not None and not isinstance(threads, ThreadBudget) \
            and (threads is not None or spin is not None):
        _count(threads, "threads")
        _flag(spin, "spin")
        raise ConfigError("Invalid threads/spin: session_options are used as they are; set "
                          "intra_op_num_threads and session.intra_op.allow_spinning there, "
                          "or pass threads/spin without session_options")
    if isinstance(threads, ThreadBudget):
        _flag(spin, "spin")
        if spin is not None:
            raise ConfigError("Invalid spin: a ThreadBudget already says whether threads "
                              "spin; give one or the other")
        return threads
    count = _count(threads, "threads")
    flag = _flag(spin, "spin")
    return ThreadBudget(threads=available_cores() if count is None else count,
                        spin=DEFAULT_SPIN if flag is None else flag,
                        kernel_threads=DEFAULT_KERNEL_THREADS,
                        spin_us=DEFAULT_SPIN_US if flag is None and DEFAULT_SPIN else None)


#: Spins (``GOMP_SPINCOUNT``) of an idle OpenMP thread before it sleeps, when
#: Numba runs its parallel kernels on GNU OpenMP and the user set neither
#: ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY``: libgomp's own 300,000 (about
#: a millisecond) made every parallel region beside two busy processes wait
#: ~5 ms for a thread that spun on a core it shared (20 tiny regions: 99 ms
#: median at load 5 on this 2-core machine; 1,000 spins: 8 ms; passive
#: threads: 5 ms; Numba's workqueue layer: 8 ms); a thousand spins (tens of
#: microseconds) still catch the next region of a step.
DEFAULT_GOMP_SPINCOUNT = 30000


def openmp_defaults() -> None:
    """Give GNU OpenMP this package's spin bound (:data:`DEFAULT_GOMP_SPINCOUNT`)
    unless the environment says otherwise. libgomp reads it when it loads,
    which Numba does at its first parallel kernel: called before the
    package's kernels are compiled, it has no effect if the process loaded
    libgomp earlier."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(DEFAULT_GOMP_SPINCOUNT)


class StepThreads:
    """The Numba thread count for each step of a loop, chosen by how fast
    recent steps ran with each.

    On a quiet machine every thread helps a step; beside busy processes a
    step split over threads waits at each parallel region for a thread that
    lost its core (a scheduler slice, milliseconds, against regions of tens
    of microseconds), and one thread is faster. Neither is known ahead, and
    the load changes. A step size (e.g. the batch) not seen yet starts on
    the count last chosen for any size (at first all of them); :meth:`pick`
    keeps a count for a size until the other one's recent time (the median
    of its last :attr:`WINDOW` steps) is lower by :attr:`MARGIN`. After a
    size's first ``2 * WINDOW`` steps (the first ones touch new buffers and
    run slow) it times :attr:`WINDOW` on the other count, once (beside two
    busy loops from the start, SmolLM2's int8 steps ran 7-21 tok/s on 2
    threads that were never questioned, against 30-34 on one). It tries the
    other count again

    * while on fewer threads, every ``probe_every`` steps, so that the end
      of a load is seen;
    * while on every thread, when the recent time has grown by
      :attr:`SLOWDOWN` over the best seen since the last try (load arrived),
      and otherwise every ``probe_every * QUIET_PROBES`` steps; such a try
      is :attr:`WINDOW` steps in a row, timed afresh.

    So a quiet machine pays for a slow try once in hundreds of steps, not
    once in ``probe_every``, and a batch of a new size does not start with
    one-thread steps (SmolLM2, int8 steps: a one-thread step takes 1.3-1.8x
    a two-thread one). Kernels whose results do not depend on the thread
    count (those of the engine's own decode step) give the same numbers
    either way.

    Parameters
    ----------
    most : int
        The thread count on a quiet machine (1: always 1).
    probe_every : int
        Steps between two tries of the count that is not the current choice.
    adaptive : bool
        False: every step takes ``most`` threads (for measuring the choice).
    """

    #: a count's recent time: the median of its last this many steps, so that
    #: one slow step (a VM's hiccup of tens of milliseconds) changes nothing
    WINDOW = 3
    #: how much faster (a fraction) the other count's recent time must be
    #: before the choice changes: a VM's step times wander by several percent
    #: from step to step, and each change costs a probe's worth of slow steps
    MARGIN = 0.1
    #: how much slower (a fraction) than its best since the last try the
    #: recent time on every thread must get before fewer threads are tried
    #: (beside two busy loops a two-thread step takes 2-4x its quiet time;
    #: a longer past adds a few percent per hundred tokens)
    SLOWDOWN = 0.3
    #: on every thread with no slowdown, a try (WINDOW steps) every this many
    #: ``probe_every`` steps
    QUIET_PROBES = 16

    def __init__(self, most: int, probe_every: int = 32, adaptive: bool = True) -> None:
        self.most = _count(most, "most", allow_none=False) or 1
        self.probe_every = _count(probe_every, "probe_every", allow_none=False) or 1
        if not isinstance(adaptive, bool):
            raise DTypeError(f"Invalid adaptive: expected True or False, got "
                             f"{type(adaptive).__name__}")
        self.counts = (self.most, 1) if self.most > 1 and adaptive else (self.most,)
        self._times: dict[tuple[int, int], collections.deque] = {}
        self._choice: dict[int, int] = {}
        self._floor: dict[int, float] = {}       # size -> best recent time on every thread
        self._trying: dict[int, int] = {}        # size -> steps left of a try of the other
        self._seen: dict[int, int] = {}          # size -> steps before its first comparison
        self._last = self.most                   # where a size not seen yet starts
        self._steps = 0

    def _recent(self, size: int, n: int) -> float:
        return statistics.median(self._times[(size, n)])

    def pick(self, size: int) -> int:
        """The thread count for the next step of ``size`` (e.g. its batch)."""
        self._steps += 1
        if len(self.counts) == 1:
            return self.counts[0]
        best = self._choice.setdefault(size, self._last)
        other = next(n for n in self.counts if n != best)
        if self._trying.get(size, 0) > 0:
            self._trying[size] -= 1
            return other
        mine = self._times.get((size, best), ())
        if len(mine) < self.WINDOW:
            return best
        if (size, other) not in self._times:
            # the first comparison for this size, once its first WINDOW steps
            # (first touches of new buffers) have left the window: WINDOW steps
            # on the other count, so that a machine busy from the start is seen
            seen = self._seen[size] = self._seen.get(size, 0) + 1
            if seen > self.WINDOW:
                self._trying[size] = self.WINDOW - 1
                return other
        theirs = self._times.get((size, other), ())
        if len(theirs) == self.WINDOW and \
                statistics.median(theirs) < (1 - self.MARGIN) * statistics.median(mine):
            best = self._choice[size] = self._last = other
            self._floor.pop(size, None)
            return best
        if best != self.most:
            return other if self._steps % self.probe_every == 0 else best
        recent = statistics.median(mine)
        floor = self._floor[size] = min(self._floor.get(size, recent), recent)
        if recent > (1 + self.SLOWDOWN) * floor or \
                self._steps % (self.probe_every * self.QUIET_PROBES) == 0:
            # load arrived, or a rare check: WINDOW steps on the other, timed afresh
            self._times.pop((size, other), None)
            self._trying[size] = self.WINDOW - 1
            self._floor[size] = recent
            return other
        return best

    def forget(self) -> None:
        """Drop the times recorded so far (after a warm-up that compiled)."""
        self._times.clear()
        self._choice.clear()
        self._floor.clear()
        self._trying.clear()
        self._seen.clear()
        self._last = self.most

    def record(self, size: int, threads: int, seconds: float) -> None:
        """How long a step of ``size`` took with ``threads`` (the last
        :attr:`WINDOW` count; a probe's time joins the other count's)."""
        key = (size, threads)
        if key not in self._times:
            self._times[key] = collections.deque(maxlen=self.WINDOW)
        self._times[key].append(seconds)
