"""The threads that do the tiers' I/O: a bounded write queue, and a reader.

Writes never run in the caller's thread: :meth:`WriteQueue.submit` only
appends to a bounded queue and returns False when it is full (the caller
counts a drop), and one daemon thread drains it in batches. A slow or dead
tier therefore costs dropped pages, never a slower decode step.

Reads run in a :class:`Reader`'s thread while the caller waits for them
with a deadline, so a read that hangs (a dead network file system, a Redis
server that stopped answering) holds its caller, who holds the cache's
lock, no longer than that deadline.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any
from collections.abc import Callable

__all__ = ["WriteQueue", "Reader", "ReaderBusy"]


class WriteQueue:
    """A bounded FIFO drained by one thread into ``handler(batch)``.

    Parameters
    ----------
    maxsize : int
        Items held at most; :meth:`submit` refuses more.
    handler : callable
        Called with a list of up to ``batch_size`` items, in the worker
        thread; an exception it raises is swallowed (the handler counts it).
    """

    def __init__(self, maxsize: int, handler: Callable[[list], None],
                 batch_size: int = 16, name: str = "pagedkv-tier-writer") -> None:
        self.maxsize = maxsize
        self.batch_size = batch_size
        self._handler = handler
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> bool:
        """Queue ``item``; False (nothing queued) when the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._items) >= self.maxsize:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def __len__(self) -> int:
        return len(self._items)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued item is handled; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float | None = 5.0) -> None:
        """Handle what is queued (up to ``timeout``), then stop the thread.

        Called from the worker thread itself (a cache collected there), it
        stops without waiting for the batch it is handling.
        """
        if self._thread is not threading.current_thread():
            self.flush(timeout)
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = [self._items.popleft()
                         for _ in range(min(self.batch_size, len(self._items)))]
                self._busy = True
            try:
                self._handler(batch)
            except Exception:   # the handler counts its own failures
                pass
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class ReaderBusy(TimeoutError):
    """The reader is still in an earlier call that ran past its deadline."""


class _Call:
    __slots__ = ("fn", "args", "started", "done", "result", "error")

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.started = self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class Reader:
    """One daemon thread that runs calls for callers who wait a bounded time.

    Invariant: at most one call is given to the thread at a time, from when
    :meth:`call` hands it over until it returns. A caller whose deadline
    passes goes on without the result; the thread stays with the call, and
    until it returns every later :meth:`call` is refused at once
    (:class:`ReaderBusy`) rather than queued behind a call that may never
    end, so a hung tier never holds a caller more than one deadline and
    never piles up threads.
    """

    def __init__(self, name: str = "pagedkv-tier-reader") -> None:
        self._cond = threading.Condition()
        self._call: _Call | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args: Any, timeout: float) -> Any:
        """``fn(*args)`` in the reader's thread, waiting ``timeout`` seconds at most.

        Raises
        ------
        ReaderBusy
            An earlier call has not returned (nothing was run), or the
            reader is closed.
        TimeoutError
            ``fn`` did not return in time (its result is dropped).
        Exception
            Whatever ``fn`` raised.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed or self._call is not None:
                raise ReaderBusy("the tier reader is busy with a call past its deadline"
                                 if not self._closed else "the tier reader is closed")
            call = self._call = _Call(fn, args)
            self._cond.notify_all()
            while not call.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    if not call.started:      # never ran: nothing to wait for
                        self._call = None
                    raise TimeoutError(f"a tier read took more than {timeout:.3g} s")
                self._cond.wait(left)
        if call.error is not None:
            raise call.error
        return call.result

    def close(self) -> None:
        """Stop the thread once its call (if any) returns; later calls are refused."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._call is None or self._call.started):
                    self._cond.wait()
                call = self._call
                if self._closed or call is None:
                    return
                call.started = True
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:   # handed to the caller, if it still waits
                call.error = exc
            with self._cond:
                call.done = True
                self._call = None
                self._cond.notify_all()
