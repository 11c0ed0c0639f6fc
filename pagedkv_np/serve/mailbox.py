"""Carrying the engine thread's updates onto the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from .engine_loop import Update

__all__ = ["Mailbox"]


class Mailbox:
    """Carries the engine thread's updates onto the event loop.

    One step updates every running request; a ``call_soon_threadsafe`` per
    update would wake the loop (a write to its self-pipe) that many times.
    Updates posted while a delivery is pending join it: one wake-up per burst.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Update]] = []   # guarded by _lock
        self._scheduled = False                                # guarded by _lock

    def post(self, queue: asyncio.Queue, update: Update) -> None:
        """Queue ``update`` for ``queue`` (any thread)."""
        with self._lock:
            self._items.append((queue, update))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:   # the event loop has closed: nobody is listening
            pass

    def post_choice(self, queue: asyncio.Queue, index: int, update: Update) -> None:
        """:meth:`post` ``update`` marked as choice ``index`` of its request."""
        self.post(queue, dataclasses.replace(update, index=index) if index else update)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for queue, update in items:
            queue.put_nowait(update)
