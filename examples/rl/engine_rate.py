"""The engine's generated-token counter over time, read from ``/metrics``.

``sample_with_retry`` hands back whole samples, so the client cannot tell
when inside a swap of a fraction of a second a token was made. vLLM's
``vllm:generation_tokens_total`` counter can: polled every ``interval``
seconds, it gives the engine's token rate inside any time window. During a
per-adapter swap the swapping tenant is paused, so what the engine makes
then belongs to the other tenants; during a global pause nobody generates.

The same poll reads the engine's batch and queue (requests running and
waiting): where the GPU is far from busy, a step's cost hardly grows with
its batch, so the batch may be what sets the engine's token rate. It also
reads the prompt tokens the engine took in and those it found in its
prefix cache: a request aborted by a sync (the syncing tenant's,
under the per-adapter pause and under the global one alike) comes back
with its prompt and its partial tokens, prefilled again on the new version
(whose cache entries are its own), so ``prefill - cached`` over ``generated``
says what resuming costs the engine in a mode.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp

COUNTER = "vllm:generation_tokens_total"
PROMPT_COUNTER = "vllm:prompt_tokens_total"
CACHED_COUNTER = "vllm:prefix_cache_hits_total"
#: Gauges: the engine's batch (requests being computed) and its queue.
RUNNING_GAUGE = "vllm:num_requests_running"
WAITING_GAUGE = "vllm:num_requests_waiting"
#: The largest step vLLM captures a CUDA graph for by default
#: (``max_cudagraph_capture_size``); a longer step runs eagerly on a GPU,
#: 56-66 ms against about 21 ms for the RL shape's decode steps on an H100
#: (docs/gpu.md, 94ac4e8).
GRAPH_TOKENS = 512
#: Engine steps, all and those of at most :data:`GRAPH_TOKENS` tokens: the
#: count and one bucket of vLLM's histogram of tokens per step (a name with a
#: label selector: ``parse_counter`` keeps the lines carrying that label). The
#: buckets misplace chunked prefills: :func:`examples.rl.report.engine_steps`.
STEPS = "vllm:iteration_tokens_total_count"
STEPS_IN_GRAPH = f'vllm:iteration_tokens_total_bucket{{le="{GRAPH_TOKENS:.1f}"}}'
#: What :class:`EngineTokenCounter` reads on every poll.
COUNTERS = (
    COUNTER,
    PROMPT_COUNTER,
    CACHED_COUNTER,
    RUNNING_GAUGE,
    WAITING_GAUGE,
    STEPS,
    STEPS_IN_GRAPH,
)


async def poll(read: Callable[[], Awaitable[None]], stop: asyncio.Event, interval: float) -> None:
    """``read()`` every ``interval`` seconds until ``stop`` is set, and once after."""
    while True:
        await read()
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def parse_counter(text: str, name: str = COUNTER) -> float:
    """Sum of a Prometheus counter over its label sets (one per engine).

    ``name`` may end in a selector, ``metric{label="value",...}``: then only
    the lines whose labels include each of those are summed (a histogram's
    bucket)."""
    metric, _, selector = name.partition("{")
    wanted = [label for label in selector.rstrip("}").split(",") if label]
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(metric) or line[len(metric) : len(metric) + 1] not in ("{", " "):
            continue
        labels = line[len(metric) :].split("}", 1)[0] if line[len(metric)] == "{" else ""
        if all(label in labels for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


class EngineTokenCounter:
    """Polls one server's counters; :meth:`tokens_between` interpolates the
    generated tokens, :meth:`between` any of :data:`COUNTERS`."""

    def __init__(self, url: str, interval: float = 0.05, api_key: str | None = None) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.interval = interval
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.times: list[float] = []
        self.readings: dict[str, list[float]] = {name: [] for name in COUNTERS}

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set (one last reading after it)."""
        async with aiohttp.ClientSession(headers=self.headers) as session:

            async def read() -> None:
                asked = time.monotonic()
                async with session.get(self.url) as response:
                    response.raise_for_status()  # a refused poll is not zero tokens
                    text = await response.text()
                # The reading was taken somewhere between question and answer.
                self.times.append((asked + time.monotonic()) / 2)
                for name, readings in self.readings.items():
                    readings.append(parse_counter(text, name))

            await poll(read, stop, self.interval)

    def count_at(self, at: float, name: str = COUNTER) -> float:
        """Counter ``name`` at ``at``, linear between readings, clamped at the ends."""
        counts = self.readings[name]
        i = bisect.bisect_left(self.times, at)
        if i == 0:
            return counts[0]
        if i == len(self.times):
            return counts[-1]
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], counts[i - 1], counts[i]
        return c0 + (c1 - c0) * (at - t0) / max(t1 - t0, 1e-9)

    def between(self, name: str, start: float, end: float) -> float:
        return self.count_at(end, name) - self.count_at(start, name)

    def tokens_between(self, start: float, end: float) -> float:
        """Tokens generated from ``start`` to ``end``."""
        return self.between(COUNTER, start, end)

    def rate_inside(self, name: str, windows: Sequence[tuple[float, float]]) -> float:
        """Counter ``name``'s increase a second over ``windows`` (0 if they are empty)."""
        seconds = sum(b - a for a, b in windows)
        return sum(self.between(name, a, b) for a, b in windows) / max(seconds, 1e-9)

    def mean_inside(self, name: str, windows: Sequence[tuple[float, float]]) -> float | None:
        """Gauge ``name``'s mean over the readings taken inside any of ``windows``."""
        picked = [
            value
            for t, value in zip(self.times, self.readings[name])
            if any(a <= t <= b for a, b in windows)
        ]
        return sum(picked) / len(picked) if picked else None


def depth(
    windows: Sequence[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float, int]]:
    """``start`` to ``end`` cut at every edge of ``windows`` inside it, each
    piece with how many of ``windows`` cover it."""
    edges = sorted({start, end, *(t for window in windows for t in window if start < t < end)})
    return [
        (a, b, sum(x <= a and b <= y for x, y in windows)) for a, b in itertools.pairwise(edges)
    ]


def exclusive_windows(windows: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the time line covered by exactly one window.

    Tenants that share an engine fall into lock-step and often swap at the
    same moment; only while exactly one tenant swaps do the two others'
    tokens measure how a swap affects its neighbours.
    """
    if not windows:
        return []
    edges = [t for window in windows for t in window]
    return [(a, b) for a, b, n in depth(windows, min(edges), max(edges)) if n == 1]


def covered(windows: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time line covered by at least one window, as disjoint windows."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def uncovered(
    windows: Sequence[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float]]:
    """The time from ``start`` to ``end`` that none of ``windows`` covers."""
    gaps, at = [], start
    for a, b in covered(windows):
        if a > at:
            gaps.append((at, min(a, end)))
        at = max(at, b)
    if at < end:
        gaps.append((at, end))
    return [(a, b) for a, b in gaps if b > a]
