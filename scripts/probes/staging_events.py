"""Percentiles of a server log's staging events, by adapter and how it was read.

``python scripts/probes/staging_events.py SERVER_LOG`` prints, per adapter
name (the part before ``@``) and read kind, the engine's ``adapter_staging``
phases (total, read, copy, pack, slot write), the API's ``adapter_staged``
wait, the hand-overs' and files' ``handover_settled`` copies to the host
after the swap, and a streamed push's receive (``push_stream_received``, by
lanes); a staging that read its file as it arrived is marked ``followed``. A server log of a long run is too large to keep; this
is what is kept of it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

EVENT = re.compile(r"skyrl_event (\{.*\})")
FIELDS = {
    "adapter_staging": (
        "ms",
        "read_ms",
        "handover_copy_ms",
        "host_alloc_ms",
        "pack_ms",
        "slot_ms",
        "naps",
        "follow_wait_ms",
        "follow_after_last_ms",
    ),
    "adapter_staged": ("stage_ms", "polls"),
    # a streamed push's receive, from its first lane to the digest matched
    "push_stream_received": ("ms",),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(path: str) -> None:
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for line in open(path, errors="replace"):
        found = EVENT.search(line)
        if not found:
            continue
        try:
            event = json.loads(found.group(1))
        except ValueError:
            continue
        kind = event.get("event")
        if kind in FIELDS:
            name = str(event.get("lora_name", "")).split("@")[0]
            read = str(event.get("read", event.get("lanes", "")))
            if event.get("followed"):  # read as its bytes arrived (a streamed push)
                read += ",followed"
            groups[(kind, name, read)].append(event)
        elif kind == "handover_settled":
            groups[(kind, "", "")].append(event)
    for (kind, name, read), events in sorted(groups.items()):
        parts = []
        for field in FIELDS.get(kind, ("ms",)):
            values = [float(e[field]) for e in events if e.get(field) is not None]
            if values:
                parts.append(
                    f"{field} p50 {percentile(values, 0.5):.1f} p90 {percentile(values, 0.9):.1f}"
                    f" max {max(values):.1f}"
                )
        print(f"{kind} {name} {read} n={len(events)}: " + "; ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1])
