"""The bounded background queue that writes pages to the tiers.

Writes never run in the caller's thread: :meth:`WriteQueue.submit` only
appends to a bounded queue and returns False when it is full (the caller
counts a drop), and one daemon thread drains it in batches. A slow or dead
tier therefore costs dropped pages, never a slower decode step.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any
from collections.abc import Callable

__all__ = ["WriteQueue"]


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
