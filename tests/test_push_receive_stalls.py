"""``benchmarks.push_receive``'s account of the server loop's stalls: each
stall (logged at its end, stamped with the wall clock) counts for the send
whose span it overlaps, and only that send's route."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.push_receive import Span, loop_stalls


def _stall(at: float, ms: float, stack: list[str] | None = None) -> str:
    event = {"event": "event_loop_stall", "ms": ms}
    if stack is not None:
        event["stacks"] = [{"seen": 3, "stack": stack}]
    return f"{at:.6f} skyrl_event {json.dumps(event)}"


def test_stalls_count_for_the_send_they_overlap(tmp_path: Path) -> None:
    events = tmp_path / "events.log"
    events.write_text(
        "\n".join(
            [
                _stall(100.05, 20.0, ["a.py:1 f", "b.py:2 g", "c.py:3 recv"]),  # in lanes #1
                _stall(100.30, 10.0),  # between sends: nobody's
                _stall(101.02, 30.0),  # began in lanes #2's span, ended after it
                _stall(102.50, 8.0),  # in sink
                "1.0 some other line",
                f"100.2 skyrl_event {json.dumps({'event': 'push_stream_received'})}",
            ]
        )
    )
    spans = [Span("lanes", 100.0, 100.1), Span("lanes", 100.9, 101.0), Span("sink", 102.4, 102.6)]
    stalls = loop_stalls(events, spans)
    assert set(stalls) == {"lanes", "sink"}
    lanes = stalls["lanes"]
    assert lanes["sends"] == 2 and lanes["longest_stall_ms"] == 30.0
    assert lanes["stalled_ms_per_send"]["min"] == 20.0
    assert lanes["stalled_ms_per_send"]["max"] == 30.0
    assert lanes["stacks"] == [{"seen": 3, "innermost": ["a.py:1 f", "b.py:2 g", "c.py:3 recv"]}]
    assert stalls["sink"]["longest_stall_ms"] == 8.0


def test_no_events_file_means_no_stalls(tmp_path: Path) -> None:
    stalls = loop_stalls(tmp_path / "missing.log", [Span("push", 1.0, 2.0)])
    assert stalls["push"]["longest_stall_ms"] == 0.0
