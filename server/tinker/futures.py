"""The bounded store of Tinker futures: one per ``asample``, fetched by id.

A sample runs as a task of its own, so a client whose connection drops loses
nothing (its next ``retrieve_future`` finds the result), and no client's
disconnect touches anyone else's work. Memory is bounded three ways: a
finished result nobody fetched expires after ``ttl_s``, a fetched one after
``retrieved_ttl_s`` (kept a little so a retrieve whose answer was lost on the
way can be repeated), and each key holds at most ``max_per_key`` unfetched
futures: beyond that ``asample`` answers 429, which the SDK reads as "back
off and resend".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from skyrl_lora.errors import ServerError

from .wire import ErrorCategory, TinkerError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FutureLimits:
    ttl_s: float = 600.0
    retrieved_ttl_s: float = 60.0
    max_per_key: int = 1024
    #: How long one ``retrieve_future`` waits for the result before answering
    #: ``try_again`` (the SDK polls again at once, so waiting saves round trips).
    long_poll_s: float = 10.0


@dataclass
class Failure:
    message: str
    category: ErrorCategory


@dataclass
class TinkerFuture:
    request_id: str
    owner: str | None
    queue_state: Callable[[], str]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: bytes | None = None
    failure: Failure | None = None
    finished_at: float | None = None
    retrieved_at: float | None = None
    task: asyncio.Task[None] | None = None

    def expires_at(self, limits: FutureLimits) -> float | None:
        if self.retrieved_at is not None:
            return self.retrieved_at + limits.retrieved_ttl_s
        if self.finished_at is not None:
            return self.finished_at + limits.ttl_s
        return None  # still running


class FutureStore:
    def __init__(self, limits: FutureLimits = FutureLimits()) -> None:
        self.limits = limits
        self._futures: dict[str, TinkerFuture] = {}
        self._unfetched: Counter[str | None] = Counter()
        self._next_sweep = 0.0
        self._stopping = False

    def __len__(self) -> int:
        return len(self._futures)

    def submit(
        self,
        owner: str | None,
        work: Callable[[], Coroutine[Any, Any, bytes]],
        queue_state: Callable[[], str],
    ) -> TinkerFuture:
        """Start ``work`` as a future of ``owner``'s, or refuse with 429 at the cap."""
        if self._stopping:
            raise TinkerError("the server is stopping", status=503, category="server")
        self.sweep()
        unfetched = self._unfetched[owner]
        if unfetched >= self.limits.max_per_key:
            raise TinkerError(
                f"this key holds {unfetched} unfetched sample results (the cap is "
                f"{self.limits.max_per_key}); fetch them or wait",
                status=429,
            )
        future = TinkerFuture(f"skyrl-future-{uuid.uuid4().hex}", owner, queue_state)
        future.task = asyncio.create_task(self._run(future, work))
        self._futures[future.request_id] = future
        self._unfetched[owner] += 1
        return future

    def get(self, request_id: str, owner: str | None, admin: bool = False) -> TinkerFuture:
        """The future, or 410 ("resend") when it is unknown, expired or another key's."""
        future = self._futures.get(request_id)
        if future is None or not (admin or future.owner is None or future.owner == owner):
            raise TinkerError(
                f"no sample {request_id!r} here (expired, or the server restarted): resend it",
                status=410,
            )
        return future

    async def wait(self, future: TinkerFuture) -> None:
        """Wait up to ``long_poll_s`` for the result, returning early when the
        future's queue state changes (so the SDK hears of a pause)."""
        state = future.queue_state()
        deadline = time.monotonic() + self.limits.long_poll_s
        while not future.done.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or future.queue_state() != state:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(future.done.wait(), timeout=min(left, 0.25))

    def mark_retrieved(self, future: TinkerFuture) -> None:
        if future.retrieved_at is None:
            future.retrieved_at = time.monotonic()
            self._unfetched[future.owner] -= 1

    def cancel(self, future: TinkerFuture) -> None:
        if future.task is not None and not future.task.done():
            future.task.cancel()
        self.mark_retrieved(future)

    def stop(self) -> int:
        """End every running sample (a stopping server): its callers hear so at
        once, and no aborted segment is resubmitted to an engine shutting down.
        Returns how many were running."""
        self._stopping = True
        running = [f.task for f in self._futures.values() if f.task and not f.task.done()]
        for task in running:
            task.cancel()
        return len(running)

    def sweep(self) -> None:
        """Drop expired futures (at most once a second: it walks them all)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        expired = [
            rid
            for rid, f in self._futures.items()
            if (at := f.expires_at(self.limits)) is not None and at <= now
        ]
        for rid in expired:
            future = self._futures.pop(rid)
            if future.retrieved_at is None:
                self._unfetched[future.owner] -= 1
        self._unfetched = +self._unfetched  # drop the zero counts

    async def _run(
        self, future: TinkerFuture, work: Callable[[], Coroutine[Any, Any, bytes]]
    ) -> None:
        try:
            future.result = await work()
        except asyncio.CancelledError:
            if self._stopping:
                future.failure = Failure("the server stopped before the sample finished", "server")
            else:
                future.failure = Failure("the sample was cancelled", "user")
        except TinkerError as exc:
            future.failure = Failure(exc.message, exc.category)
        except ServerError as exc:
            category: ErrorCategory = "user" if exc.status < 500 else "server"
            future.failure = Failure(exc.message, category)
        except Exception as exc:
            logger.exception("Tinker sample %s failed", future.request_id)
            future.failure = Failure(
                f"internal server error: {type(exc).__name__}: {exc}", "server"
            )
        finally:
            future.finished_at = time.monotonic()
            future.done.set()
