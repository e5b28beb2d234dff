"""vLLM's global keep-mode pause, held by named callers and released by the last.

Two trainers that both pause the whole engine (each for a full fine-tune
sync, say) must not release each other's pause: with one flag, the first
``resume`` let requests run again while the second trainer was still
writing weights. Each pause names its holder (the client sends an id of its
own; callers that name none share one anonymous holder); the engine is
paused by the first holder and resumed when the last one resumes. A resume
that names no holder releases every hold and resumes the engine: the
behaviour callers without holders always had, and the operator's way out
when a holder died holding the pause. The engine calls are passed in, so the
bookkeeping is tested without vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

#: The holder of callers that name none: they all share it, as before holders existed.
ANONYMOUS = "anonymous"


class GlobalPause:
    def __init__(
        self,
        pause_engine: Callable[[], Awaitable[None]],
        resume_engine: Callable[[], Awaitable[None]],
    ) -> None:
        self._pause_engine = pause_engine
        self._resume_engine = resume_engine
        self._holders: set[str] = set()
        self._lock = asyncio.Lock()

    @property
    def holders(self) -> int:
        return len(self._holders)

    async def pause(self, holder: str | None) -> bool:
        """Hold the pause for ``holder``; returns whether the engine was paused already."""
        async with self._lock:
            was_paused = bool(self._holders)
            self._holders.add(holder or ANONYMOUS)
            if not was_paused:
                await self._pause_engine()
            return was_paused

    async def resume(self, holder: str | None) -> bool:
        """Release ``holder``'s pause (every hold when None); the engine resumes
        once nobody holds it. Returns whether the engine is still paused."""
        async with self._lock:
            if holder is None:
                self._holders.clear()
            else:
                self._holders.discard(holder)
            if not self._holders:
                await self._resume_engine()
            return bool(self._holders)
