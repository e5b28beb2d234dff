"""The API server's event-loop stall monitor, alone.

(``skyrl_lora.server.telemetry.loop_monitor``)
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import threading
import time

import pytest

from skyrl_lora.server.telemetry.loop_monitor import (
    EVENT_LOOP_LAG,
    GC_PAUSE,
    GcWatcher,
    LoopMonitorConfig,
    monitoring,
    stack_of,
)


def _lag_samples() -> float:
    return next(s.value for s in EVENT_LOOP_LAG.collect()[0].samples if s.name.endswith("_count"))


async def test_a_blocked_loop_is_logged_as_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="skyrl_lora.events")
    before = _lag_samples()
    async with monitoring(LoopMonitorConfig(interval_s=0.002, report_over_s=0.03)):
        await asyncio.sleep(0.02)
        time.sleep(0.08)  # noqa: ASYNC251 (the point: a synchronous call holding the loop)
        await asyncio.sleep(0.01)
    stalls = [
        float(r.getMessage().split('"ms": ')[1].rstrip("}"))
        for r in caplog.records
        if "event_loop_stall" in r.getMessage()
    ]
    assert len([ms for ms in stalls if ms >= 60]) == 1  # the blocking call, once
    assert _lag_samples() > before + 3  # every wake-up is sampled


async def test_the_monitor_stops_with_its_block() -> None:
    async with monitoring():
        pass
    await asyncio.sleep(0.01)
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "skyrl-lora-loop-monitor"]


async def test_a_long_collection_is_reported_with_its_generation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="skyrl_lora.events")
    hooks = len(gc.callbacks)
    async with monitoring(LoopMonitorConfig(interval_s=0.002, report_over_s=0.0)):
        await asyncio.sleep(0.01)
        gc.collect()  # a full collection, timed however short it is
        await asyncio.sleep(0.01)
    events = [r.getMessage() for r in caplog.records if '"gc_pause"' in r.getMessage()]
    assert any('"generation": 2' in e for e in events), events
    full = GC_PAUSE.labels("2").collect()[0].samples
    assert next(s.value for s in full if s.name.endswith("_count")) >= 1
    assert len(gc.callbacks) == hooks  # the hook leaves with the monitor


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # the synchronous call a stall's stack must name


async def test_a_stall_names_the_call_that_held_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="skyrl_lora.events")
    config = LoopMonitorConfig(interval_s=0.002, report_over_s=0.03, stall_stacks=True)
    async with monitoring(config):
        await asyncio.sleep(0.02)
        _hold_the_loop(0.08)
        await asyncio.sleep(0.01)
    stalls = [
        json.loads(r.getMessage().split("skyrl_event ", 1)[1])
        for r in caplog.records
        if "event_loop_stall" in r.getMessage()
    ]
    held = [s for s in stalls if s["ms"] >= 60]
    assert len(held) == 1, stalls
    assert held[0]["samples"] >= 20  # sampled every ms for most of the 80 ms
    most_seen = held[0]["stacks"][0]
    assert most_seen["seen"] >= 20
    innermost = most_seen["stack"][-1]
    assert innermost.startswith("test_loop_monitor.py:") and innermost.endswith(" _hold_the_loop")
    assert not [t for t in threading.enumerate() if t.name == "skyrl-lora-stall-stacks"]


def test_stack_of_keeps_the_innermost_frames_outermost_first() -> None:
    def inner() -> tuple[str, ...]:
        return stack_of(sys._getframe(), depth=2)

    stack = inner()
    assert len(stack) == 2
    assert stack[0].endswith(" test_stack_of_keeps_the_innermost_frames_outermost_first")
    assert stack[1].endswith(" inner")


def test_gc_watcher_reports_long_collections_from_its_own_thread() -> None:
    """The engine process's watcher: a full collection over the threshold is
    reported (on the watcher's thread), a threshold above it is not."""
    seen: list[tuple[int, float, str]] = []
    watcher = GcWatcher(
        lambda gen, s: seen.append((gen, s, threading.current_thread().name)),
        over_s=0.0,
        every_s=0.01,
    )
    strict = GcWatcher(lambda gen, s: seen.append((-1, s, "strict")), over_s=60.0, every_s=0.01)
    watcher.start()
    strict.start()
    try:
        garbage = [[i] for i in range(200_000)]
        gc.collect()
        del garbage
        deadline = time.monotonic() + 5
        while not any(gen == 2 for gen, _, _ in seen):
            assert time.monotonic() < deadline, seen
            time.sleep(0.01)
    finally:
        watcher.stop()
        strict.stop()
    assert all(gen >= 0 and thread == "skyrl-lora-gc" for gen, _, thread in seen)
    assert gc.callbacks.count(watcher._clock) == 0
