"""Where a GPU RL run's sync time went, read from the server's log.

``python -m examples.rl.server_profile SERVER_LOG RUN_JSON`` splits the
server's ``skyrl_event`` lines into the run's modes (each mode starts at
the first adapter load after the previous one ended; the warm-up loads
version 1, so the first mode starts at version 2) and prints, per mode,
the engine's staging time of a pushed adapter, the API side's wait for it,
the install, and how long the API server's event loop was stalled
(``event_loop_stall``, 10 ms or more) and in Python's garbage collector
(``gc_pause``): the HTTP push, every sample answer and every pause and
resume wait on that loop.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def events(log: Path) -> list[tuple[float, dict[str, Any]]]:
    """``(time, event)`` of every ``skyrl_event`` line, in time order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "skyrl_event " not in line:
            continue
        try:
            event = json.loads(line.split("skyrl_event ", 1)[1])
        except json.JSONDecodeError:  # a line cut off by a killed server
            continue
        match = STAMP.match(line)
        at = (
            dt.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if match
            else event.get("at")
        )
        if at is not None:
            out.append((float(at), event))
    return sorted(out, key=lambda e: e[0])


def _q(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else float("nan")


def profile(log: Path, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode of ``run`` (the example's full JSON), the server-side figures."""
    evs = events(log)
    loads = [t for t, e in evs if e["event"] == "adapter_load"]
    start = next(t for t, e in evs if e["event"] == "adapter_load" and e.get("version") == 2)
    rows = []
    for mode, data in run["modes"].items():
        end = start + data["wall_s"]
        window = [e for t, e in evs if start <= t <= end]

        def get(name: str, key: str, window: list[dict[str, Any]] = window) -> list[float]:
            return [e[key] for e in window if e["event"] == name and e.get(key) is not None]

        stalls, gcs = get("event_loop_stall", "ms"), get("gc_pause", "ms")
        span = end - start
        rows.append(
            {
                "mode": mode,
                "seconds": span,
                "loads": len(get("adapter_load", "lora_name")),
                "engine_staging_ms_p50": _q(get("adapter_staging", "ms"), 50),
                "engine_staging_ms_p99": _q(get("adapter_staging", "ms"), 99),
                "engine_read_ms_p50": _q(get("adapter_staging", "read_ms"), 50),
                "api_stage_wait_ms_p50": _q(get("adapter_staged", "stage_ms"), 50),
                "api_stage_wait_ms_p99": _q(get("adapter_staged", "stage_ms"), 99),
                "install_ms_p50": _q(get("adapter_installed", "install_ms"), 50),
                "install_ms_p99": _q(get("adapter_installed", "install_ms"), 99),
                "api_loop_stalls": len(stalls),
                "api_loop_stalled_share": sum(stalls) / 1000 / span,
                "api_loop_stall_max_ms": max(stalls, default=0.0),
                "api_gc_pauses": len(gcs),
                "api_gc_share": sum(gcs) / 1000 / span,
                "api_gc_max_ms": max(gcs, default=0.0),
                "finish_old_fallbacks": len(get("swap_policy_fallback", "lora_name")),
            }
        )
        later = [t for t in loads if t > end + 1.0]
        if later:
            start = later[0]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__)
        return 2
    run = json.loads(Path(args[1]).read_text())
    run = run.get("summary", run)
    print(
        "| mode | loads | engine staging p50 / p99 (read p50) | API wait for staging p50 / p99 "
        "| install p50 / p99 | API loop stalled (>= 10 ms) | API GC pauses | finish_old fallbacks |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in profile(Path(args[0]), run):
        print(
            f"| {r['mode']} | {r['loads']} | {r['engine_staging_ms_p50']:.0f} / "
            f"{r['engine_staging_ms_p99']:.0f} ms ({r['engine_read_ms_p50']:.0f}) "
            f"| {r['api_stage_wait_ms_p50']:.0f} / {r['api_stage_wait_ms_p99']:.0f} ms "
            f"| {r['install_ms_p50']:.0f} / {r['install_ms_p99']:.0f} ms "
            f"| {r['api_loop_stalled_share']:.0%} of the time ({r['api_loop_stalls']} stalls, "
            f"max {r['api_loop_stall_max_ms']:.0f} ms) "
            f"| {r['api_gc_share']:.0%} of the time ({r['api_gc_pauses']}, "
            f"max {r['api_gc_max_ms']:.0f} ms) | {r['finish_old_fallbacks']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
