"""The RL report's test of why the per-adapter engine runs slower outside
syncs: its rate cut by how many learners train at once, and what the global
mode's rates at each number predict for another mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from examples.rl.colocation import overlap_explains, overlap_lines, rate_by_training
from examples.rl.engine_rate import EngineTokenCounter, depth, exclusive_windows, uncovered

#: engine tokens/s by learners training at once: each one slows the engine
SLOWED = {0: 1000.0, 1: 800.0, 2: 600.0}


def counter_of(
    rate: Callable[[float], float], end: float, step: float = 0.01
) -> EngineTokenCounter:
    """A counter read every ``step`` seconds from 0 to ``end`` of an engine
    making ``rate(t)`` tokens/s."""
    counter = EngineTokenCounter("http://engine")
    total = 0.0
    for i in range(round(end / step) + 1):
        t = i * step
        if i:
            total += rate(t - step / 2) * step
        counter.times.append(t)
        counter.readings["vllm:generation_tokens_total"].append(total)
    return counter


def mode(
    training: list[tuple[float, float]],
    syncs: list[tuple[float, float]],
    rates: dict[int, float],
    end: float = 10.0,
) -> dict[str, Any]:
    def rate(t: float) -> float:
        if any(a <= t < b for a, b in syncs):
            return 0.0
        return rates[sum(a <= t < b for a, b in training)]

    found = rate_by_training(counter_of(rate, end), uncovered(syncs, 0.0, end), training)
    return {"engine_by_learners_training": found}


def test_depth_counts_the_windows_over_each_piece() -> None:
    windows = [(1.0, 3.0), (2.0, 4.0), (8.0, 12.0)]
    assert depth(windows, 0.0, 10.0) == [
        (0.0, 1.0, 0),
        (1.0, 2.0, 1),
        (2.0, 3.0, 2),
        (3.0, 4.0, 1),
        (4.0, 8.0, 0),
        (8.0, 10.0, 1),
    ]
    assert depth([], 0.0, 1.0) == [(0.0, 1.0, 0)]
    assert exclusive_windows(windows) == [(1.0, 2.0), (3.0, 4.0), (8.0, 12.0)]
    assert exclusive_windows([]) == []


def test_the_rate_outside_syncs_is_cut_by_learners_training() -> None:
    found = mode([(2.0, 4.0), (3.0, 5.0)], [(6.0, 7.0)], SLOWED)["engine_by_learners_training"]
    assert found.keys() == {"0", "1", "2"}
    assert [found[n]["seconds"] for n in "012"] == pytest.approx([6.0, 2.0, 1.0])
    assert [found[n]["share"] for n in "012"] == pytest.approx([6 / 9, 2 / 9, 1 / 9])
    assert [found[n]["tok_s"] for n in "012"] == pytest.approx([1000.0, 800.0, 600.0])


def test_an_engine_slowed_only_by_the_overlap_is_explained_whole() -> None:
    """The per-adapter mode trains beside the engine more (no learner trains
    inside a pause of its own): the same rates at each number predict its
    slower rate outside syncs exactly."""
    modes = {
        "global": mode([(2.0, 4.0), (3.0, 5.0), (6.5, 7.5)], [(6.0, 7.0)], SLOWED),
        "per_adapter": mode([(1.0, 5.0), (2.0, 6.0)], [(6.0, 6.1)], SLOWED),
        "global#2": mode([(2.0, 4.0), (6.5, 7.5)], [(6.0, 7.0)], SLOWED),
    }
    found = overlap_explains(modes)
    assert found is not None
    ours, theirs = found["per_adapter"], found["global"]
    assert ours["tok_s"] < theirs["tok_s"]
    assert ours["predicted_tok_s"] == pytest.approx(ours["tok_s"])
    assert ours["own_pace"] == pytest.approx(1.0)
    assert ours["overlap_over_global"] == pytest.approx(ours["over_global"])
    assert ours["over_global"] < 1.0
    assert ours["none_training_over_global"] == pytest.approx(1.0)
    assert ours["mean_learners_training"] > theirs["mean_learners_training"]
    assert theirs["by_learners_training"] == pytest.approx({"0": 1000.0, "1": 800.0, "2": 600.0})


def test_an_engine_slower_on_its_own_is_not_explained() -> None:
    """An engine 10% slower at every number of learners training: the overlap
    predicts only part of its gap, and the pieces with none training show
    the rest."""
    slower = {n: 0.9 * r for n, r in SLOWED.items()}
    modes = {
        "global": mode([(2.0, 4.0)], [(6.0, 7.0)], SLOWED),
        "per_adapter": mode([(1.0, 5.0), (2.0, 6.0)], [(6.0, 6.1)], slower),
    }
    found = overlap_explains(modes)
    assert found is not None
    ours = found["per_adapter"]
    assert ours["none_training_over_global"] == pytest.approx(0.9)
    # the global mode never had two training: its rate with one stands in
    assert ours["predicted_tok_s"] > ours["tok_s"]
    # below 0.9x: the stand-in overrates what two learners training leave it
    assert ours["own_pace"] < 0.9
    assert ours["over_global"] == pytest.approx(ours["overlap_over_global"] * ours["own_pace"])
    lines = overlap_lines(modes)
    assert lines[0].startswith("global: engine tok/s outside syncs ")
    assert lines[1].endswith("; with none training 0.900x the global's")


def test_a_mode_close_to_the_global_keeps_stable_ratios() -> None:
    """A mode about 1% slower than the global, whose engine is 5% faster at
    the same overlap but trains beside the learners more: a share of the
    small gap would read as hundreds of percent; the two factors stay near
    1.0x and multiply to the measured ratio."""
    modes = {
        "global": mode([(2.0, 3.0)], [(6.0, 7.0)], SLOWED),
        "per_adapter": mode([(1.0, 5.0)], [(6.0, 6.1)], {n: 1.05 * r for n, r in SLOWED.items()}),
    }
    found = overlap_explains(modes)
    assert found is not None
    ours = found["per_adapter"]
    assert ours["over_global"] == pytest.approx(ours["overlap_over_global"] * ours["own_pace"])
    assert ours["own_pace"] == pytest.approx(1.05)
    assert 0.9 < ours["over_global"] < 1.0
    assert " x its own pace 1.050x" in overlap_lines(modes)[1]


def test_nothing_to_compare_without_a_global_mode() -> None:
    alone = {"per_adapter": mode([(1.0, 2.0)], [], SLOWED)}
    assert overlap_explains(alone) is None
    assert overlap_lines(alone) == []
    faster = {
        "global": mode([(1.0, 5.0)], [(6.0, 7.0)], SLOWED),
        "finish_old": mode([], [], SLOWED),
    }
    found = overlap_explains(faster)
    assert found is not None
    assert found["finish_old"]["own_pace"] == pytest.approx(1.0)
    assert overlap_explains({"global": {"engine_by_learners_training": None}}) is None
