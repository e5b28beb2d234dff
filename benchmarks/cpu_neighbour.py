"""A CPU-bound neighbour that times its own steps: what other work takes from a step loop.

The engine's step loop shares the host's cores with a push's byte movers
(the trainer's lanes and hashers, the listener's). When they outnumber the
free cores, the scheduler hands the loop's core to them for a while and
the step that was running comes out long: a gap in every other tenant's
tokens. This neighbour stands in for that loop, without a GPU: a process
that runs steps of pure-Python work back to back (each about ``step_ms``
on a quiet core, calibrated at its start) and records when each began and
how long it took. A benchmark runs it beside its sends and reads which
steps each send stretched (:func:`stretched`).

``python -m benchmarks.cpu_neighbour --step-ms 5 --out FILE`` runs until
SIGTERM, then writes ``{"step_ms": ..., "steps": [[start, ms], ...]}``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.stats import Spread, Tail, median


def work(loops: int) -> int:
    """The step's work: a loop the interpreter cannot skip."""
    total = 0
    for i in range(loops):
        total += i & 7
    return total


def calibrate(step_ms: float) -> int:
    """Loops of :func:`work` that take about ``step_ms`` of this thread's CPU
    time (not the wall clock's, which a busy core would stretch): scaled
    from the fastest of a few tries, twice, the second time at about the
    step's own size."""
    loops = 10_000
    for _ in range(2):
        best = float("inf")
        for _ in range(5):
            started = time.thread_time()
            work(loops)
            best = min(best, time.thread_time() - started)
        loops = max(1, round(loops * step_ms / 1000 / max(best, 1e-6)))
    return loops


def run(step_ms: float, out: Path) -> None:
    """Steps back to back until SIGTERM; then their starts and lengths go to ``out``."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    loops = calibrate(step_ms)
    steps: list[tuple[float, float]] = []
    while not stopping:
        wall, started = time.time(), time.perf_counter()
        work(loops)
        steps.append((wall, (time.perf_counter() - started) * 1000))
    out.write_text(json.dumps({"step_ms": step_ms, "steps": steps}))


class Neighbour:
    """The neighbour as a child process: :meth:`start`, then :meth:`stop` for its steps."""

    def __init__(self, step_ms: float, out: Path) -> None:
        self.step_ms = step_ms
        self._out = out
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "benchmarks.cpu_neighbour", "--step-ms", str(self.step_ms)]
        self._process = subprocess.Popen([*argv, "--out", str(self._out)])

    def stop(self) -> list[tuple[float, float]]:
        """Stop it; each step's wall-clock start and milliseconds."""
        if self._process is None:
            raise RuntimeError("the neighbour was never started")
        self._process.terminate()
        self._process.wait(30)
        return [(start, ms) for start, ms in json.loads(self._out.read_text())["steps"]]

    def kill(self) -> None:
        """End it without its steps, wherever the run stopped (a no-op once stopped)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(30)


@dataclass(frozen=True)
class Window:
    """A stretch of wall clock: one send, or a quiet time with no sends."""

    start: float
    end: float


def overlapping(steps: Iterable[tuple[float, float]], window: Window) -> list[float]:
    """The milliseconds of every step that ran during ``window``, even partly."""
    return [ms for start, ms in steps if start < window.end and start + ms / 1000 > window.start]


def stretched(
    steps: Sequence[tuple[float, float]], sends: Sequence[Window], quiet: Sequence[Window]
) -> dict[str, Any]:
    """What the sends did to the neighbour's steps: per send its longest step,
    less the median step of the quiet windows (summarised over the sends),
    and the tail of every step that overlapped a send."""
    quiet_steps = [ms for window in quiet for ms in overlapping(steps, window)]
    if not quiet_steps:
        raise ValueError("the neighbour ran no step in the quiet windows")
    base = median(quiet_steps)
    longest, during = [], []
    for send in sends:
        mine = overlapping(steps, send)
        if mine:
            longest.append(max(mine) - base)
            during.extend(mine)
    return {
        "quiet_step_ms": round(base, 2),
        "longest_step_over_quiet_ms": Spread.of(longest).__dict__ if longest else None,
        "steps_during_sends_ms": Tail.of(during).to_json() if during else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run(args.step_ms, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
