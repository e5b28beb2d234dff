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

A stall's length says that the loop was held, not by what. With
``stall_stacks`` (``serve --stall-stacks``) a thread looks at the loop
thread's Python stack every millisecond while the loop is late, and the
stall's event carries the stacks seen most often: a profile of exactly the
moments a user would notice, which a sampling profiler of the whole run
drowns in the loop's ordinary work. The sampler needs the GIL to look, so
it sees the loop where the loop lets the GIL go: inside a blocking call (a
``time.sleep``, a socket write) or at a forced switch of a long stretch of
Python. A stall made of many short steps therefore shows its I/O calls more
often than its Python work; read the stacks as "what the loop was busy
with", not as a profile weighted by time. It is off by default: the sampler
takes the GIL for a moment at every look, and under load the loop waits for
it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from prometheus_client import Histogram

from .observability import log_engine_event, log_event

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


class GcWatcher:
    """Reports a process's long collections from a thread of its own, for a
    process with no event loop of ours: vLLM's engine process, where a
    collection holds the step loop, so every tenant's next token, as long.

    ``report(generation, seconds)`` is called, on the watcher's thread, for
    each collection over ``over_s``, within ``every_s`` of its end. One
    wake-up every ``every_s``: the step loop does not notice.
    """

    def __init__(
        self, report: Callable[[int, float], None], over_s: float = 0.005, every_s: float = 0.5
    ) -> None:
        self._clock = _GcClock()
        self._report = report
        self._over_s = over_s
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="skyrl-lora-gc", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._clock)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._clock)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        for generation, pause in self._clock.drain():
            if pause > self._over_s:
                self._report(generation, pause)


_engine_gc_watcher: GcWatcher | None = None


def watch_engine_collections() -> None:
    """Log vLLM's engine process's collections over 5 ms as ``engine_gc_pause``
    events (once per process; the staging extension calls it there, the one
    place of ours that runs in that process)."""
    global _engine_gc_watcher
    if _engine_gc_watcher is None:
        _engine_gc_watcher = GcWatcher(
            lambda generation, pause: log_engine_event(
                "engine_gc_pause", generation=generation, ms=round(pause * 1000, 1)
            )
        )
        _engine_gc_watcher.start()


@dataclass(frozen=True)
class LoopMonitorConfig:
    """``interval_s``: time between samples (each costs one wake-up of the
    loop); ``report_over_s``: a stall longer than this is logged as an event;
    ``stall_stacks``: sample the loop thread's stack while it is late
    (:class:`StallStacks`), every ``stack_every_s``.

    A stall reads as up to ``interval_s`` shorter than it was (it may begin
    just after a wake-up), so at 5 ms every stall over 15 ms is reported.
    Each wake-up costs the process about 0.15 ms of CPU on the 2-core CPU
    machine, most of it the kernel's timer and ``epoll`` wake-up, so at 5 ms
    the monitor takes about 3% of a core from an idle server (uvloop, main
    b73e51b, 2026-11-29: 2.7-3.2% with a timer callback a wake-up, as
    :func:`watch` samples; 3.4-4.0% when a task slept between samples). A
    coarser interval costs less but misses more: at 20 ms a 25 ms stall
    would go unreported one time in four."""

    interval_s: float = 0.005
    report_over_s: float = 0.01
    stall_stacks: bool = False
    stack_every_s: float = 0.001


#: Frames kept of each sampled stack, innermost last: enough to see the
#: caller of the slow call without printing the whole uvicorn/asyncio spine.
STACK_DEPTH = 10


def _frame_line(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"


def stack_of(frame: FrameType | None, depth: int = STACK_DEPTH) -> tuple[str, ...]:
    """The innermost ``depth`` frames of a stack, outermost first."""
    lines: list[str] = []
    while frame is not None and len(lines) < depth:
        lines.append(_frame_line(frame))
        frame = frame.f_back
    return tuple(reversed(lines))


class StallStacks:
    """Samples one thread's stack while its heartbeat is overdue.

    The loop calls :meth:`beat` at every wake-up, which hands it the samples
    since the previous beat; a daemon thread wakes every ``every_s`` and,
    when the last beat is older than ``late_after_s``, records where the
    loop thread is. Only a reported stall's samples are summarised
    (:func:`most_seen`): a wake-up on time costs the loop a list swap.
    """

    def __init__(self, thread_id: int, late_after_s: float, every_s: float) -> None:
        self._thread_id = thread_id
        self._late_after_s = late_after_s
        self._every_s = every_s
        self._last_beat = time.perf_counter()
        self._samples: list[tuple[str, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="skyrl-lora-stall-stacks", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def beat(self) -> list[tuple[str, ...]]:
        """The loop is on time again: the stacks sampled since the last beat."""
        self._last_beat = time.perf_counter()
        samples, self._samples = self._samples, []
        return samples

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            if time.perf_counter() - self._last_beat > self._late_after_s:
                self._samples.append(stack_of(sys._current_frames().get(self._thread_id)))


def most_seen(samples: list[tuple[str, ...]], top: int = 3) -> dict[str, Any]:
    """A stall's samples for its event: how many, and the ``top`` stacks seen
    most often with their counts, most common first."""
    common = collections.Counter(samples).most_common(top)
    return {
        "samples": len(samples),
        "stacks": [{"seen": seen, "stack": list(stack)} for stack, seen in common],
    }


async def watch(config: LoopMonitorConfig = LoopMonitorConfig()) -> None:
    """Sample the loop's lateness, and report collections, until cancelled.

    Each sample is a timer callback that schedules the next (``call_at``):
    its lateness is read as the loop runs the timer, and a wake-up costs
    the loop one callback, not a task's step."""
    loop = asyncio.get_running_loop()
    collector = _GcClock()
    gc.callbacks.append(collector)
    stacks = (
        StallStacks(threading.get_ident(), config.interval_s * 1.5, config.stack_every_s)
        if config.stall_stacks
        else None
    )
    handle: asyncio.TimerHandle | None = None

    def sample(due: float) -> None:
        nonlocal handle
        try:
            lag = max(0.0, loop.time() - due)
            samples = stacks.beat() if stacks is not None else None
            EVENT_LOOP_LAG.observe(lag)
            if lag > config.report_over_s:
                where = most_seen(samples) if samples is not None else {}
                log_event("event_loop_stall", ms=round(lag * 1000, 1), **where)
            for generation, pause in collector.drain():
                GC_PAUSE.labels(str(generation)).observe(pause)
                if pause > config.report_over_s:
                    log_event("gc_pause", generation=generation, ms=round(pause * 1000, 1))
        finally:
            due = loop.time() + config.interval_s
            handle = loop.call_at(due, sample, due)

    if stacks is not None:
        stacks.start()
    try:
        first = loop.time() + config.interval_s
        handle = loop.call_at(first, sample, first)
        await loop.create_future()  # until cancelled
    finally:
        if handle is not None:
            handle.cancel()
        gc.callbacks.remove(collector)
        if stacks is not None:
            stacks.stop()


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
