"""The most tokens/s a mode can gain over the global pause, as the RL report
works it out from the global mode's engine rate outside syncs and over the
whole mode, and how much of it each mode won, in engine tokens (the
ceiling's measure) and, beside it, in the tenants' median tokens/s."""

from __future__ import annotations

from typing import Any

import pytest

from examples.rl.report import ceiling_lines, sync_ceiling


def mode(outside: float, whole: float, tok_s: float | None) -> dict[str, Any]:
    return {
        "engine_tok_s_outside_swaps": outside,
        "engine_tok_s": whole,
        "median_over_tenants": {"tokens_per_s": tok_s},
    }


def test_the_ceiling_is_the_global_engines_loss_to_syncs_and_won_is_the_engine_share() -> None:
    modes = {
        "per_adapter": mode(1000.0, 1040.0, 105.0),
        "global": mode(1100.0, 1000.0, 100.0),
        "global#2": mode(1300.0, 1000.0, 100.0),  # the mean: 1200 outside, 1000 whole
        "per_adapter#2": mode(1000.0, 1060.0, 115.0),
    }
    found = sync_ceiling(modes)
    assert found is not None
    assert found["ceiling"] == pytest.approx(1.2)
    assert found["engine_outside_over_whole"]["per_adapter"] == pytest.approx(1000 / 1050)
    assert found["engine_tokens_per_s_over_global"]["per_adapter"] == pytest.approx(1.05)
    assert found["won"]["per_adapter"] == pytest.approx(0.05 / 0.2)
    assert found["tenants_tokens_per_s_over_global"]["per_adapter"] == pytest.approx(1.10)
    lines = ceiling_lines(modes)
    assert lines[0].startswith("global: its engine made 1.200x")
    assert lines[1] == (
        "per_adapter: engine tokens/s 1.050x the global pause's (25% of the gain); "
        "tenants' median tokens/s 1.100x"
    )


def test_no_ceiling_without_a_global_mode_and_none_won_when_syncs_cost_it_nothing() -> None:
    alone = {"per_adapter": mode(1000.0, 990.0, 105.0)}
    assert sync_ceiling(alone) is None
    assert ceiling_lines(alone) == []
    free = {"global": mode(900.0, 1000.0, 100.0), "finish_old": mode(1.0, 1200.0, 120.0)}
    found = sync_ceiling(free)
    assert found is not None
    assert found["won"] == {"finish_old": None}
    assert "n/a" in ceiling_lines(free)[1]
