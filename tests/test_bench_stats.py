"""Pure tests of the benchmarks' statistics and sanity checks (no engine)."""

from __future__ import annotations

import datetime
import itertools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import timeline
from benchmarks.common import TokenMeter, completion_lengths
from benchmarks.isolation import IsolationConfig, IsolationResult, Window
from benchmarks.report import spread_row, table
from benchmarks.stats import (
    Gap,
    IsolationChecks,
    RoundBaselines,
    Spread,
    Tail,
    UntrustworthyRunError,
    check_count,
    check_isolation,
    overlaps,
    percentile,
    split_gaps,
    tails_spread,
)
from benchmarks.stream_process import TenantRecord
from benchmarks.streams import StreamLog

CHECKS = IsolationChecks(baseline_tolerance=0.2)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0


def test_percentile_of_nothing_raises() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_spread_and_tail() -> None:
    s = Spread.of([1.2, 0.9, 1.0])
    assert (s.median, s.min, s.max, s.rounds) == (1.0, 0.9, 1.2, 3)
    assert s.width == pytest.approx(0.3)
    assert s.fmt(".2f", "x") == ("1.00x", "0.90-1.20x")
    tail = Tail.of([float(v) for v in range(1, 201)])
    assert (tail.p50, tail.p99, tail.max, tail.count) == (100, 198, 200, 200)
    summary = tails_spread([Tail.of([1.0, 2.0]), Tail.of([5.0, 9.0]), Tail.of([3.0])])
    assert summary["max"] == Spread(3.0, 2.0, 9.0, 3)
    with pytest.raises(ValueError):
        Spread.of([])


def test_gaps_split_by_overlap_with_swap_windows() -> None:
    windows = [(1.0, 1.3), (2.0, 2.3)]
    inside = Gap(0.95, 1.05)  # straddles the start of a swap
    within = Gap(2.1, 2.2)
    after = Gap(1.3, 1.4)  # touches the end only: outside
    before = Gap(0.5, 0.6)
    assert overlaps(inside, windows) and overlaps(within, windows)
    assert not overlaps(after, windows) and not overlaps(before, windows)
    during, outside = split_gaps([inside, within, after, before], windows)
    assert during == pytest.approx([100.0, 100.0])
    assert outside == pytest.approx([100.0, 100.0])


def test_stream_log_rates_and_gaps() -> None:
    log = StreamLog("b", streams=[[(0.1, 1), (0.2, 1), (0.6, 2)], [(0.15, 1), (1.5, 1)]])
    assert log.tokens_in(0.0, 1.0) == 5
    bulk = TokenMeter([(0.0, 2.0, "b", 8), (0.0, 1.0, "c", 50)])  # half of b's 8 tokens in [0, 1)
    assert TenantRecord(log, bulk).rate(0.0, 1.0) == 9.0
    gaps = log.gaps(0.0, 1.0)  # the 0.15 -> 1.5 gap leaves the window: not counted
    assert sorted(round(g.ms) for g in gaps) == [100, 400]


def test_isolation_checks_pass_on_a_plausible_run() -> None:
    check_isolation([100, 104, 98, 101], [0.7, 0.75, 0.72], {"global": [3, 3, 3]}, 3, CHECKS)


def test_global_pause_that_does_not_cost_the_others_fails_loudly() -> None:
    with pytest.raises(UntrustworthyRunError) as err:
        check_isolation([100, 101, 99, 100], [0.8, 1.05, 0.7], {"global": [3, 3, 3]}, 3, CHECKS)
    assert err.value.check == "global pause costs the others"
    assert "1.05x" in str(err.value)


def test_round_baselines_follow_a_slow_drift() -> None:
    # 15% from end to end, but every neighbour within 20% of the next
    rounds = RoundBaselines.of([100, 95, 90, 85], 0.2)
    assert rounds.per_round == pytest.approx((97.5, 92.5, 87.5))
    assert rounds.lone == ()
    check_isolation([100, 95, 90, 85], [0.7, 0.7, 0.7], {"global": [3, 3, 3]}, 3, CHECKS)


def test_a_lone_hiccup_window_is_set_aside() -> None:
    rounds = RoundBaselines.of([100, 60, 98, 101], 0.2)
    assert rounds.lone == (1,)
    assert rounds.per_round == (100, 98, 99.5)  # rounds 0 and 1 take their other side alone
    first = RoundBaselines.of([60, 100, 98], 0.2)  # the first window, low after warm-up
    assert (first.lone, first.per_round) == ((0,), (100, 99))
    two = RoundBaselines.of([60, 100], 0.2)  # no third window to say which one is off
    assert (two.lone, two.per_round) == ((), (None,))
    assert RoundBaselines.of([100], 0.2) == RoundBaselines((), ())
    check_isolation([100, 60, 98, 101], [0.7, 0.7, 0.7], {"global": [3, 3, 3]}, 3, CHECKS)


def test_a_machine_that_changes_under_the_run_fails_loudly() -> None:
    step = RoundBaselines.of([100, 100, 130, 130], 0.2)  # a step, not a hiccup
    assert step.per_round == (100, None, 130) and step.lone == ()
    check_isolation([100, 100, 130, 130], [0.7, 0.7], {}, 3, CHECKS)  # 2 of 3 rounds kept
    with pytest.raises(UntrustworthyRunError) as err:
        check_isolation([100, 130, 100, 130], [0.7], {}, 3, CHECKS)
    assert err.value.check == "stable baseline"
    assert "tolerance 20%" in str(err.value)
    with pytest.raises(UntrustworthyRunError, match="disagree with every neighbour"):
        check_isolation([100, 60, 100, 60, 100], [0.7], {}, 3, CHECKS)


def test_fewer_swaps_than_planned_fails_loudly() -> None:
    with pytest.raises(UntrustworthyRunError) as err:
        check_isolation(
            [100, 100, 100, 100], [0.7, 0.7, 0.7], {"per_adapter": [3, 2, 3]}, 3, CHECKS
        )
    assert err.value.check == "planned swaps"


def test_no_load_fails_loudly() -> None:
    with pytest.raises(UntrustworthyRunError) as err:
        check_isolation([0, 0, 0, 0], [0.5], {}, 3, CHECKS)
    assert err.value.check == "load"


def test_check_count() -> None:
    check_count("x", 3, 3, "things")
    with pytest.raises(UntrustworthyRunError, match="2 of 3 things"):
        check_count("x", 2, 3, "things")


def _window(rnd: int, mode: str, others_rate: float, swaps: int = 0) -> Window:
    return Window(rnd, mode, 0.0, 1.0, others_rate, [(0.0, 0.1)] * swaps)


def test_round_ratio_uses_the_no_swap_windows_around_it() -> None:
    windows = [
        _window(0, "no_swap", 100),
        _window(0, "per_adapter", 99, 3),
        _window(0, "global", 70, 3),
        _window(1, "no_swap", 120),  # closes round 0, opens round 1
        _window(1, "per_adapter", 121, 3),
        _window(1, "global", 88, 3),
        _window(2, "no_swap", 122),
    ]
    res = IsolationResult(
        IsolationConfig(rounds=2, checks=IsolationChecks(0.25)),
        windows,
        [],
        None,  # type: ignore[arg-type]
        ratios={},
        baseline=Spread.of([100]),
        stall={},
    )
    assert res.per_round("per_adapter") == pytest.approx([0.9, 121 / 121])
    assert res.per_round("global") == pytest.approx([70 / 110, 88 / 121])
    # pooled: every round's tokens over every round's expected tokens (equal windows)
    assert res.pooled("per_adapter") == pytest.approx((99 + 121) / (110 + 121))
    res.check()  # neighbours within 25% of each other
    # within 10%, the first window (100 against 120) is a hiccup: round 0 takes 120 alone
    strict = replace(res, config=IsolationConfig(rounds=2, checks=IsolationChecks(0.1)))
    assert strict.per_round("per_adapter") == pytest.approx([99 / 120, 1.0])
    strict.check()
    stricter = replace(res, config=IsolationConfig(rounds=2, checks=IsolationChecks(0.01)))
    assert stricter.per_round("per_adapter") == []  # no round has a baseline
    assert math.isnan(stricter.pooled("per_adapter"))
    with pytest.raises(UntrustworthyRunError, match="stable baseline"):
        stricter.check()


def test_table_has_the_readme_columns() -> None:
    row = spread_row("iso", Spread.of([0.9, 1.0, 1.1]), ".2f", "x", ">= 0.95x", "d")
    assert row == ("iso", "1.00x", "0.90-1.10x", ">= 0.95x", "d")
    lines = table([row]).splitlines()
    assert lines[0] == "| measure | result (median) | min-max | target | detail |"
    assert lines[2] == "| iso | 1.00x | 0.90-1.10x | >= 0.95x | d |"


def test_completion_lengths_vary_around_the_mean_and_repeat_per_seed() -> None:
    draws = list(itertools.islice(completion_lengths(32, 0.5, seed="iso-b:3"), 400))
    assert min(draws) >= 16 and max(draws) <= 48
    assert len(set(draws)) > 10  # streams drift apart instead of marching in step
    assert abs(statistics.mean(draws) - 32) < 2
    again = list(itertools.islice(completion_lengths(32, 0.5, seed="iso-b:3"), 400))
    other = list(itertools.islice(completion_lengths(32, 0.5, seed="iso-c:3"), 400))
    assert draws == again and draws != other
    assert set(itertools.islice(completion_lengths(32, 0.0, seed="x"), 50)) == {32}


def test_timeline_puts_server_stalls_in_the_windows_they_fell_in() -> None:
    # Wall clock 2026-01-01 00:00:10.000 UTC is monotonic 10.0 on this made-up machine.
    offset = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
    event = "2026-01-01 00:00:{} INFO skyrl_lora.events: skyrl_event {}"
    log = [
        event.format("10,100", '{"event": "pause"}'),
        event.format("10,150", '{"event": "event_loop_stall", "ms": 12.5}'),
        "2026-01-01 00:00:10,160 INFO vllm: not an event line",
        event.format("11,500", '{"event": "event_loop_stall", "ms": 30.0}'),
        event.format("12,100", '{"event": "event_loop_stall", "ms": 11.0}'),
        event.format("10,200", '{"event": "gc_pause", "generation": 2, "ms": 14.0}'),
        # vLLM's engine process: its stamp has no year or ms; the event has its own time.
        "(EngineCore_DP0 pid=7) INFO 01-01 00:00:11 [staging.py:9] skyrl_event "
        + json.dumps(
            {"event": "engine_gc_pause", "at": offset + 10.25, "generation": 1, "ms": 6.5}
        ),
    ]
    run = {
        "spread": {
            "windows": [
                {"mode": "per_adapter", "start": 10.0, "end": 11.0, "swaps": [[10.1, 10.4]]},
                {"mode": "global", "start": 12.0, "end": 13.0, "swaps": [[12.05, 12.3]]},
            ]
        }
    }
    events = timeline.read_events(log, offset)
    names = ["pause"] + ["event_loop_stall"] * 3 + ["gc_pause", "engine_gc_pause"]
    assert [e.name for e in events] == names
    assert events[-1].at == pytest.approx(10.25) and "at" not in events[-1].fields
    engine = timeline.stall_summary(run, events, "engine_gc_pause")
    assert engine == {"per_adapter": [6.5], "global": [], "outside": []}
    assert events[0].at == pytest.approx(10.1)
    summary = timeline.stall_summary(run, events)
    assert summary == {"per_adapter": [12.5], "global": [11.0], "outside": [30.0]}
    collections = timeline.stall_summary(run, events, "gc_pause")
    assert collections == {"per_adapter": [14.0], "global": [], "outside": []}
    assert "event_loop_stall" in "\n".join(timeline.swap_timeline(run, events))


def test_timeline_rates_stalls_per_second_and_names_their_stacks() -> None:
    offset = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
    event = "2026-01-01 00:00:{} INFO skyrl_lora.events: skyrl_event {}"

    def stall(at: str, *frames: str) -> str:
        stacks = [{"seen": 4, "stack": list(frames)}] if frames else []
        return event.format(
            at, json.dumps({"event": "event_loop_stall", "ms": 12.0, "stacks": stacks})
        )

    log = [
        stall("10,150", "app.py:1 main", "h11.py:2 send", "sel.py:3 write"),
        stall("10,300", "app.py:1 main", "h11.py:2 send", "sel.py:3 write"),
        stall("10,350", "app.py:1 main", "routing.py:9 matches"),
        stall("11,500", "app.py:1 main", "h11.py:2 send", "sel.py:3 write"),
        stall("11,600"),  # logged without --stall-stacks: counted, no stack
    ]
    run = {
        "spread": {
            "windows": [
                {"mode": "per_adapter", "start": 10.0, "end": 11.0, "swaps": [[10.1, 10.4]]},
                {"mode": "global", "start": 11.0, "end": 12.0, "swaps": [[11.05, 11.3]]},
            ]
        }
    }
    events = timeline.read_events(log, offset)
    seconds = timeline.seconds_by_kind(run)
    assert seconds == pytest.approx({"per_adapter": 0.3, "global": 0.25, "outside": 1.45})
    stacks = timeline.stall_stacks(run, events, frames=2)
    assert stacks == {
        "per_adapter": [
            (2, "sel.py:3 write <- h11.py:2 send"),
            (1, "routing.py:9 matches <- app.py:1 main"),
        ],
        "outside": [(1, "sel.py:3 write <- h11.py:2 send")],
    }
    report = "\n".join(timeline.report({"wall_minus_monotonic_s": offset, **run}, log))
    assert "per_adapter 3 in 0.3 s (10.00/s" in report
    assert "outside 2 in 1.4 s (1.38/s" in report


def test_timeline_shows_what_ran_during_the_longest_stalls() -> None:
    offset = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()

    def engine(event: str, at: float, **fields: object) -> str:
        line = json.dumps({"event": event, "at": offset + at, **fields})
        return f"(EngineCore_DP0 pid=7) INFO 01-01 00:00:10 [staging.py:9] skyrl_event {line}"

    read = {"ms": 30.0, "read": "one_buffer", "read_ms": 20.0, "reader_ms": None}
    log = [
        "2026-01-01 00:00:10,290 INFO skyrl_lora.events: skyrl_event "
        + json.dumps({"event": "event_loop_stall", "ms": 15.0}),
        # read 10.250-10.270, pack -10.275, slot -10.280: overlaps the first stall
        engine("adapter_staging", 10.28, lora_name="a@v2", pack_ms=5.0, slot_ms=5.0, **read),
        engine("adapter_staging", 12.0, lora_name="a@v3", pack_ms=10.0, slot_ms=None, **read),
    ]
    stall = {"round": 0, "after_pause_ms": 300.0, "after_resume_ms": -20.0, "streams": 8}
    run = {
        "spread": {
            "longest_gaps_during_swaps": [
                {"ms": 26.0, "at": 10.3, **stall},
                {"ms": 20.0, "at": 11.0, **stall},
                {"ms": 19.0, **stall},  # recorded before stalls had a time: left out
            ]
        }
    }
    lines = timeline.longest_stalls(run, timeline.read_events(log, offset))
    assert len(lines) == 2
    assert "26.0 ms   8 streams" in lines[0]
    assert "event_loop_stall 15.0 ms at -10" in lines[0]
    assert "staging a@v2 (read -50..-30, pack -30..-25, slot -25..-20)" in lines[0]
    assert "a@v3" not in lines[0] and lines[1].endswith("|  -")


def test_a_swap_owns_the_gaps_of_its_aftermath() -> None:
    """The swapper's resumed requests re-prefill right after the resume: a gap
    then is the swap's (``aftermath_s``), a gap later is outside it."""
    from benchmarks.common import TokenMeter
    from benchmarks.isolation import Window, _stall
    from benchmarks.stream_process import TenantRecord
    from benchmarks.streams import StreamLog

    # pause at 1.0, resume answered at 1.4; arrivals every 10 ms but for a 60 ms
    # gap from 1.44 (the re-prefill step) and a 30 ms gap from 1.70 (well after).
    times = [1.0 + i / 100 for i in range(45)] + [1.5 + i / 100 for i in range(21)] + [1.73]
    record = TenantRecord(StreamLog("b", [[(t, 1) for t in times]]), TokenMeter())
    window = Window(0, "per_adapter", 1.0, 2.0, 0.0, [(1.0, 1.4)])
    tails = _stall([window], [record], aftermath_s=0.2)
    assert tails["per_adapter_during_swap"]["max"].median == pytest.approx(60, abs=0.5)
    assert tails["per_adapter_outside_swap"]["max"].median == pytest.approx(30, abs=0.5)
    before = _stall([window], [record], aftermath_s=0.0)
    assert before["per_adapter_during_swap"]["max"].median == pytest.approx(10, abs=0.5)
    assert before["per_adapter_outside_swap"]["max"].median == pytest.approx(60, abs=0.5)


def test_longest_gaps_during_swaps_are_placed_in_their_swap() -> None:
    from benchmarks.isolation import longest_during_swaps
    from benchmarks.stream_process import TenantRecord
    from benchmarks.streams import StreamLog

    # One stream: tokens every 10 ms, but 40 ms late once in the hold of the
    # first swap and 25 ms late once just after its resume; a 60 ms gap
    # outside every swap (and its window) does not count.
    times = [0.00, 0.01, 0.02, 0.06, 0.07, 0.08, 0.09, 0.10, 0.125, 0.135, 0.40, 0.41]
    log = StreamLog("iso-b")
    log.streams.append([(t, 1) for t in times])
    log.streams.append([(0.03, 1), (0.0605, 1)])  # held by the same stall: one more stream
    others = [TenantRecord(log, None)]  # type: ignore[arg-type]
    windows = [
        Window(0, "per_adapter", 0.0, 0.2, 0.0, [(0.015, 0.1)]),
        Window(0, "global", 0.2, 0.5, 0.0, [(0.3, 0.45)]),
    ]
    longest = longest_during_swaps(windows, others, aftermath_s=0.05, top=2)
    assert longest == [
        {"ms": 40.0, "round": 0, "after_pause_ms": 45.0, "after_resume_ms": -40.0, "streams": 2}
        | {"at": 0.06},
        {"ms": 25.0, "round": 0, "after_pause_ms": 110.0, "after_resume_ms": 25.0, "streams": 1}
        | {"at": 0.125},
    ]


def test_ab_rounds_alternate_their_order_and_the_ab_is_written_and_checked(
    tmp_path: Path,
) -> None:
    import argparse
    import asyncio

    from benchmarks.common import finish_ab, interleaved_rates

    ran: list[str] = []

    async def rate(variant: str) -> float:
        ran.append(variant)
        return 100.0 if variant == "a" else 50.0

    rates = asyncio.run(interleaved_rates(["a", "b"], 3, rate))
    assert ran == ["a", "b", "b", "a", "a", "b"]
    assert rates == {"a": [100.0] * 3, "b": [50.0] * 3}

    args = argparse.Namespace(
        commit="abc1234", machine="m", streams=2, round_s=1.0, json=tmp_path / "ab.json"
    )
    result = {"ratio": {"median": 2.0, "min": 2.0, "max": 2.0, "rounds": 3}, "ok": True}
    assert finish_ab(dict(result), args, tenants=3, ratio="ratio", what="a / b", check="ok") == 0
    written = json.loads(args.json.read_text())
    assert written["commit"] == "abc1234" and written["tenants"] == 3 and written["ok"]
    result["ok"] = False
    assert finish_ab(dict(result), args, tenants=3, ratio="ratio", what="a / b", check="ok") == 1


def test_step_budget_rounds_give_ratios_round_by_round_and_refuse_thin_tails() -> None:
    from benchmarks.stats import Tail
    from benchmarks.step_budget import Round, summarize, variants

    assert variants(256) == {
        "default": ["--no-graph-step-budget"],
        "budget256": ["--max-num-batched-tokens", "256", "--max-num-seqs", "256"],
    }
    base = [Round(1000.0, Tail.of([100.0] * 9 + [200.0])), Round(800.0, Tail.of([100.0] * 10))]
    cut = [Round(1100.0, Tail.of([150.0] * 9 + [400.0])), Round(1000.0, Tail.of([120.0] * 10))]
    out = summarize({"default": base, "budget256": cut}, "budget256")
    # Each round's ratio to the default's round beside it, not a ratio of medians.
    assert out["budget_over_default_tokens_per_s"] == {
        "median": 1.175, "min": 1.1, "max": 1.25, "rounds": 2
    }  # fmt: skip
    assert out["budget_over_default_first_token_p50"]["median"] == pytest.approx(1.35)
    assert out["budget_over_default_first_token_p99"]["max"] == 2.0
    assert out["first_token_ms"]["budget256"]["max"]["max"] == 400.0
    assert out["rounds"]["default"][0] == {
        "tokens_per_s": 1000.0, "p50": 100.0, "p99": 200.0, "max": 200.0, "count": 10
    }  # fmt: skip
    assert out["enough_prompts"]
    thin = [Round(1000.0, Tail.of([100.0] * 4)), base[1]]
    assert not summarize({"default": thin, "budget256": cut}, "budget256")["enough_prompts"]


def test_gate_pacing_times_a_backlog_let_in_a_steps_room_at_a_time() -> None:
    import uvloop

    from benchmarks.common import ROOT
    from benchmarks.gate_pacing import GATE, load_gate, per_step_ms

    gate = load_gate(ROOT / GATE, "gate_under_test")
    steps, _ = uvloop.run(per_step_ms(gate, waiting=8, tokens=120))
    assert steps == 4  # two of 120 tokens in each step's 256
