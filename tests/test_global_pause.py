"""The global pause is held per caller and released by the last one."""

from __future__ import annotations

from skyrl_lora.server.engine.global_pause import GlobalPause


def _recording() -> tuple[GlobalPause, list[str]]:
    calls: list[str] = []

    async def pause() -> None:
        calls.append("pause")

    async def resume() -> None:
        calls.append("resume")

    return GlobalPause(pause, resume), calls


async def test_the_first_resume_does_not_release_another_callers_pause() -> None:
    pause, calls = _recording()
    assert await pause.pause("trainer-1") is False
    assert await pause.pause("trainer-2") is True
    assert calls == ["pause"]
    assert await pause.resume("trainer-1") is True  # still held by trainer-2
    assert calls == ["pause"]
    assert await pause.resume("trainer-2") is False
    assert calls == ["pause", "resume"]


async def test_a_holder_pausing_twice_is_released_by_one_resume() -> None:
    pause, calls = _recording()
    await pause.pause("t")
    await pause.pause("t")
    assert await pause.resume("t") is False
    assert calls == ["pause", "resume"] and pause.holders == 0


async def test_an_unnamed_resume_releases_every_hold() -> None:
    pause, calls = _recording()
    await pause.pause(None)
    await pause.pause("trainer-that-died")
    assert await pause.resume(None) is False  # the operator's way out
    assert calls == ["pause", "resume"] and pause.holders == 0
    # A resume nobody paused for still resumes the engine (it may have been paused elsewhere).
    await pause.resume("nobody")
    assert calls == ["pause", "resume", "resume"]
