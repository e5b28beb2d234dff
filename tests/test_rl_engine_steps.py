"""The RL report's engine steps: all of them and those past the largest CUDA
graph from vLLM's histogram of tokens per step, the long ones from the step
watch's events in the server's log."""

from __future__ import annotations

import json

import pytest

from examples.rl.engine_rate import STEPS, STEPS_IN_GRAPH, EngineTokenCounter, parse_counter
from examples.rl.report import ModeRun, engine_steps
from examples.rl.tenant import Swap, TenantLog
from skyrl_lora.server.telemetry.event_log import read_events

#: Two engines' lines as vLLM writes them (label order as the client sorts them).
METRICS = """\
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
vllm:iteration_tokens_total_bucket{engine="0",le="256.0",model_name="m"} 70.0
vllm:iteration_tokens_total_bucket{engine="0",le="512.0",model_name="m"} 90.0
vllm:iteration_tokens_total_bucket{engine="0",le="1024.0",model_name="m"} 100.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 100.0
vllm:iteration_tokens_total_bucket{engine="1",le="512.0",model_name="m"} 5.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 6.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 31000.0
"""


def test_a_selector_sums_only_the_lines_with_its_labels() -> None:
    assert parse_counter(METRICS, STEPS) == 106
    assert parse_counter(METRICS, STEPS_IN_GRAPH) == 95
    assert parse_counter(METRICS, 'vllm:iteration_tokens_total_bucket{le="256.0"}') == 70
    # a name without a selector does not take a longer name's lines
    assert parse_counter(METRICS, "vllm:iteration_tokens_total") == 0


def _long_step(at: float, ms: float, tokens: int, suppressed: int = 0) -> str:
    """One long step's line as the engine process logs it (``at``: wall-clock seconds)."""
    fields = {"event": "engine_long_step", "at": at, "ms": ms, "tokens": tokens}
    fields |= {"suppressed": suppressed}
    return f"(EngineCore pid=1) INFO 11-27 05:54:38 [x.py:93] skyrl_event {json.dumps(fields)}"


LOG = "\n".join(
    [_long_step(1000.5, 60.0, 650), _long_step(1001.5, 80.0, 400, 2), _long_step(1009.0, 70, 900)]
)


def _run(swaps: list[Swap], events: str | None) -> ModeRun:
    """A mode from 0 to 4 s on the counter's clock, which is the wall clock less 1000 s."""
    counter = EngineTokenCounter("http://engine")
    counter.times = [0.0, 2.0, 4.0]
    counter.readings[STEPS] = [0.0, 100.0, 300.0]
    counter.readings[STEPS_IN_GRAPH] = [0.0, 90.0, 250.0]
    log = TenantLog("t0")
    log.swaps.extend(swaps)
    read = None if events is None else read_events(events.splitlines(), 1000.0)
    return ModeRun("per_adapter", {"t0": log}, counter, 0.0, 4.0, engine_events=read)


def test_long_steps_come_from_the_server_log_on_the_runs_clock() -> None:
    found = engine_steps(_run([], LOG))
    assert found["steps_per_s"] == pytest.approx(75.0)
    assert found["over_graph_per_s"] == pytest.approx(12.5)
    # two events inside the mode (the third is at 9 s), one of them counting
    # two unwritten long steps before it: 4 long steps in 4 s
    assert found["long_steps_per_s"] == pytest.approx(1.0)
    # only the written steps' time is known: 140 ms of 4 s
    assert found["long_step_share"] == pytest.approx(0.035)
    assert found["long_steps_over_graph_share"] == pytest.approx(0.5)
    # no tenant synced: outside every sync is the whole mode
    assert found["long_steps_per_s_outside_syncs"] == found["long_steps_per_s"]


def test_long_steps_inside_a_sync_are_not_counted_outside_syncs() -> None:
    sync = Swap(1.0, 2.0, 2, 0, 0.0)  # holds the event at 1.5 s
    found = engine_steps(_run([sync], LOG))
    assert found["long_steps_per_s_outside_syncs"] == pytest.approx(1 / 3)
    assert found["long_step_share_outside_syncs"] == pytest.approx(0.06 / 3)
    assert found["long_steps_over_graph_share_outside_syncs"] == 1.0
    assert found["steps_per_s_outside_syncs"] == pytest.approx(250 / 3)
    assert found["over_graph_per_s_outside_syncs"] == pytest.approx((250 - 205) / 3)


def test_without_a_server_log_the_long_steps_are_unknown_not_zero() -> None:
    found = engine_steps(_run([], None))
    assert found["steps_per_s"] == pytest.approx(75.0)
    assert found["long_steps_per_s"] is None and found["long_step_share"] is None
    assert found["long_steps_over_graph_share"] is None


def test_a_gpu_run_reads_its_servers_log_onto_every_modes_clock(tmp_path) -> None:
    from examples.multi_tenant_rl import with_engine_events

    log = tmp_path / "rl_gpu_server.log"
    log.write_text(LOG + "\nan unrelated line\n")
    runs = with_engine_events([_run([], None), _run([], None)], log, 1000.0)
    assert [len(r.engine_events or []) for r in runs] == [3, 3]
    assert engine_steps(runs[1])["long_steps_per_s"] == pytest.approx(1.0)
