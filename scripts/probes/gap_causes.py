"""What the engine did during the other tenants' longest gaps of a tenant curve.

``python scripts/probes/gap_causes.py scale.json scale_server.log`` (a Python
with skyrl_lora installed: ``.venv/bin/python`` here) takes each tenant point's ``longest_gaps_during_swaps``
of a ``benchmarks.scale`` JSON (times on the benchmark's monotonic clock,
converted with its ``wall_minus_monotonic_s``) and prints, for each, the
server's events that ended inside it or within 0.1 s after: the engine's
long steps (``engine_long_step``: what the step scheduled and what of ours
ran beside it), its garbage collections, stagings, pauses and resumes, in ms
relative to the gap's start, and, for JSONs that keep the windows (a tenant
point's `windows`), each window's long steps and API loop stalls beside the
others' tokens/s. Then every long step of the run, counted by what it
scheduled, and by how many tokens it scheduled in all (vLLM runs a step of
more tokens than its largest CUDA graph, 512 by default, eagerly), and the
long steps that ended within 0.3 s after a resume.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from skyrl_lora.server.telemetry.event_log import read_events

SHOWN = {"engine_long_step", "engine_gc_pause", "gc_pause", "adapter_staging", "pause", "resume",
         "snapshot_written", "event_loop_stall"}


def main() -> None:
    figures = json.loads(Path(sys.argv[1]).read_text())
    events = read_events(Path(sys.argv[2]).read_text().splitlines(), figures["wall_minus_monotonic_s"])
    for point in figures["tenants"]:
        print(f"== {point['tenants']} tenants")
        for gap in point["longest_gaps_during_swaps"][:6]:
            end = float(gap["at"])
            start = end - float(gap["ms"]) / 1000
            print(f"gap {gap['ms']} ms (round {gap['round']}, {gap['after_resume_ms']} ms after resume):")
            for e in events:
                if e.name in SHOWN and start - 0.02 <= e.at <= end + 0.1:
                    fields = {k: v for k, v in e.fields.items() if k != "event"}
                    print(f"   {(e.at - start) * 1000:+7.1f} {e.name} {json.dumps(fields)[:200]}")
        by_window(point, events)
    long_steps = [e.fields for e in events if e.name == "engine_long_step"]
    kinds = collections.Counter(
        ("prefill" if s["prefill_tokens"] else "decode only", tuple(s["busy"])) for s in long_steps
    )
    print(f"== {len(long_steps)} long steps: by what they scheduled and what ran beside")
    for (kind, busy), count in kinds.most_common():
        ms = sorted(s["ms"] for s in long_steps if ("prefill" if s["prefill_tokens"] else "decode only") == kind and tuple(s["busy"]) == busy)
        prefill = sorted(s["prefill_tokens"] for s in long_steps if ("prefill" if s["prefill_tokens"] else "decode only") == kind and tuple(s["busy"]) == busy)
        print(f"   {kind:12s} busy={list(busy)}: {count}, ms p50 {ms[len(ms) // 2]} p90 {ms[int(len(ms) * 0.9)]} max {ms[-1]}; "
              f"prefill tokens p50 {prefill[len(prefill) // 2]} max {prefill[-1]}")

    print("== long steps by the tokens they scheduled in all")
    for low, high in ((0, 256), (257, 512), (513, 768), (769, 1 << 30)):
        ms = sorted(s["ms"] for s in long_steps if low <= s["tokens"] <= high)
        if ms:
            print(f"   {low:4d}-{min(high, 99999):5d}: {len(ms)}, ms p50 {ms[len(ms) // 2]} max {ms[-1]}")
    resumes = [e.at for e in events if e.name == "resume"]
    after = [e.fields for e in events if e.name == "engine_long_step"
             and any(0 <= e.at - r <= 0.3 for r in resumes)]
    if after:
        print(f"== {len(after)} long steps within 0.3 s after the {len(resumes)} resumes: "
              f"ms max {max(s['ms'] for s in after)}, prefill tokens max "
              f"{max(s['prefill_tokens'] for s in after)}, tokens max {max(s['tokens'] for s in after)}")


def by_window(point: dict, events: list) -> None:
    """What each window of a tenant point cost the engine and the API loop:
    the engine's long steps (count, their ms in all) and the API event loop's
    stalls (ms in all), beside the others' tokens/s."""
    windows = point.get("windows")
    if not windows:
        return
    print(f"== {point['tenants']} tenants, by window: long steps (n, ms in all), API loop stalls (ms in all), others' tok/s")
    for w in windows:
        inside = [e for e in events if w["start"] <= e.at < w["end"]]
        steps = [e.fields["ms"] for e in inside if e.name == "engine_long_step"]
        stalls = [e.fields["ms"] for e in inside if e.name == "event_loop_stall"]
        print(f"   round {w['round']} {w['mode']:12s} {w['end'] - w['start']:4.1f} s: long steps {len(steps):3d} "
              f"{sum(steps):6.0f} ms, stalls {sum(stalls):5.0f} ms, {w['others_tok_s']:7.0f} tok/s")


if __name__ == "__main__":
    main()
