"""Watch the API server's event loop for stalls.

Every tenant's stream is written by this one event loop, so anything that
holds it (a burst of requests being parsed and admitted, a large response
being serialised, a slow synchronous call) delays every other tenant's
tokens by as much, even with the engine idle. The engine's step loop has
its own log; this makes the API side just as visible: a sleeper task
measures how late each of its wake-ups comes, feeds the lateness into a
histogram on ``/metrics`` and logs an ``event_loop_stall`` event line for
any stall over a threshold, timestamped like the pause, load and resume
events beside it.

The garbage collector is timed too (``skyrl_gc_pause_seconds``, a
``gc_pause`` event per long collection): a full collection of the API
process stops every thread of it (on the H100 under load, up to 15 ms at
3 tenants and 53 ms at 8), which reads as a stall of the engine to anyone
watching the tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Histogram

from skyrl_lora.server.observability import log_event

#: Both histograms time the same kind of thing, a pause of the API process.
_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

EVENT_LOOP_LAG = Histogram(
    "skyrl_event_loop_lag_seconds",
    "How late the API server's event loop ran a task that was due (sampled).",
    buckets=_PAUSE_BUCKETS,
)

GC_PAUSE = Histogram(
    "skyrl_gc_pause_seconds",
    "How long the API server process's garbage collections took, by generation.",
    ["generation"],
    buckets=_PAUSE_BUCKETS,
)


class _GcClock:
    """A ``gc.callbacks`` hook that only times collections.

    It runs inside the collector, on whichever thread triggered it, so it
    does no logging and takes no locks: the watcher reports what it saw.
    """

    def __init__(self) -> None:
        self._started = 0.0
        self._pauses: list[tuple[int, float]] = []

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pauses.append((int(info["generation"]), time.perf_counter() - self._started))

    def drain(self) -> list[tuple[int, float]]:
        """The (generation, seconds) of each collection since the last drain."""
        pauses, self._pauses = self._pauses, []
        return pauses


@dataclass(frozen=True)
class LoopMonitorConfig:
    """``interval_s``: time between samples (each costs one wake-up of the
    loop); ``report_over_s``: a stall longer than this is logged as an event."""

    interval_s: float = 0.005
    report_over_s: float = 0.01


async def watch(config: LoopMonitorConfig = LoopMonitorConfig()) -> None:
    """Sample the loop's lateness, and report collections, until cancelled."""
    loop = asyncio.get_running_loop()
    collections = _GcClock()
    gc.callbacks.append(collections)
    try:
        while True:
            due = loop.time() + config.interval_s
            await asyncio.sleep(config.interval_s)
            lag = max(0.0, loop.time() - due)
            EVENT_LOOP_LAG.observe(lag)
            if lag > config.report_over_s:
                log_event("event_loop_stall", ms=round(lag * 1000, 1))
            for generation, pause in collections.drain():
                GC_PAUSE.labels(str(generation)).observe(pause)
                if pause > config.report_over_s:
                    log_event("gc_pause", generation=generation, ms=round(pause * 1000, 1))
    finally:
        gc.callbacks.remove(collections)


@contextlib.asynccontextmanager
async def monitoring(config: LoopMonitorConfig = LoopMonitorConfig()) -> AsyncIterator[None]:
    """Run :func:`watch` for the duration of the block."""
    task = asyncio.create_task(watch(config), name="skyrl-lora-loop-monitor")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
