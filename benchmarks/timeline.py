"""Line a perf run's windows up with the server's event log.

``python -m benchmarks.timeline gpu_perf.json server.log`` prints, for each
isolation run in the json, how many API event-loop stalls
(``event_loop_stall`` events, see :mod:`skyrl_lora.server.telemetry.loop_monitor`),
long garbage collections of the API process (``gc_pause``) and of vLLM's
engine process (``engine_gc_pause``) fell inside the per-adapter
swaps, inside the global pauses and outside both (counts, and rates per
second of each), the stacks the loop was seen in during its stalls where
the server ran with ``--stall-stacks``, and the event timeline
of one swap (pause, snapshot, staging and install, resume), and the
longest stalls during swaps with the events and staging phases that ran
meanwhile (:func:`longest_stalls`). That tells a
stall of the API server's loop from one of the engine: the windows' token
gaps show *that* the others waited, the timeline shows *where*.

The windows are ``time.monotonic()`` of the benchmark process and the log
is wall-clock time (UTC) of the same machine; the json's
``wall_minus_monotonic_s`` converts one into the other
(:func:`skyrl_lora.server.telemetry.event_log.read_events`).
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from skyrl_lora.server.telemetry.event_log import Event, read_events

Span = tuple[float, float]


def _inside(at: float, spans: Sequence[Span], slack_s: float = 0.002) -> bool:
    return any(start - slack_s <= at <= end + slack_s for start, end in spans)


KINDS = ("per_adapter", "global", "outside")


def _spans(run: dict[str, Any], aftermath: bool = True) -> tuple[Span, list[Span], list[Span]]:
    """The run's whole span, its per-adapter swaps and its global pauses, each
    with the aftermath the benchmark gives it (``aftermath_s``: the resumed
    requests' return belongs to the swap), unless ``aftermath`` is False."""
    windows = run["spread"]["windows"]
    after = float(run["spread"].get("config", {}).get("aftermath_s", 0.0)) if aftermath else 0.0
    swaps = [(s, e + after) for w in windows if w["mode"] == "per_adapter" for s, e in w["swaps"]]
    pauses = [(s, e + after) for w in windows if w["mode"] == "global" for s, e in w["swaps"]]
    return (windows[0]["start"], windows[-1]["end"]), swaps, pauses


def classified(
    run: dict[str, Any], events: Sequence[Event], name: str
) -> Iterator[tuple[str, Event]]:
    """The ``name`` events of one isolation run, each with where it fell
    (:data:`KINDS`): during a per-adapter swap, a global pause, or neither."""
    (first, last), swaps, pauses = _spans(run)
    for e in events:
        if e.name != name or not first <= e.at <= last:
            continue
        kind = "outside"
        if _inside(e.at, swaps):
            kind = "per_adapter"
        elif _inside(e.at, pauses):
            kind = "global"
        yield kind, e


def stall_summary(
    run: dict[str, Any], events: Sequence[Event], name: str = "event_loop_stall"
) -> dict[str, list[float]]:
    """Lengths (ms) of the ``name`` events (loop stalls, or ``gc_pause``) in one
    isolation run: during per-adapter swaps, during global pauses, else."""
    out: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for kind, e in classified(run, events, name):
        out[kind].append(float(e.fields["ms"]))
    return out


def seconds_by_kind(run: dict[str, Any]) -> dict[str, float]:
    """How long the run spent in each of :data:`KINDS`: a count of stalls
    means little until it is a rate (a swap window is a fraction of a run)."""
    (first, last), swaps, pauses = _spans(run)
    during = {
        "per_adapter": sum(b - a for a, b in swaps),
        "global": sum(b - a for a, b in pauses),
    }
    return {**during, "outside": (last - first) - sum(during.values())}


def stall_stacks(
    run: dict[str, Any], events: Sequence[Event], top: int = 3, frames: int = 3
) -> dict[str, list[tuple[int, str]]]:
    """For stalls logged with ``serve --stall-stacks``: the ``top`` most common
    of their most-seen stacks (innermost ``frames`` frames) in each kind."""
    found: dict[str, collections.Counter[str]] = {kind: collections.Counter() for kind in KINDS}
    for kind, e in classified(run, events, "event_loop_stall"):
        stacks = e.fields.get("stacks") or []
        if stacks:
            innermost = stacks[0]["stack"][-frames:]
            found[kind][" <- ".join(reversed(innermost)) or "(no Python frame)"] += 1
    return {
        kind: [(n, stack) for stack, n in counter.most_common(top)]
        for kind, counter in found.items()
        if counter
    }


def swap_timeline(run: dict[str, Any], events: Sequence[Event]) -> list[str]:
    """The events of the middle per-adapter swap, in ms after its pause call."""
    _, swaps, _ = _spans(run, aftermath=False)
    if not swaps:
        return []
    middle = len(swaps) // 2
    start, end = swaps[middle]
    until = _spans(run)[1][middle][1]  # the same swap with its aftermath
    lines = [f"one swap: {1000 * (end - start):.0f} ms from the pause call to the resume's answer"]
    for e in events:
        if start - 0.01 <= e.at <= until:
            rest = {k: v for k, v in e.fields.items() if k != "event"}
            shown = json.dumps(rest)[:140]
            lines.append(f"  {1000 * (e.at - start):7.1f} ms  {e.name:18s} {shown}")
    return lines


def _staging_start(e: Event) -> float:
    """When an ``adapter_staging`` event's staging began (its time is the end)."""
    return e.at - float(e.fields["ms"]) / 1000


def _staging_phases(e: Event, end: float) -> str:
    """An ``adapter_staging`` event's phases, in ms relative to ``end`` (they
    ran back to back)."""
    at = _staging_start(e)
    parts = []
    for phase in ("read", "pack", "slot"):
        ms = e.fields.get(f"{phase}_ms")
        if ms is not None:
            parts.append(f"{phase} {1000 * (at - end):+.0f}..{1000 * (at + ms / 1000 - end):+.0f}")
            at += ms / 1000
    return f"staging {e.fields.get('lora_name')} ({', '.join(parts)})"


def longest_stalls(
    run: dict[str, Any], events: Sequence[Event], before_s: float = 0.08
) -> list[str]:
    """The run's longest stalls during per-adapter swaps (the benchmark's
    ``longest_gaps_during_swaps``), each with the server's events in the
    ``before_s`` before it ended and the engine's stagings that overlapped
    that time, in ms relative to the stall's end: what ran while the others
    waited."""
    lines = []
    for stall in run["spread"].get("longest_gaps_during_swaps", []):
        if "at" not in stall:  # recorded before stalls had a time
            continue
        end = float(stall["at"])
        start = end - float(stall["ms"]) / 1000 - before_s
        seen = []
        for e in events:
            if e.name == "adapter_staging":
                if _staging_start(e) <= end and e.at >= start:
                    seen.append(_staging_phases(e, end))
            elif start <= e.at <= end:
                ms = f" {e.fields['ms']} ms" if "ms" in e.fields else ""
                seen.append(f"{e.name}{ms} at {1000 * (e.at - end):+.0f}")
        lines.append(
            f"  {stall['ms']:6.1f} ms {stall['streams']:3.0f} streams  round {stall['round']:.0f}"
            f"  {stall['after_pause_ms']:+7.1f} after pause {stall['after_resume_ms']:+7.1f}"
            f" after resume  |  {'; '.join(seen) or '-'}"
        )
    return lines


def report(figures: dict[str, Any], log_lines: Iterable[str]) -> list[str]:
    events = read_events(log_lines, figures["wall_minus_monotonic_s"])
    out = []
    for label, run in (("3 tenants", figures), ("8 tenants", figures.get("eight_tenants"))):
        if not run:
            continue
        seconds = seconds_by_kind(run)
        for name, what in (
            ("event_loop_stall", "API event-loop stalls over 10 ms"),
            ("gc_pause", "API collections over 10 ms"),
            ("engine_gc_pause", "engine collections over 5 ms"),
        ):
            found = stall_summary(run, events, name)
            parts = ", ".join(
                f"{kind} {len(ms)} in {seconds[kind]:.1f} s"
                f" ({len(ms) / max(seconds[kind], 1e-9):.2f}/s, max {max(ms, default=0.0):.1f} ms)"
                for kind, ms in found.items()
            )
            out.append(f"{label}: {what}: {parts}")
        for kind, common in stall_stacks(run, events).items():
            out.append(f"{label}: most seen stacks of the loop's stalls, {kind}:")
            out.extend(f"  {n:4d}  {stack}" for n, stack in common)
        out.extend(swap_timeline(run, events))
        if stalls := longest_stalls(run, events):
            out.append(f"{label}: the longest stalls during swaps, with what ran meanwhile:")
            out.extend(stalls)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", type=Path, help="gpu_perf.json of the run")
    parser.add_argument("server_log", type=Path, help="the server's log of the same run")
    args = parser.parse_args(argv)
    figures = json.loads(args.figures.read_text())
    with args.server_log.open(errors="replace") as log:
        print("\n".join(report(figures, log)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
