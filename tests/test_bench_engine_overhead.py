"""Pure tests of the engine-overhead row's arithmetic and verdict (no server)."""

from __future__ import annotations

import pytest

from benchmarks.engine_overhead import MIN_RATIO, Overhead, Window
from benchmarks.stats import UntrustworthyRunError


def windows(rates: list[float], gaps: tuple[float, ...] = (10.0, 20.0, 30.0)) -> list[Window]:
    return [Window(r, gaps) for r in rates]


def test_ratio_is_taken_per_round_then_summarised() -> None:
    run = Overhead({"ours": windows([90, 100, 120]), "vllm": windows([100, 100, 100])})
    assert run.ratios == pytest.approx([0.9, 1.0, 1.2])
    assert (run.ratio.median, run.ratio.min, run.ratio.max) == pytest.approx((1.0, 0.9, 1.2))
    assert run.passed
    assert "ok" in run.verdict() and "REGRESSION" not in run.row()[4]


def test_a_slower_engine_is_flagged_in_the_line_the_row_and_the_json() -> None:
    slow = MIN_RATIO - 0.05
    run = Overhead({"ours": windows([100 * slow] * 3), "vllm": windows([100.0] * 3)})
    assert not run.passed
    assert run.verdict().startswith("engine overhead REGRESSION")
    assert run.row()[4].startswith("REGRESSION")
    figures = run.to_json()
    assert figures["passed"] is False and figures["min_ratio"] == MIN_RATIO


def test_gaps_are_each_rounds_tail_summarised_over_rounds() -> None:
    run = Overhead(
        {"ours": [Window(1, (1.0, 2.0, 9.0)), Window(1, (3.0, 4.0, 5.0))], "vllm": windows([1, 1])}
    )
    gaps = run.gaps("ours")
    assert (gaps["max"].min, gaps["max"].max) == (5.0, 9.0)
    assert (gaps["p50"].min, gaps["p50"].max) == (2.0, 4.0)


def test_a_window_without_tokens_or_unpaired_rounds_is_untrustworthy() -> None:
    with pytest.raises(UntrustworthyRunError, match="vllm streamed no tokens in rounds \\[1\\]"):
        Overhead({"ours": windows([1, 1]), "vllm": [Window(1, (1.0,)), Window(0, ())]}).check()
    with pytest.raises(ValueError, match="unpaired"):
        Overhead({"ours": windows([1, 1]), "vllm": windows([1])}).check()
