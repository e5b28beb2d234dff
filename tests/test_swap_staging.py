"""A reload stages the new version while the current one serves, and pauses only to install.

Real registry, gate and engine layer; the vLLM engine is a fake whose staging
waits for the test, so the test can look at the adapter mid-reload. The real
engine's half (the worker extension and the staged install) is proven in
``test_server_engine.py`` and ``test_staging.py``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from skyrl_lora.errors import BadRequestError
from skyrl_lora.server.adapters.registry import AdapterRegistry
from skyrl_lora.server.engine.gate import DEFAULT_ANSWER_PACING, AdapterGate
from skyrl_lora.server.engine.gated import GatedEngine


@dataclass(frozen=True)
class _Request:
    lora_name: str
    lora_int_id: int
    lora_path: str


class _Engine:
    """vLLM's LoRA calls and abort; records whether the adapter was paused at each step."""

    def __init__(self) -> None:
        self.gate: AdapterGate | None = None
        self.staging_may_finish = asyncio.Event()
        self.staging_started = asyncio.Event()
        self.stage_error: Exception | None = None
        self.paused_while: dict[str, bool] = {}
        self.discarded: list[int] = []
        self.replaced: list[int | None] = []

    def _paused(self) -> bool:
        assert self.gate is not None
        return self.gate.is_paused("a")

    async def stage(
        self, request: _Request, replaces: int | None = None, weights_fd: int | None = None
    ) -> None:
        self.paused_while["stage"] = self._paused()
        self.replaced.append(replaces)
        self.staging_started.set()
        await self.staging_may_finish.wait()
        if self.stage_error is not None:
            raise self.stage_error

    async def discard(self, lora_id: int) -> None:
        self.discarded.append(lora_id)

    async def add_lora(self, request: _Request) -> bool:
        self.paused_while["install"] = self._paused()
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True

    async def abort(self, request_ids: list[str]) -> None:
        raise AssertionError("nothing was in flight")

    async def generate(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("nothing generates here")


def _adapter(folder: Path) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return str(folder)


@pytest.fixture
async def loaded(tmp_path: Path) -> tuple[GatedEngine, _Engine, Path]:
    fake = _Engine()
    registry = AdapterRegistry(fake, {}, _Request, snapshot_root=tmp_path / "snapshots")
    engine = GatedEngine(fake, AdapterGate(version_of=registry.version), registry, max_loras=4)
    fake.gate = engine.gate
    fake.staging_may_finish.set()
    await engine.load("a", _adapter(tmp_path / "v1"))
    fake.staging_may_finish.clear()
    fake.staging_started.clear()
    fake.paused_while.clear()
    fake.replaced.clear()
    return engine, fake, tmp_path


async def test_reload_serves_the_current_version_while_it_stages(loaded) -> None:
    engine, fake, tmp_path = loaded
    reload = asyncio.create_task(engine.load("a", _adapter(tmp_path / "v2")))
    await fake.staging_started.wait()
    async with engine.admitted("a", "during-staging") as record:
        assert record.version == 1  # admitted at once, on the version that serves
    fake.staging_may_finish.set()
    await reload
    assert fake.paused_while == {"stage": False, "install": True}
    assert engine.registry.version("a") == 2 and not engine.gate.is_paused("a")


async def test_a_failed_staging_never_pauses_and_leaves_nothing(loaded) -> None:
    engine, fake, tmp_path = loaded
    fake.stage_error = RuntimeError("shapes do not match the model")
    fake.staging_may_finish.set()
    with pytest.raises(BadRequestError, match="shapes do not match"):
        await engine.load("a", _adapter(tmp_path / "v2"))
    assert fake.paused_while == {"stage": False}
    assert engine.registry.version("a") == 1 and not engine.gate.is_paused("a")
    assert len(fake.discarded) == 1
    assert not (engine.registry.snapshot_root / "a" / "v2").exists()
    fake.stage_error = None  # the next load takes the version the failed one would have had
    await engine.load("a", _adapter(tmp_path / "v3"))
    assert engine.registry.version("a") == 2


async def test_a_reload_under_the_callers_pause_lets_the_engine_drop_the_current_version(
    loaded,
) -> None:
    """Paused and drained, nothing can run on v1 before v2 is installed: the
    engine may hand v1's slot to v2. While v1 serves (or has requests in
    flight), it must stay."""
    engine, fake, tmp_path = loaded
    fake.staging_may_finish.set()
    v1_id = engine.registry.get("a").lora_request.lora_int_id
    await engine.load("a", _adapter(tmp_path / "v2"))  # serving: staged beside v1
    await engine.pause("a")
    v2_id = engine.registry.get("a").lora_request.lora_int_id
    await engine.load("a", _adapter(tmp_path / "v3"))  # the trainer's pause, reload, resume
    engine.resume("a")
    assert fake.replaced == [None, v2_id] and v1_id != v2_id
    assert engine.registry.version("a") == 3


async def test_the_requests_a_pause_ends_answer_at_a_pace_after_the_drain(loaded) -> None:
    """A pause's aborted requests end together; their handlers go on (build
    and send the partial answer) one spacing apart, and the pause does not
    wait for that."""
    engine, fake, _ = loaded
    ended = {f"r{i}": asyncio.Event() for i in range(3)}

    async def abort(request_ids: list[str]) -> None:
        for rid in request_ids:
            ended[rid].set()

    fake.abort = abort  # type: ignore[method-assign]
    answered: dict[str, float] = {}

    async def request(rid: str) -> None:
        async with engine.admitted("a", rid):
            await ended[rid].wait()
        answered[rid] = time.monotonic()

    tasks = [asyncio.create_task(request(rid)) for rid in ended]
    await asyncio.sleep(0.01)
    await engine.pause("a")
    paused = time.monotonic()
    await asyncio.gather(*tasks)
    spacing = DEFAULT_ANSWER_PACING.spacing_s
    assert answered["r0"] <= paused < answered["r2"]
    assert answered["r2"] - answered["r0"] >= 2 * spacing * 0.9
