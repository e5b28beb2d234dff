"""The per-adapter gate on its own: hold, abort, drain, no slip-through."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from skyrl_lora.server.engine.gate import (
    DEFAULT_RESUME_PACING,
    AdapterGate,
    Admission,
    AnswerPacing,
    ResumePacing,
)


class FakeEngine:
    """Requests that run until aborted; records which ids were aborted."""

    def __init__(self, gate: AdapterGate) -> None:
        self.gate = gate
        self.aborted: list[str] = []
        self.running: dict[str, asyncio.Event] = {}

    async def abort(self, ids) -> None:
        self.aborted.extend(ids)
        for rid in ids:
            if rid in self.running:
                self.running[rid].set()

    async def request(self, lora: str, rid: str, *, register_delay: float = 0.0) -> tuple[int, str]:
        admission = await self.gate.admit(lora, rid)
        try:
            if register_delay:
                await asyncio.sleep(register_delay)  # not yet visible to the engine
            done = self.running[rid] = asyncio.Event()
            await done.wait()
            return admission.version, "abort"
        finally:
            self.gate.release(admission)


def make(pacing: ResumePacing | None = DEFAULT_RESUME_PACING) -> tuple[AdapterGate, FakeEngine]:
    versions = {"a": 1, "b": 1}
    gate = AdapterGate(version_of=lambda name: versions[name], pacing=pacing)
    return gate, FakeEngine(gate)


async def test_pause_aborts_only_that_adapter_and_waits_for_drain() -> None:
    gate, engine = make()
    a = [asyncio.create_task(engine.request("a", f"a{i}")) for i in range(3)]
    b = [asyncio.create_task(engine.request("b", f"b{i}")) for i in range(3)]
    await asyncio.sleep(0.01)
    was_paused, drain = await gate.pause("a", engine.abort)
    assert not was_paused
    assert drain.aborted == 3
    assert all(t.done() for t in a), "pause returned before A's requests ended"
    assert not any(t.done() for t in b)
    assert set(engine.aborted) == {"a0", "a1", "a2"}
    assert gate.in_flight("b") == 3
    for t in b:
        t.cancel()


async def test_held_request_waits_until_resume() -> None:
    gate, engine = make()
    await gate.pause("a", engine.abort)
    task = asyncio.create_task(gate.admit("a", "late"))
    await asyncio.sleep(0.02)
    assert not task.done()
    assert gate.held("a") == 1
    assert gate.resume("a") is True
    admission = await asyncio.wait_for(task, 1)
    assert admission.request_id == "late"
    assert gate.held("a") == 0


async def test_request_not_yet_in_engine_is_still_aborted() -> None:
    """Admitted just before the pause but registered with the engine after the
    first abort went out: the repeated abort must catch it."""
    gate, engine = make()
    task = asyncio.create_task(engine.request("a", "slow", register_delay=0.03))
    await asyncio.sleep(0)  # admitted, not yet running
    _, drain = await asyncio.wait_for(gate.pause("a", engine.abort), 2)
    assert task.done() and drain.aborted == 1
    assert engine.aborted.count("slow") >= 2


async def test_double_pause_and_resume_without_pause() -> None:
    gate, engine = make()
    assert gate.resume("a") is False
    assert (await gate.pause("a", engine.abort))[0] is False
    assert (await gate.pause("a", engine.abort))[0] is True
    assert gate.counters.pauses == 1
    assert gate.resume("a") is True


async def test_abort_without_pause_leaves_gate_open() -> None:
    gate, engine = make()
    task = asyncio.create_task(engine.request("a", "x"))
    await asyncio.sleep(0.01)
    drain = await gate.abort("a", engine.abort)
    assert drain.aborted == 1 and task.done()
    admission = await asyncio.wait_for(gate.admit("a", "y"), 1)
    gate.release(admission)


@pytest.mark.parametrize("n", [1, 50])
async def test_flood_around_pause_never_runs_after_pause_returned(n: int) -> None:
    """Requests racing the pause are either aborted before it returns or held."""
    gate, engine = make()
    ran_while_paused: list[str] = []
    paused = asyncio.Event()

    async def client(i: int) -> None:
        await asyncio.sleep(0.001 * (i % 7))
        admission = await gate.admit("a", f"r{i}")
        if paused.is_set():
            ran_while_paused.append(admission.request_id)
        gate.release(admission)

    tasks = [asyncio.create_task(client(i)) for i in range(n)]
    await asyncio.sleep(0.002)
    await gate.pause("a", engine.abort)
    paused.set()
    await asyncio.sleep(0.02)
    paused.clear()
    gate.resume("a")
    await asyncio.gather(*tasks)
    assert ran_while_paused == []


async def test_versions_in_flight_are_counted_per_version() -> None:
    versions = {"a": 1, "b": 1}
    gate = AdapterGate(version_of=lambda name: versions[name])
    first = await gate.admit("a", "r1")
    versions["a"] = 2  # a finish_old load: later admissions get the new version
    second = await gate.admit("a", "r2")
    await gate.admit("b", "r3")
    assert (gate.in_flight_of_version("a", 1), gate.in_flight_of_version("a", 2)) == (1, 1)
    assert gate.busy_versions() == 3  # a@v1, a@v2, b@v1 each need an engine slot
    gate.release(first)
    assert gate.in_flight_of_version("a", 1) == 0 and gate.busy_versions() == 2
    gate.release(second)
    assert gate.busy_versions() == 1


def test_sub_millisecond_drain_is_measured_not_rounded() -> None:
    """Under uvloop (vLLM's loop) ``loop.time()`` has 1 ms steps: a drain
    timed with it reads 0 or 1 ms. The GPU targets are a few ms, so the
    gate times drains with a real clock."""
    import time

    import uvloop

    async def one_drain() -> float:
        gate, engine = make()
        task = asyncio.create_task(engine.request("a", "r1"))
        await asyncio.sleep(0.001)
        assert "r1" in engine.running

        async def slow_abort(ids) -> None:
            until = time.perf_counter() + 0.0004  # the abort call itself takes 0.4 ms
            while time.perf_counter() < until:
                pass
            await engine.abort(ids)

        _, drain = await gate.pause("a", slow_abort)
        await task
        return drain.seconds

    async def main() -> list[float]:
        return [await one_drain() for _ in range(8)]

    drains = uvloop.run(main())
    assert all(d >= 0.0004 for d in drains), drains  # loop.time(): 0.0 in most of them


async def _admission_times(gate: AdapterGate, lora: str, n: int) -> list[float]:
    """Admit ``n`` requests of ``lora`` at once; when (monotonic) each got in."""
    loop = asyncio.get_running_loop()

    async def one(i: int) -> float:
        admission = await gate.admit(lora, f"{lora}-late-{i}")
        gate.release(admission)
        return loop.time()

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _settle() -> None:
    """Let every task woken so far run to its next wait."""
    for _ in range(5):
        await asyncio.sleep(0)


async def _held_backlog(
    gate: AdapterGate, engine: FakeEngine, lora: str, tokens: list[int]
) -> list[asyncio.Task[Admission]]:
    """Pause ``lora`` and queue one request per entry of ``tokens`` behind it."""
    await gate.pause(lora, engine.abort)
    backlog = []
    for i, n in enumerate(tokens):
        backlog.append(asyncio.create_task(gate.admit(lora, f"{lora}{i}", prefill_tokens=n)))
        await _settle()  # they queue in this order
    assert gate.held(lora) == len(tokens)
    return backlog


def _admitted(tasks: list[asyncio.Task[Admission]]) -> list[bool]:
    return [t.done() for t in tasks]


async def test_a_resumed_backlog_enters_a_steps_room_at_a_time() -> None:
    """The requests a pause held (the retries of what it aborted) re-enter the
    engine only as far as each step has room for their prefill tokens, in the
    order they came; one that does not fit waits for the next step, which it
    enters however long it is; newcomers queue behind; no other adapter waits."""
    gate, engine = make(ResumePacing(tokens_per_step=250, step_wait_s=10.0, window_s=10.0))
    backlog = await _held_backlog(gate, engine, "a", [100, 100, 100, 400, 50])
    gate.resume("a")
    await _settle()
    assert _admitted(backlog) == [True, True, False, False, False]  # 200 of 250 taken
    late = asyncio.create_task(gate.admit("a", "late", prefill_tokens=10))
    other = await _admission_times(gate, "b", 6)  # never paced
    assert max(other) - min(other) < 0.005
    await _settle()
    assert not late.done(), "a newcomer went ahead of the queue"
    gate.engine_stepped()
    await _settle()
    # a2 (100), then a3 does not fit (400 > 150 left), a4 (50) and the newcomer (10) do
    assert _admitted(backlog) == [True, True, True, False, True] and late.done()
    gate.engine_stepped()
    await _settle()
    assert all(_admitted(backlog))  # a3 first in its step, however long
    assert gate.counters.paced_requests == 4  # a2, a3, a4 and the newcomer waited


async def test_with_the_graph_size_the_room_follows_the_running_batch() -> None:
    """With ``graph_tokens`` and the engine's running requests known, a step's
    room is the graph less the requests running; a request that fits no such
    room goes in at once with the others that do not (eager wherever it
    goes), while those that fit are still paced; until a step says how many
    run, the fixed room holds."""
    pacing = ResumePacing(tokens_per_step=100, step_wait_s=10.0, window_s=10.0, graph_tokens=512)
    gate, engine = make(pacing)
    backlog = await _held_backlog(gate, engine, "a", [300, 300, 600, 700])
    gate.resume("a")
    await _settle()
    # no step has said how many run: 100 tokens a step, the first request always
    assert _admitted(backlog) == [True, False, False, False]
    gate.engine_stepped(running=200)  # room 312: a1 fits; a2 and a3 fit no step
    await _settle()
    assert _admitted(backlog) == [True, True, True, True]
    more = await _held_backlog(gate, engine, "b", [150, 150, 150])
    gate.engine_stepped(running=200)  # a fresh step's room: 312
    gate.resume("b")
    await _settle()
    assert _admitted(more) == [True, True, False]  # 300 of the 312
    gate.engine_stepped(running=500)  # room 12: a 150-token request fits no step now
    await _settle()
    assert all(_admitted(more))
    gate.engine_stepped()  # a step without the engine's count keeps the last one
    assert gate._budget.running == 500 and gate._budget.room() == 12
    with pytest.raises(ValueError, match="at least 1"):
        ResumePacing(graph_tokens=0)


async def test_without_step_signals_the_waiters_count_one_per_step_wait() -> None:
    """An idle engine has no steps (and a server may not see them): a waiter
    then takes ``step_wait_s`` without one as a step, so pacing never hangs."""
    gate, engine = make(ResumePacing(tokens_per_step=100, step_wait_s=0.02, window_s=10.0))
    backlog = await _held_backlog(gate, engine, "a", [100] * 4)
    loop = asyncio.get_running_loop()
    resumed_at = loop.time()
    gate.resume("a")
    await asyncio.gather(*backlog)
    assert 0.055 <= loop.time() - resumed_at < 0.5  # three waits of 20 ms


async def test_two_resumed_adapters_share_one_steps_room() -> None:
    gate, engine = make(ResumePacing(tokens_per_step=100, step_wait_s=10.0, window_s=10.0))
    a = await _held_backlog(gate, engine, "a", [60, 60])
    b = await _held_backlog(gate, engine, "b", [30, 60])
    gate.resume("a")
    gate.resume("b")
    await _settle()
    assert _admitted(a) + _admitted(b) == [True, False, False, False]
    gate.engine_stepped()
    await _settle()
    assert _admitted(a) + _admitted(b) == [True, True, True, False]  # 60 + 30
    gate.engine_stepped()
    await _settle()
    assert all(_admitted(a) + _admitted(b))


async def test_pacing_ends_with_its_window_and_is_optional() -> None:
    gate, engine = make(ResumePacing(tokens_per_step=1, step_wait_s=10.0, window_s=0.02))
    await gate.pause("a", engine.abort)
    gate.resume("a")
    await asyncio.sleep(0.03)  # past the window
    times = await _admission_times(gate, "a", 5)
    assert max(times) - min(times) < 0.005
    unpaced, engine = make(pacing=None)
    await unpaced.pause("a", engine.abort)
    unpaced.resume("a")
    times = await _admission_times(unpaced, "a", 5)
    assert max(times) - min(times) < 0.005
    assert unpaced.counters.paced_requests == 0
    unpaced.engine_stepped()  # harmless without pacing
    with pytest.raises(ValueError, match="at least 1"):
        ResumePacing(tokens_per_step=0)


async def test_a_pause_during_pacing_holds_the_waiting_requests() -> None:
    """A request waiting for room in a step is not admitted while a new pause
    is on: it is held again and admitted on the next resume, on that version."""
    versions = {"a": 1}
    pacing = ResumePacing(tokens_per_step=10, step_wait_s=0.05, window_s=1.0)
    gate = AdapterGate(version_of=lambda name: versions[name], pacing=pacing)
    engine = FakeEngine(gate)
    waiting = await _held_backlog(gate, engine, "a", [10, 10, 10])
    gate.resume("a")
    await _settle()  # a0 is in, a1 and a2 wait for later steps
    assert gate.in_flight("a") == 1 and gate.held("a") == 2
    gate.forget("a")  # an unload meanwhile must not drop the waiters' state
    assert gate.held("a") == 2
    gate.release(waiting[0].result())
    await gate.pause("a", engine.abort)
    versions["a"] = 2
    for _ in range(3):
        gate.engine_stepped()  # steps pass while paused
    await asyncio.sleep(0.15)  # and so do the waits without one
    assert gate.in_flight("a") == 0 and not any(t.done() for t in waiting[1:])
    gate.resume("a")
    rest = await asyncio.gather(*waiting[1:])
    assert [a.version for a in rest] == [2, 2]


async def test_the_requests_a_pause_ends_are_answered_at_a_pace() -> None:
    """Each ended request learns how long after its end to answer: its place
    in the abort times the spacing, capped; the other adapter's are untouched."""
    pacing = AnswerPacing(spacing_s=0.002, window_s=0.003)
    gate = AdapterGate(version_of=lambda name: 1, answer_pacing=pacing)
    ended = [await gate.admit("a", f"a{i}") for i in range(3)]
    other = await gate.admit("b", "b0")

    async def abort(ids) -> None:
        for admission in ended:
            if admission.request_id in ids:
                gate.release(admission)

    await gate.pause("a", abort)
    assert [a.answer_after_s for a in ended] == [0.0, 0.002, 0.003]
    assert other.answer_after_s == 0.0
    unpaced = AdapterGate(version_of=lambda name: 1, answer_pacing=None)
    lone = await unpaced.admit("a", "x")
    await unpaced.abort("a", lambda ids: _release(unpaced, lone))
    assert lone.answer_after_s == 0.0


async def _release(gate: AdapterGate, admission) -> None:
    gate.release(admission)


async def test_a_backlog_that_comes_back_after_the_window_is_still_paced() -> None:
    """The requests a pause aborted come back when their clients have handled
    the abort, which may be after ``window_s``: they are paced as they come
    (a step's room at a time) until as many as were aborted are back; later
    requests, and every request once ``backlog_s`` has passed, go straight in."""
    pacing = ResumePacing(tokens_per_step=100, step_wait_s=10.0, window_s=0.01, backlog_s=10.0)
    gate, engine = make(pacing)
    running = [asyncio.create_task(engine.request("a", f"r{i}")) for i in range(3)]
    await _settle()
    await gate.pause("a", engine.abort)
    await asyncio.gather(*running)
    gate.resume("a")
    await asyncio.sleep(0.03)  # past the window: the clients were slow to retry
    retries = [
        asyncio.create_task(gate.admit("a", f"retry{i}", prefill_tokens=60)) for i in range(3)
    ]
    await _settle()
    assert _admitted(retries) == [True, False, False]  # 60 of 100, the next 60 do not fit
    gate.engine_stepped()
    await _settle()
    assert _admitted(retries) == [True, True, False]
    gate.engine_stepped()
    await _settle()
    assert all(_admitted(retries))
    times = await _admission_times(gate, "a", 4)  # the backlog is back: no more pacing
    assert max(times) - min(times) < 0.005
    late, engine = make(replace(pacing, backlog_s=0.02))
    running = [asyncio.create_task(engine.request("a", f"r{i}")) for i in range(3)]
    await _settle()
    await late.pause("a", engine.abort)
    late.resume("a")
    await asyncio.sleep(0.03)  # past backlog_s too
    times = await _admission_times(late, "a", 3)
    assert max(times) - min(times) < 0.005
    with pytest.raises(ValueError, match="backlog_s"):
        ResumePacing(backlog_s=-1)


async def test_a_waiter_waits_for_a_step_as_long_as_the_engine_takes_for_one() -> None:
    """Engine steps 60 ms apart: a paced request waits up to two of them for
    the next step, not ``step_wait_s`` (20 ms), before taking one as passed,
    so a long step does not let several steps' room in at once; within
    ``max_step_wait_s``, and never less than ``step_wait_s``."""
    pacing = ResumePacing(tokens_per_step=100, step_wait_s=0.02, window_s=10.0)
    gate, engine = make(pacing)
    for _ in range(3):
        gate.engine_stepped()
        await asyncio.sleep(0.06)
    backlog = await _held_backlog(gate, engine, "a", [100, 100])
    gate.resume("a")
    await _settle()
    assert _admitted(backlog) == [True, False]
    await asyncio.sleep(0.08)  # four of the old waits, under two steps
    assert _admitted(backlog) == [True, False]
    await asyncio.sleep(0.1)  # no step in twice the engine's: taken as one
    assert all(_admitted(backlog))
    budget = gate._budget
    budget.step_s = 5.0
    assert budget.step_wait_s(0.02) == pacing.max_step_wait_s
    budget.step_s = 0.001
    assert budget.step_wait_s(0.02) == 0.02
    budget.step_s = 5.0
    assert budget.step_wait_s(2.0) == 2.0  # a maximum below the least is a fixed wait


def test_serve_takes_the_room_per_step_and_refuses_less_than_one_token(capsys) -> None:
    from skyrl_lora.server.http.app import parse_server_args, resume_pacing

    base = ["--model", "unused", "--enable-lora"]
    assert resume_pacing(parse_server_args(base)) == DEFAULT_RESUME_PACING
    assert resume_pacing(parse_server_args([*base, "--resume-tokens-per-step", "64"])) == (
        ResumePacing(tokens_per_step=64)
    )
    assert resume_pacing(parse_server_args([*base, "--no-resume-pacing"])) is None
    assert resume_pacing(parse_server_args([*base, "--resume-graph-tokens", "512"])) == (
        ResumePacing(graph_tokens=512)
    )
    with pytest.raises(SystemExit):
        parse_server_args([*base, "--resume-tokens-per-step", "0"])
    assert "--resume-tokens-per-step must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_server_args([*base, "--resume-graph-tokens", "0"])
    assert "--resume-graph-tokens must be at least 1" in capsys.readouterr().err
    window_only = [*base, "--resume-backlog-s", "0", "--resume-step-wait-max-ms", "50"]
    assert resume_pacing(parse_server_args(window_only)) == (
        ResumePacing(backlog_s=0.0, max_step_wait_s=0.05)
    )
    with pytest.raises(SystemExit):
        parse_server_args([*base, "--resume-step-wait-max-ms", "10"])
    assert "--resume-step-wait-max-ms must be at least 50" in capsys.readouterr().err
