"""A swap-cost run's hand-over stagings, idle against under load, by phase.

``python3 scripts/probes/staging_split.py SERVER_LOG [--swapper swap-r64]
[--transports 3] [--swaps 3]`` reads the ``adapter_staging`` events of a
``benchmarks.scale --parts swap_cost`` server log and splits the swapper's
template-built stagings (``read`` ``handover_template``) by the benchmark's
order: the swapper's first load and one warm-up sync per transport, then
per round an idle block and a loaded block of transports x swaps syncs.
For each side: the median, p90 and max of the staging's wall and
thread-CPU time, whole and by phase (copy out, build, slot write), and of
a CUDA share's open, copies and close where the server logged them. A
phase whose wall time grows under load while its CPU time does not waited
off the CPU (the GIL); one whose CPU time grows with it spun (a CUDA
synchronize).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from typing import Any

EVENT = re.compile(r"skyrl_event (\{.*\})")

Event = dict[str, Any]

PHASES: dict[str, Callable[[Event], float | None]] = {
    "wall": lambda e: e["ms"],
    "cpu": lambda e: e.get("cpu_ms"),
    "copy": lambda e: e["handover_copy_ms"],
    "copy_cpu": lambda e: e.get("handover_copy_cpu_ms"),
    "build": lambda e: e["read_ms"] - e["handover_copy_ms"],
    "build_cpu": lambda e: (
        None
        if e.get("cpu_ms") is None
        else e["cpu_ms"] - e["handover_copy_cpu_ms"] - (e["slot_cpu_ms"] or 0.0)
    ),
    "slot": lambda e: e["slot_ms"] or 0.0,
    "slot_cpu": lambda e: e.get("slot_cpu_ms"),
    "open": lambda e: e.get("handover_open_ms"),
    "copies": lambda e: e.get("handover_copies_ms"),
    "close": lambda e: e.get("handover_close_ms"),
}


def stagings(path: str, swapper: str) -> list[Event]:
    found = []
    with open(path, errors="replace") as log:
        for line in log:
            match = EVENT.search(line)
            if match is None:
                continue
            try:
                event = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            if event["event"] == "adapter_staging" and event["lora_name"].startswith(swapper):
                found.append(event)
    return found


def split(found: list[Event], transports: int, swaps: int) -> dict[str, list[Event]]:
    block = transports * swaps
    sides: dict[str, list[Event]] = {"idle": [], "under load": []}
    for i, event in enumerate(found[1 + transports :]):
        if event.get("read") == "handover_template":
            sides["under load" if (i // block) % 2 else "idle"].append(event)
    return sides


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--swapper", default="swap-r64")
    parser.add_argument("--transports", type=int, default=3)
    parser.add_argument("--swaps", type=int, default=3)
    args = parser.parse_args()
    sides = split(stagings(args.log, args.swapper), args.transports, args.swaps)
    print("ms, median / p90 / max")
    for side, events in sides.items():
        cells = []
        for phase, value in PHASES.items():
            values = [v for v in map(value, events) if v is not None]
            if values:
                med = statistics.median(values)
                cells.append(f"{phase} {med:.1f}/{_p(values, 0.9):.1f}/{max(values):.1f}")
        print(f"{side} (n={len(events)}): " + ", ".join(cells))


if __name__ == "__main__":
    main()
