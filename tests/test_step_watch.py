"""The engine's long-step log (``skyrl_lora.server.telemetry.step_watch``).

What must hold: a step longer than the threshold, with a request running
through it, is logged with what that step scheduled (requests, tokens,
prefill tokens, new requests) and what of ours was busy at its start or
end; a short step or an idle engine between two steps is not; and the
shape is read from vLLM's own ``SchedulerOutput``, so a vLLM that renames
its fields fails here rather than logging zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from skyrl_lora.server.telemetry.step_watch import StepShape, StepWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(scheduled: dict[str, int], new: int = 0) -> Any:
    """A stand-in scheduler output: tokens per request, and how many are new."""

    @dataclasses.dataclass
    class Output:
        num_scheduled_tokens: dict[str, int]
        total_num_scheduled_tokens: int
        scheduled_new_reqs: list[object]

    return Output(scheduled, sum(scheduled.values()), [object()] * new)


def watched(busy: list[frozenset[str]]) -> tuple[StepWatch, Clock, list[dict[str, Any]]]:
    clock, logged = Clock(), []
    watch = StepWatch(
        0.05,
        busy=lambda: busy[0],
        log=lambda event, **fields: logged.append({"event": event, **fields}),
        clock=clock,
    )
    return watch, clock, logged


def test_a_long_step_is_logged_with_what_it_scheduled_and_what_ran_beside() -> None:
    busy = [frozenset({"staging"})]
    watch, clock, logged = watched(busy)
    watch(step({"a": 1, "b": 1}))
    clock.now = 0.01
    resumed = {"a": 1, "b": 1, "r1": 300, "r2": 250}  # two resumed requests re-prefill
    watch(step(resumed, new=2))
    busy[0] = frozenset({"snapshot_write"})
    clock.now = 0.09  # that step took 80 ms
    watch(step({"a": 1, "b": 1, "r1": 1, "r2": 1}))
    assert logged == [
        {
            "event": "engine_long_step",
            "ms": 80.0,
            "requests": 4,
            "tokens": 552,
            "prefill_tokens": 550,
            "new_requests": 2,
            "busy": ["snapshot_write", "staging"],
            "suppressed": 0,
        }
    ]
    assert watch.long_steps == 1


def test_short_steps_and_an_idle_engine_are_not_logged() -> None:
    watch, clock, logged = watched([frozenset()])
    watch(step({"a": 1}))
    clock.now = 0.02
    watch(step({"a": 1}))
    clock.now = 5.0  # "a" finished; the engine idled until "b" came
    watch(step({"b": 40}, new=1))
    assert logged == [] and watch.long_steps == 0


def test_at_most_max_per_s_events_a_second_and_the_rest_are_counted() -> None:
    clock, logged = Clock(), []
    watch = StepWatch(
        0.05, log=lambda event, **fields: logged.append(fields), clock=clock, max_per_s=3
    )
    for i in range(13):  # a slow engine: every step takes 100 ms
        clock.now = i * 0.1
        watch(step({"a": 1}))
    assert watch.long_steps == 12
    # three in the first second (from 0.1 s), seven counted, then the next second's
    assert [f["suppressed"] for f in logged] == [0, 0, 0, 7, 0]


def test_the_shape_is_read_from_vllms_own_scheduler_output() -> None:
    output = pytest.importorskip("vllm.v1.core.sched.output")
    real = output.SchedulerOutput.make_empty()
    real.num_scheduled_tokens = {"a": 1, "b": 17}
    real.total_num_scheduled_tokens = 18
    assert StepShape.of(real) == StepShape(
        requests=2,
        tokens=18,
        prefill_tokens=17,
        new_requests=0,
        request_ids=frozenset({"a", "b"}),
    )


def test_a_fault_in_the_watch_turns_it_off_and_never_fails_the_step() -> None:
    def busy() -> frozenset[str]:
        raise RuntimeError("a broken probe")

    watch = StepWatch(0.05, busy=busy, log=lambda *a, **k: None)
    watch(step({"a": 1}))  # must not raise into vLLM's step loop
    assert watch.failed
    watch(step({"a": 1}))  # and stays off


def test_serve_takes_the_threshold_and_refuses_a_negative_one(capsys: Any) -> None:
    pytest.importorskip("vllm")
    from skyrl_lora.server.http.app import parse_server_args

    base = ["--model", "unused", "--enable-lora"]
    assert parse_server_args(base).long_step_ms == 50
    assert parse_server_args([*base, "--long-step-ms", "0"]).long_step_ms == 0  # off
    with pytest.raises(SystemExit) as exited:
        parse_server_args([*base, "--long-step-ms", "-5"])
    assert exited.value.code == 2
    assert "--long-step-ms must be 0 (no step log) or more" in capsys.readouterr().err
