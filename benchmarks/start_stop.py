"""Start and stop ``skyrl-lora serve --embedded --no-ray`` N times: nothing may pile up.

Each cycle starts a server, waits for its ready line, sends SIGTERM, and
then records the exit status, how long the stop took, which of the
processes it had started are still alive, and the machine's available
memory. Orphaned engine processes (2 GB each on the CPU) showed here as
leftovers and as available memory falling cycle after cycle.

``python -m benchmarks.start_stop --cycles 10``
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from skyrl_lora.server.cluster.process import start_serve
from skyrl_lora.server.reaper import alive


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def cycle(log_dir: Path, index: int) -> dict[str, Any]:
    server = start_serve(["--embedded", "--no-ray", "--port", "0"], log_dir / f"serve-{index}.log")
    started = server.tree()
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    status = server.proc.wait(timeout=60)
    stop_s = time.monotonic() - signalled
    deadline = signalled + 30
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(pid for pid, _ in alive(started))
    server.kill_all()
    return {
        "status": status,
        "stop_s": round(stop_s, 2),
        "processes_started": len(started),
        "left_behind": left,
        "available_mib": round(_available_mib()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    before = _available_mib()
    cycles = []
    with tempfile.TemporaryDirectory() as logs:
        for i in range(args.cycles):
            cycles.append(cycle(Path(logs), i))
            print(json.dumps({"cycle": i, **cycles[-1]}), flush=True)
    result = {
        "available_mib_before": round(before),
        "cycles": cycles,
        "left_behind_in_all": sum(len(c["left_behind"]) for c in cycles),
        "exit_statuses": sorted({c["status"] for c in cycles}),
        "available_mib_change_first_to_last": cycles[-1]["available_mib"]
        - cycles[0]["available_mib"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "cycles"}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
