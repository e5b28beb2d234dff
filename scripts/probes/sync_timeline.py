"""Where a sync's time goes between the server's processes, from its event log.

``python scripts/probes/sync_timeline.py SERVER_LOG [ADAPTER]`` (a Python
with skyrl_lora installed: ``.venv/bin/python`` here) lines up, for each
version of ``ADAPTER`` (default: every adapter whose name starts with
``swap``) staged from a streamed push or a hand-over, the API server's
events (``pause``, ``push_stream_received``, ``adapter_staged``, ``resume``:
log time, millisecond resolution) with the engine's ``adapter_staging`` (its
``at``, the wall clock of the same host), read by
:func:`skyrl_lora.server.telemetry.event_log.read_events`. Per push: when the receive
began after the pause, how long it took, when the engine's staging began
after the receive began and ended after the receive ended, and the answer's
tail. Per hand-over: the engine's phases and the API's wait around them, and
(``weights_answered``, servers from 128e394 on) the route's own time before
the staging and after it.
Medians close each table. A staging's phases are in ``staging_events.py``;
this says how they overlap the receive. Last, the routes' own times, in
bursts (several adapters answered at once: every tenant of an RL run
handing over at a mode's start) and outside them.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from skyrl_lora.server.telemetry.event_log import read_events

Event = tuple[float, dict[str, Any]]


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values (``q`` in 0..1;
    the max for the last rank), as the files in ``docs/gpu/`` were made with."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def events(path: str, prefix: str) -> list[Event]:
    """The log's events of adapters named ``prefix``..., on the host's wall
    clock, in time order."""
    with open(path, errors="replace") as log:
        found = read_events(log, wall_minus_monotonic_s=0.0)
    named = [e for e in found if str(e.fields.get("lora_name", "")).startswith(prefix)]
    return sorted(((e.at, e.fields) for e in named), key=lambda pair: pair[0])


def _next(found: list[Event], start: int, kind: str, within: int = 10) -> Event | None:
    return next((e for e in found[start + 1 : start + 1 + within] if e[1]["event"] == kind), None)


def _last(found: list[Event], end: int, kind: str) -> Event | None:
    return next((e for e in reversed(found[:end]) if e[1]["event"] == kind), None)


def _ms(later: float, earlier: float) -> float:
    return round((later - earlier) * 1000, 1)


def pushes(found: list[Event]) -> list[dict[str, float]]:
    rows = []
    for index, (at, event) in enumerate(found):
        if event["event"] != "push_stream_received":
            continue
        pause, staging = _last(found, index, "pause"), _next(found, index, "adapter_staging")
        staged, resume = _next(found, index, "adapter_staged"), _next(found, index, "resume")
        if None in (pause, staging, staged, resume):
            continue
        assert pause and staging and staged and resume
        began = at - event["ms"] / 1000
        staging_began = staging[0] - staging[1]["ms"] / 1000
        rows.append(
            {
                "pause_to_receive": _ms(began, pause[0]),
                "receive": event["ms"],
                "prefix_whole": event.get("whole_ms") or 0.0,
                "staging_began_after_receive_began": _ms(staging_began, began),
                "staging_ended_after_receive_ended": _ms(staging[0], at),
                "read_after_last_wait": staging[1].get("follow_after_last_ms") or 0.0,
                "slot": staging[1]["slot_ms"] or 0.0,
                "staged_to_resume": _ms(resume[0], staging[0]),
                "pause_to_resume": _ms(resume[0], pause[0]),
            }
        )
    return rows


def wall_phases(event: dict[str, Any]) -> dict[str, float]:
    """A hand-over staging event's phases on the wall clock: the whole, the
    copy out of the trainer's buffer, the build, the slot write."""
    copy = event["handover_copy_ms"] or 0.0
    return {
        "staging": event["ms"],
        "copy": copy,
        "build": round(event["read_ms"] - copy, 2),
        "slot": event["slot_ms"] or 0.0,
    }


def cpu_phases(event: dict[str, Any]) -> dict[str, float]:
    """The same phases on the staging thread's CPU clock (servers from
    d3af1fb: the wall time beyond it was spent off the CPU, waiting for the
    GIL mostly), and a CUDA share's copy out in parts (from 3e3b49d)."""
    row = {}
    if event.get("cpu_ms") is not None:
        copy_cpu = event["handover_copy_cpu_ms"] or 0.0
        slot_cpu = event["slot_cpu_ms"] or 0.0
        row["staging_cpu"] = event["cpu_ms"]
        row["copy_cpu"] = copy_cpu
        row["build_cpu"] = round(event["cpu_ms"] - copy_cpu - slot_cpu, 2)
        row["slot_cpu"] = slot_cpu
    for part in ("open", "copies", "close"):
        if event.get(f"handover_{part}_ms") is not None:
            row[f"copy_{part}"] = event[f"handover_{part}_ms"]
    return row


def handovers(found: list[Event]) -> list[dict[str, float]]:
    # A version's events by its engine name (``name@vN``): several tenants'
    # syncs interleave in one log, and an API event's millisecond stamp may
    # sort it just before the engine event it follows.
    staged_of = {e["lora_name"]: (at, e) for at, e in found if e["event"] == "adapter_staged"}
    answered_of = {
        f"{e['lora_name']}@v{e['version']}": (at, e)
        for at, e in found
        if e["event"] == "weights_answered"
    }
    rows = []
    for at, event in found:
        if event["event"] != "adapter_staging" or not str(event["read"]).startswith("handover"):
            continue
        staged = staged_of.get(event["lora_name"])
        if staged is None:
            continue
        sent = staged[0] - staged[1]["stage_ms"] / 1000
        row = {
            **wall_phases(event),
            "api_wait_beyond_staging": round(staged[1]["stage_ms"] - event["ms"], 2),
            # of which before the staging began: behind another adapter's
            # staging on the worker's one staging thread, or a drop's wait
            "queued": max(0.0, _ms(at - event["ms"] / 1000, sent)),
            **cpu_phases(event),
        }
        answered = answered_of.get(event["lora_name"])
        if answered is not None:  # servers from 128e394 on
            entered = answered[0] - answered[1]["ms"] / 1000
            row["route"] = answered[1]["ms"]
            row["route_before_stage"] = _ms(sent, entered)
            row["route_after_staged"] = _ms(answered[0], staged[0])
        rows.append(row)
    return rows


def table(title: str, rows: list[dict[str, float]]) -> None:
    if not rows:
        return
    print(f"== {title} ({len(rows)}), ms")
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.1f}" for c in columns))
    print("median: " + " | ".join(f"{statistics.median(r[c] for r in rows):.1f}" for c in columns))
    print("pooled percentiles, ms:")
    for c in columns:
        print(f"{c:<26} {tail_cells([r[c] for r in rows])}")


def tail_cells(values: list[float]) -> str:
    """p50, p90, p99 and max of ``values``, one line."""
    cells = "  ".join(
        f"{name} {percentile(values, q):6.1f}"
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    )
    return f"{cells}  max {max(values):6.1f}"


#: Answers of this many adapters within BURST_S of each other are a burst:
#: every tenant handing over at once (an RL mode's start), their stagings
#: one after the other on the worker's staging thread.
BURST_ADAPTERS = 4
BURST_S = 0.3


def route_tails(found: list[Event]) -> None:
    """The routes' own times (``weights_answered``), in bursts and outside
    them: whether a sync's tail is the server's, or the caller's."""
    answers = sorted((at, e["ms"]) for at, e in found if e["event"] == "weights_answered")
    if not answers:
        return
    in_burst = {
        i
        for i, (at, _) in enumerate(answers)
        if sum(abs(other - at) < BURST_S for other, _ in answers) >= BURST_ADAPTERS
    }
    print(f"== routes' own time, ms ({BURST_ADAPTERS}+ answers within {BURST_S} s: a burst)")
    for name, picked in (
        ("all", [ms for _, ms in answers]),
        ("in bursts", [ms for i, (_, ms) in enumerate(answers) if i in in_burst]),
        ("outside bursts", [ms for i, (_, ms) in enumerate(answers) if i not in in_burst]),
    ):
        if picked:
            print(f"{name:<16} {len(picked):4d}  {tail_cells(picked)}")


def main(path: str, prefix: str = "swap") -> None:
    found = events(path, prefix)
    table("streamed pushes", pushes(found))
    table("hand-overs", handovers(found))
    route_tails(found)


if __name__ == "__main__":
    main(*sys.argv[1:3])
