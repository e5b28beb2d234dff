"""The RL report's count of engine steps past the largest CUDA graph, from
vLLM's histogram of tokens per step."""

from __future__ import annotations

import pytest

from examples.rl.engine_rate import (
    STEPS,
    STEPS_IN_GRAPH,
    EngineTokenCounter,
    parse_counter,
)
from examples.rl.report import ModeRun, engine_steps

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


def test_steps_over_the_graph_are_counted_per_second() -> None:
    counter = EngineTokenCounter("http://engine")
    counter.times = [0.0, 2.0, 4.0]
    counter.readings[STEPS] = [0.0, 100.0, 300.0]
    counter.readings[STEPS_IN_GRAPH] = [0.0, 90.0, 250.0]
    found = engine_steps(ModeRun("per_adapter", {}, counter, 0.0, 4.0))
    assert found["steps_per_s"] == pytest.approx(75.0)
    assert found["over_graph_per_s"] == pytest.approx(12.5)
    # no tenant synced: outside every sync is the whole mode
    assert found["over_graph_per_s_outside_syncs"] == pytest.approx(12.5)
