"""When the GPU ran a staging's work, from the staging profiler's traces.

``python scripts/probes/staging_trace.py DIR [--match handover]`` reads the
``staging-*.json`` traces that ``SKYRL_STAGING_PROFILE=DIR,N`` leaves
(``server/loading/staging_profile.py``) and prints, for each staging:

- its window, and how much of it the GPU spent on other streams' work that
  the trace holds (on an H100 at 3b61c2a it held none of the engine's
  CUDA-graph kernels, so this read 0-15% even under load: a low figure
  does not say the engine was idle);
- each kernel, copy and memset the staging queued: the wait between its
  launch on the CPU and its start on the GPU, and its own time;
- the CUDA runtime calls that held the staging thread longest (a
  ``cudaStreamSynchronize`` spins until the GPU has run what it waits for).

Then, pooled over the stagings that ran beside the engine and those that
ran alone: the medians of the staging GPU work's queue wait and the
synchronizes' time. A queue wait near a step's length says the staging's
work ran after the engine's kernels, not beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _load(path: Path) -> list[dict[str, Any]]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def analyse(path: Path) -> dict[str, Any]:
    events = [e for e in _load(path) if e.get("ts", 0) > 0]  # a few come stamped 0
    # the staging thread: where the profiler recorded torch's ops (CUPTI
    # records every thread's runtime calls, the step loop's launches too)
    ops = [e["tid"] for e in events if e.get("cat") == "cpu_op"]
    tid = max(set(ops), key=ops.count)
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and e["tid"] == tid and "correlation" in e["args"]
    }
    cpu = [e for e in events if e.get("tid") == tid and e.get("cat") in ("cpu_op", "cuda_runtime")]
    start = min(e["ts"] for e in cpu)
    end = max(e["ts"] + e["dur"] for e in cpu)
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    ours, others = [], []
    for e in gpu:
        launch = runtime.get(e["args"].get("correlation"))
        (ours if launch is not None else others).append((e, launch))
    other_busy = _covered([(e["ts"], e["ts"] + e["dur"]) for e, _ in others], start, end)
    queued = [
        {
            "name": e["name"][:60],
            "stream": e["args"].get("stream"),
            "queue_ms": (e["ts"] - launch["ts"]) / 1000,
            "gpu_ms": e["dur"] / 1000,
            "at_ms": (launch["ts"] - start) / 1000,
        }
        for e, launch in ours
    ]
    calls: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["tid"] == tid:
            calls[e["name"]].append(e["dur"] / 1000)
    return {
        "name": path.stem,
        "window_ms": (end - start) / 1000,
        "others_busy": other_busy / max(end - start, 1e-9),
        "queued": queued,
        "calls": {k: (len(v), sum(v), max(v)) for k, v in calls.items()},
    }


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of ``[lo, hi]`` the spans cover (overlaps counted once)."""
    total, reach = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--match", default="", help="only traces whose name holds this")
    parser.add_argument("--busy", type=float, default=0.3, help="others' share that counts as load")
    args = parser.parse_args()
    pooled: dict[str, dict[str, list[float]]] = {
        side: defaultdict(list) for side in ("beside the engine", "alone")
    }
    for path in sorted(Path(args.folder).glob("staging-*.json"), key=lambda p: p.stat().st_mtime):
        if args.match not in path.name:
            continue
        found = analyse(path)
        side = "beside the engine" if found["others_busy"] >= args.busy else "alone"
        print(
            f"== {found['name']}: {found['window_ms']:.1f} ms, "
            f"the GPU busy with other streams {found['others_busy']:.0%} of it ({side})"
        )
        for q in found["queued"]:
            print(
                f"  +{q['at_ms']:6.1f} ms  stream {q['stream']}  queued {q['queue_ms']:6.2f}  "
                f"ran {q['gpu_ms']:5.2f}  {q['name']}"
            )
            pooled[side]["queue_ms"].append(q["queue_ms"])
        top = sorted(found["calls"].items(), key=lambda kv: -kv[1][1])[:6]
        for name, (count, total, longest) in top:
            print(f"  {name:32s} x{count:<4d} {total:7.2f} ms (longest {longest:.2f})")
        sync = found["calls"].get("cudaStreamSynchronize", (0, 0.0, 0.0))[1]
        pooled[side]["sync_ms"].append(sync)
        pooled[side]["window_ms"].append(found["window_ms"])
    for side, figures in pooled.items():
        if not figures:
            continue
        line = ", ".join(
            f"{k} median {statistics.median(v):.2f} max {max(v):.2f} (n={len(v)})"
            for k, v in figures.items()
        )
        print(f"== {side}: {line}")


if __name__ == "__main__":
    main()
