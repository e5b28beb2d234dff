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
    def __init__(self) -> None:
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
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that loop is closed; nobody is waiting there any more
                pass

    def is_closed(self, lora_name: str) -> bool:
        with self._lock:
            return lora_name in self._closed

    async def wait_open(self, lora_name: str) -> None:
        """Return at once if the gate is open, else when :meth:`open` is called."""
        loop = asyncio.get_running_loop()
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
