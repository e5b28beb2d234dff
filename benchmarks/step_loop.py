"""A thread that stands in for vLLM's step loop, for benchmarks of work that
shares the engine process's GIL with it (slot writes, adapter reads).

About 2 ms of scheduling in Python with a small tensor op every few dozen
microseconds, then 4 ms waiting for the device without the GIL. Its
iterations that overlap the measured work are what the other tenants would
feel as a longer inter-token gap.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from benchmarks.stats import Spread, median, percentile


class StepLoopStandIn:
    """A thread that holds the GIL as a step loop does: Python scheduling with
    small tensor ops, then a wait for the device that lets the GIL go."""

    def __init__(self) -> None:
        import torch

        self._small = torch.zeros(64)
        self._stop = threading.Event()
        self.iterations: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            for _ in range(40):  # the scheduler's bookkeeping, input preparation
                queue = {i: i for i in range(100)}
                del queue
                self._small.add_(1)
            time.sleep(0.004)  # the forward on the device: the GIL is let go
            self.iterations.append((started, time.perf_counter()))

    def __enter__(self) -> StepLoopStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def longest_within(self, start: float, end: float) -> float:
        return max(
            ((b - a) * 1000 for a, b in self.iterations if b > start and a < end), default=0.0
        )


@dataclass
class BesideTheLoop:
    """Each method's calls timed beside :class:`StepLoopStandIn`, in rounds.

    Per round and method: the median call time and the stand-in loop's longest
    iteration during the calls; idle: the median call time without the loop;
    and the loop's p99 iteration between calls (what the calls are judged against).
    """

    call_ms: dict[str, list[float]]
    loop_max_ms: dict[str, list[float]]
    idle_ms: dict[str, float]
    loop_outside_p99_ms: float


def round_ratio(values: dict[str, list[float]], method: str, baseline: str) -> Spread:
    """``method`` / ``baseline``, round by round, of per-round figures ``{method: [...]}``."""
    return Spread.of(m / b for b, m in zip(values[baseline], values[method]))


@contextmanager
def staging_switch_interval() -> Iterator[None]:
    """The interpreter's switch interval the server's staging thread runs with."""
    from skyrl_lora.server.loading.staging import STAGING_SWITCH_INTERVAL_S

    previous = sys.getswitchinterval()
    sys.setswitchinterval(STAGING_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def interleaved(
    calls: dict[str, Callable[[], None]], rounds: int, per_round: int, idle: int = 10
) -> BesideTheLoop:
    """Time ``calls`` idle, then beside the stand-in loop, alternating their
    order round by round so neither always follows the other. Each call runs
    once first, untimed (caches, recordings)."""
    methods = list(calls)
    idle_ms = {}
    for method, call in calls.items():
        call()
        idle_ms[method] = median([timed_ms(call) for _ in range(idle)])
    call_ms: dict[str, list[float]] = {m: [] for m in methods}
    #: Each round's call windows by method; the loop's iterations are judged
    #: once it has stopped, so the one still running as a call ends, the
    #: iteration the call stretched most, is counted too.
    round_windows: dict[str, list[list[tuple[float, float]]]] = {m: [] for m in methods}
    with StepLoopStandIn() as loop:
        time.sleep(0.2)
        for round_ in range(rounds):
            for method in methods if round_ % 2 == 0 else methods[::-1]:
                times, spans = [], []
                for _ in range(per_round):
                    time.sleep(0.05)
                    start = time.perf_counter()
                    calls[method]()
                    end = time.perf_counter()
                    spans.append((start, end))
                    times.append((end - start) * 1000)
                call_ms[method].append(median(times))
                round_windows[method].append(spans)
    loop_max_ms = {
        m: [max(loop.longest_within(s, e) for s, e in spans) for spans in rounds_]
        for m, rounds_ in round_windows.items()
    }
    windows = [w for rounds_ in round_windows.values() for spans in rounds_ for w in spans]
    outside = [
        (b - a) * 1000 for a, b in loop.iterations if not any(b > s and a < e for s, e in windows)
    ]
    return BesideTheLoop(call_ms, loop_max_ms, idle_ms, percentile(outside, 99))


def timed_ms(call: Callable[[], object]) -> float:
    """How long ``call()`` took, in ms."""
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000
