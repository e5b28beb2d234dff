"""The engine's long steps over an RL run's time, from its server log.

    python3 scripts/probes/long_steps.py SERVER_LOG [--bin-s 5] [--windows NAME=A-B,...]

Reads the ``skyrl_event`` lines of a server log (``rl_gpu_server.log`` of
``scripts/gpu_device_run.sh rl``) and prints, per bin of wall time from the
first event: the engine steps over ``--long-step-ms`` (``engine_long_step``),
the adapters installed, and the samples the adapters' pauses aborted. The
modes of an RL run follow each other on one server; between two modes the
learners restart and installs stop for a few seconds, so the bins with
few installs show where each mode ran (aborts come in every mode: the
global mode installs with ``abort_resume`` inside its pause too).
``--windows`` then sums named spans of seconds: long
steps a second, their median prefill tokens, and the share of them with
more than 256 prefill tokens (the resume pacing's per-step budget).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics


def events(path: str) -> list[tuple[float, dict]]:
    found = []
    for line in open(path, errors="replace"):
        i = line.find("skyrl_event ")
        if i < 0:
            continue
        try:
            event = json.loads(line[i + len("skyrl_event ") :])
        except json.JSONDecodeError:
            continue
        at = event.get("at")
        if at is None:  # the API process's lines: the logger's own wall clock
            try:
                stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            except ValueError:
                continue
            at = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
        found.append((at, event))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--bin-s", type=float, default=5.0)
    parser.add_argument("--windows", default="", help="NAME=A-B,... in seconds from the start")
    args = parser.parse_args()
    found = events(args.log)
    t0 = min(at for at, _ in found)
    bins: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for at, event in found:
        n = int((at - t0) // args.bin_s)
        kind = event["event"]
        if kind == "engine_long_step":
            bins[n]["long"] += 1
        elif kind == "adapter_install":
            bins[n]["installs"] += 1
        elif kind == "pause":
            bins[n]["aborted"] += event.get("aborted", 0)
    print(f"from {t0:.1f}, per {args.bin_s:g} s: long steps / installs / samples aborted")
    for n in range(max(bins) + 1):
        b = bins[n]
        print(f"{n * args.bin_s:6.0f} s  {b['long']:3d} / {b['installs']:3d} / {b['aborted']:4d}")
    for spec in filter(None, args.windows.split(",")):
        name, span = spec.split("=")
        a, b = (float(x) for x in span.split("-"))
        steps = [
            e for at, e in found if e["event"] == "engine_long_step" and a <= at - t0 < b
        ]
        prefill = [e["prefill_tokens"] for e in steps]
        print(
            f"{name} ({a:g}-{b:g} s): {len(steps) / (b - a):.2f} long steps a second, "
            f"median {statistics.median(e['ms'] for e in steps):.1f} ms, "
            f"prefill tokens median {statistics.median(prefill):.0f}, "
            f"{sum(p > 256 for p in prefill) / len(prefill):.0%} over 256, "
            f"decode only {sum(p == 0 for p in prefill)}"
        )


if __name__ == "__main__":
    main()
