"""Statistics and sanity checks for the benchmarks (pure: no engine, no I/O).

A benchmark on a shared machine is only worth printing when its figures are
measured side by side and repeated: every figure here is a median over
rounds with the min and max beside it, latencies come with their tail, and
:func:`check_isolation` refuses a run whose own numbers say the measurement
drifted (a global pause that does not cost the others, baselines that moved,
swaps that did not happen).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass


class UntrustworthyRunError(RuntimeError):
    """A sanity check failed: the run's figures do not measure what they claim.

    ``check`` names the failed check; the message says what was seen and why
    that makes the table meaningless. Benchmarks raise it instead of
    printing a table.
    """

    def __init__(self, check: str, why: str) -> None:
        super().__init__(f"sanity check '{check}' failed: {why}")
        self.check = check
        self.why = why


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); the max for q=100."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclass(frozen=True)
class Spread:
    """A figure measured in several rounds: the median, with min and max beside it."""

    median: float
    min: float
    max: float
    rounds: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        data = list(values)
        if not data:
            raise ValueError("a spread needs at least one round")
        return cls(statistics.median(data), min(data), max(data), len(data))

    @property
    def width(self) -> float:
        return self.max - self.min

    def fmt(self, spec: str = ".2f", unit: str = "") -> tuple[str, str]:
        """(median, "min-max") formatted for the table's two columns."""
        return (
            f"{self.median:{spec}}{unit}",
            f"{self.min:{spec}}-{self.max:{spec}}{unit}",
        )

    def to_json(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Tail:
    """A latency distribution by its p50, p99 and max (milliseconds)."""

    p50: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Tail:
        if not values_ms:
            raise ValueError("a latency tail needs at least one value")
        return cls(
            percentile(values_ms, 50), percentile(values_ms, 99), max(values_ms), len(values_ms)
        )

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def tails_spread(per_round: Sequence[Tail]) -> dict[str, Spread]:
    """p50, p99 and max of each round, summarised over the rounds."""
    return {
        "p50": Spread.of(t.p50 for t in per_round),
        "p99": Spread.of(t.p99 for t in per_round),
        "max": Spread.of(t.max for t in per_round),
    }


@dataclass(frozen=True)
class Gap:
    """One inter-token gap of a stream: the interval between two arrivals."""

    start: float
    end: float

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000


def overlaps(gap: Gap, windows: Sequence[tuple[float, float]]) -> bool:
    """Whether the gap shares any time with one of the (start, end) windows."""
    return any(gap.start < end and gap.end > start for start, end in windows)


def split_gaps(
    gaps: Iterable[Gap], windows: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """Gap lengths in ms, split into (during a window, outside every window)."""
    during: list[float] = []
    outside: list[float] = []
    for gap in gaps:
        (during if overlaps(gap, windows) else outside).append(gap.ms)
    return during, outside


@dataclass(frozen=True)
class IsolationChecks:
    """Tolerances of :func:`check_isolation`.

    ``baseline_tolerance``: how far apart (as a fraction of their mean) two
    neighbouring no-swap windows may be and still count as one machine
    state; 2 shared CPU cores need more room than a dedicated GPU.
    """

    baseline_tolerance: float = 0.25
    min_swaps_per_window: int = 1


def agree(a: float, b: float, tolerance: float) -> bool:
    """Whether two rates differ by at most ``tolerance`` times their mean."""
    return abs(a - b) <= tolerance * (a + b) / 2


@dataclass(frozen=True)
class RoundBaselines:
    """Each round's baseline, from the no-swap windows on either side of it.

    Round ``r`` runs between no-swap windows ``r`` and ``r + 1``. Where the
    two agree, its baseline is their mean, so a slow drift of the machine
    cancels to first order (a dedicated GPU's speed moved 25% between two
    runs of one lease; that is no reason to refuse either run). A window
    that disagrees with every neighbour is a hiccup of its own (on the CPU
    box, one no-swap window in some runs ran 20-35% below the rest): a round
    next to it takes the baseline from its other side alone. A round whose
    two sides disagree and neither is such a hiccup saw the machine change
    under it: it has no baseline (``None``) and no ratio.
    """

    per_round: tuple[float | None, ...]
    #: Indices of no-swap windows that disagree with every neighbour.
    lone: tuple[int, ...]

    @classmethod
    def of(cls, no_swap: Sequence[float], tolerance: float) -> RoundBaselines:
        n = len(no_swap)

        def agrees_with(i: int, j: int) -> bool:
            return 0 <= j < n and agree(no_swap[i], no_swap[j], tolerance)

        def is_lone(i: int) -> bool:
            """Off from its neighbours, which agree with each other (the state around it)."""
            if agrees_with(i, i - 1) or agrees_with(i, i + 1):
                return False
            if 0 < i < n - 1:
                return agrees_with(i - 1, i + 1)
            return agrees_with(1, 2) if i == 0 else agrees_with(n - 2, n - 3)

        lone = tuple(i for i in range(n) if is_lone(i))
        per_round: list[float | None] = []
        for r in range(n - 1):
            before, after = no_swap[r], no_swap[r + 1]
            if agree(before, after, tolerance):
                per_round.append((before + after) / 2)
            elif (r in lone) != (r + 1 in lone):
                per_round.append(after if r in lone else before)
            else:
                per_round.append(None)
        return cls(tuple(per_round), lone)

    @property
    def kept(self) -> list[int]:
        """The rounds that have a baseline."""
        return [r for r, b in enumerate(self.per_round) if b is not None]


def check_isolation(
    baselines: Sequence[float],
    global_ratios: Sequence[float],
    swaps: Mapping[str, Sequence[int]],
    planned_swaps: int,
    checks: IsolationChecks,
) -> None:
    """Raise :class:`UntrustworthyRunError` unless the isolation run can be believed.

    ``baselines``: the others' tokens/s in every no-swap window, in order;
    every window keeps all streams in flight, so the engine is saturated
    throughout. ``global_ratios``: the others' rate in each global-pause
    window of a round that has a baseline (:class:`RoundBaselines`) over it.
    ``swaps``: swaps done in each window by mode; ``planned_swaps``: what
    one window was meant to hold.
    """
    if not baselines or min(baselines) <= 0:
        raise UntrustworthyRunError(
            "load",
            f"the other tenants produced no tokens in a no-swap window ({list(baselines)}):"
            " nothing was measured",
        )
    rounds = RoundBaselines.of(baselines, checks.baseline_tolerance)
    windows = ", ".join(f"{b:.0f}" for b in baselines)
    tolerance = f"tolerance {checks.baseline_tolerance:.0%}"
    if len(rounds.lone) > 1:
        raise UntrustworthyRunError(
            "stable baseline",
            f"no-swap windows {list(rounds.lone)} of [{windows}] tok/s each disagree with"
            f" every neighbour ({tolerance}): one hiccup can be set aside, several mean the"
            " machine did not hold still long enough to compare windows",
        )
    if 2 * len(rounds.kept) <= len(rounds.per_round):
        raise UntrustworthyRunError(
            "stable baseline",
            f"only {len(rounds.kept)} of {len(rounds.per_round)} rounds have no-swap windows"
            f" around them that agree ([{windows}] tok/s, {tolerance}): the machine changed"
            " under the run, so ratios against it measure that change",
        )
    for mode, counts in swaps.items():
        short = [c for c in counts if c < planned_swaps]
        if short:
            raise UntrustworthyRunError(
                "planned swaps",
                f"{mode} windows did {list(counts)} swaps, {planned_swaps} planned each:"
                " the swapper fell behind, so the windows do not hold the load they claim",
            )
    bad = [r for r in global_ratios if r >= 1.0]
    if bad:
        raise UntrustworthyRunError(
            "global pause costs the others",
            f"a global pause window ran the others at {', '.join(f'{r:.2f}x' for r in bad)}"
            " of its round's baseline while every stream stayed in flight: freezing the"
            " engine cannot raise throughput, so the windows differ by something else",
        )


def check_count(check: str, done: int, planned: int, what: str) -> None:
    """Raise unless ``done`` reached ``planned`` (e.g. pauses that aborted requests)."""
    if done < planned:
        raise UntrustworthyRunError(
            check, f"{done} of {planned} {what}: the figure would rest on fewer than planned"
        )
