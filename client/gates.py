"""Per-adapter pause gates that work across threads and event loops.

A trainer may pause an adapter from one thread, sample on another event loop
and resume from a third. ``asyncio.Event`` belongs to one loop and would lose
or misdeliver that wake-up, so the gate keeps its state under a thread lock
and wakes each waiter on the loop that is waiting, with
``call_soon_threadsafe``. The closed check and the waiter registration happen
under the same lock, so an ``open`` can never slip between them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AdapterGates:
    """Per-adapter gates; an opened gate lets its waiters go at a pace.

    ``spacing_s``: the n-th waiter (in the order they came) is let go
    ``n * spacing_s`` after the gate opens, at most ``window_s`` after it.
    A client's retries of a paused adapter all wait here and would otherwise
    reach the server in one burst at the resume: the server then parses and
    validates every one of them at once on the event loop that streams
    every other tenant's tokens, only to hold them at its own paced gate.
    Let go at the server's pace, each arrives when the server admits it.
    A waiter let go after the gate closed again waits again.
    """

    def __init__(self, spacing_s: float = 0.0, window_s: float = 0.0) -> None:
        self._spacing_s = spacing_s
        self._window_s = window_s
        self._lock = threading.Lock()
        self._closed: set[str] = set()
        self._waiters: defaultdict[
            str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]
        ] = defaultdict(list)

    def close(self, lora_name: str) -> None:
        with self._lock:
            self._closed.add(lora_name)

    def open(self, lora_name: str) -> None:
        with self._lock:
            self._closed.discard(lora_name)
            waiters = self._waiters.pop(lora_name, [])
        for place, (loop, future) in enumerate(waiters):
            delay = min(place * self._spacing_s, self._window_s)
            try:
                if delay > 0:
                    loop.call_soon_threadsafe(loop.call_later, delay, _wake, future)
                else:
                    loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that loop is closed; nobody is waiting there any more
                pass

    def is_closed(self, lora_name: str) -> bool:
        with self._lock:
            return lora_name in self._closed

    async def wait_open(self, lora_name: str) -> None:
        """Return at once if the gate is open, else once :meth:`open` lets this waiter go."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if lora_name not in self._closed:
                    return
                future: asyncio.Future[None] = loop.create_future()
                entry = (loop, future)
                self._waiters[lora_name].append(entry)
            try:
                await future
            finally:
                with self._lock:
                    waiters = self._waiters.get(lora_name)
                    if waiters and entry in waiters:
                        waiters.remove(entry)
