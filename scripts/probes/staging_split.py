"""A swap-cost run's hand-over stagings, idle against under load, by phase.

``python3 scripts/probes/staging_split.py SERVER_LOG [--swapper swap-r64]
[--transports path,handover,handover_swap] [--swaps 3] [--by-transport]``,
from the repository's root, reads the
``adapter_staging`` events of a ``benchmarks.scale --parts swap_cost``
server log and splits the swapper's template-built stagings (``read``
``handover_template``) by the benchmark's order: the swapper's first load
and one warm-up sync per transport, then per round an idle block and a
loaded block of transports x swaps syncs. For each side: the median, p90
and max of each phase ``sync_timeline.py`` gives a hand-over, on the wall
clock and on the staging thread's CPU clock, and of a CUDA share's open,
copies and close where the server logged them. A phase whose wall time
grows under load while its CPU time does not waited off the CPU (the GIL);
one whose CPU time grows with it spun (a CUDA synchronize).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from sync_timeline import cpu_phases, events, percentile, wall_phases


def split(
    found: list[dict[str, Any]], transports: list[str], swaps: int, by_transport: bool = False
) -> dict[str, list[Any]]:
    """The template-built stagings by side (and, ``by_transport``, by the
    transport that brought them: round r runs the transports from the
    (r mod n)-th on, as ``benchmarks.transport_swap`` rotates them)."""
    count = len(transports)
    block = count * swaps
    sides: dict[str, list[Any]] = {}
    for i, event in enumerate(found[1 + count :]):
        if event.get("read") != "handover_template":
            continue
        side = "under load" if (i // block) % 2 else "idle"
        if by_transport:
            turn = (i // (2 * block)) % count
            order = transports[turn:] + transports[:turn]
            side = f"{side}, {order[(i % block) // swaps]}"
        sides.setdefault(side, []).append(event)
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--swapper", default="swap-r64")
    parser.add_argument(
        "--transports",
        type=lambda text: text.split(","),
        default=["path", "handover", "handover_swap"],
        help="the benchmark's --transports, in its order",
    )
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument(
        "--by-transport", action="store_true", help="split each side by transport too"
    )
    args = parser.parse_args()
    stagings = [e for _, e in events(args.log, args.swapper) if e["event"] == "adapter_staging"]
    print("ms, median / p90 / max")
    for side, found in split(stagings, args.transports, args.swaps, args.by_transport).items():
        rows = [{**wall_phases(e), **cpu_phases(e)} for e in found]
        cells = []
        for phase in dict.fromkeys(k for row in rows for k in row):
            values = [row[phase] for row in rows if phase in row]
            cells.append(
                f"{phase} {statistics.median(values):.1f}/{percentile(values, 0.9):.1f}/{max(values):.1f}"
            )
        print(f"{side} (n={len(found)}): " + ", ".join(cells))


if __name__ == "__main__":
    main()
