"""Chaos soak: 200+ concurrent resumable samples over three adapters while
random pause / reload / resume cycles run. Bounded to a couple of minutes.

Every reload swaps the adapter's weights between two words, so each version
range of every result can be checked against the word its version must say.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import FanOutError
from skyrl_lora.types import SampleResponse
from tests.conftest import EngineServer, replica_group

pytestmark = pytest.mark.engine

WEIGHTS = {"chaos-a": ("meow", "woof"), "chaos-b": ("moo", "quack"), "chaos-c": ("woof", "moo")}
SAMPLES = 210
CYCLES = 24
WORDS = ("meow", "woof", "moo", "quack")


async def test_chaos_soak(engine_server: EngineServer, capsys) -> None:
    rng = random.Random(1234)
    said: dict[tuple[str, int], int] = {}  # (adapter, version) -> the word id it must produce
    leaks: list[str] = []
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as client:
        for name, (word, _) in WEIGHTS.items():
            (info,) = await client.load_lora_adapter(name, str(engine_server.model.adapters[word]))
            said[(name, info.version)] = engine_server.word_id(word)

        async def one(i: int) -> tuple[str, dict, SampleResponse]:
            await asyncio.sleep(rng.random() * 2.0)
            name = rng.choice(list(WEIGHTS))
            params = {
                "max_tokens": rng.randint(20, 160),
                "temperature": 0.0,
                "ignore_eos": i % 2 == 0,
            }
            prompt = engine_server.encode(rng.choice(["hello", "hello there", "how are you"]))
            return (
                name,
                params,
                await client.sample_with_retry(prompt, sampling_params=params, lora_name=name),
            )

        async def chaos() -> int:
            for cycle in range(CYCLES):
                await asyncio.sleep(rng.uniform(0.05, 0.25))
                name = rng.choice(list(WEIGHTS))
                word = WEIGHTS[name][(cycle + 1) % 2]
                await client.pause_generation(lora_name=name)
                (state,) = [
                    a for a in (await client.list_adapters()).adapters if a.lora_name == name
                ]
                if state.engine_requests or state.in_flight:
                    leaks.append(f"{name} cycle {cycle}: {state}")
                (info,) = await client.reload_lora_adapter(
                    name, str(engine_server.model.adapters[word])
                )
                said[(name, info.version)] = engine_server.word_id(word)
                await client.resume_generation(lora_name=name)
            return CYCLES

        started = time.monotonic()
        results, cycles = await asyncio.wait_for(
            asyncio.gather(asyncio.gather(*(one(i) for i in range(SAMPLES))), chaos()), 240
        )
        elapsed = time.monotonic() - started
        listing = {a.lora_name: a for a in (await client.list_adapters()).adapters}

    assert not leaks, f"requests ran while paused: {leaks}"
    retried = 0
    for name, params, result in results:
        (seq,) = result.sequences
        assert seq.stop_reason in ("length", "stop"), seq.stop_reason
        assert len(seq.tokens) <= params["max_tokens"]
        if params["ignore_eos"]:
            assert len(seq.tokens) == params["max_tokens"]
        assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 for lp in seq.logprobs)
        assert seq.versions[0].start == 0 and seq.versions[-1].end == len(seq.tokens)
        for before, after in zip(seq.versions, seq.versions[1:]):
            assert before.end == after.start and before.version < after.version
        for r in seq.versions:  # every token came from the weights its version says
            assert set(seq.tokens[r.start : r.end]) == {said[(name, r.version)]}, (name, r)
        retried += seq.segments > 1
    resubmits = sum(r.sequences[0].segments - 1 for _, _, r in results)
    assert retried > 0 and cycles == CYCLES
    versions = ", ".join(f"{n}=v{a.version}" for n, a in listing.items() if n in WEIGHTS)
    with capsys.disabled():
        print(
            f"\nchaos soak: {len(results)} samples, {cycles} pause/reload/resume cycles, "
            f"{retried} samples aborted and resumed, {resubmits} resubmits, "
            f"versions now {versions}, {elapsed:.1f} s"
        )


@pytest.fixture(scope="module")
def soak_group(embedded_model: Any, local_ray: Any) -> Iterator[Any]:
    with replica_group(embedded_model) as group:
        yield group


async def test_chaos_soak_over_a_group_with_an_engine_kill(
    soak_group: Any, embedded_model: Any, tokenizer: Any, capsys
) -> None:
    """Resumable samples arrive all along while random pause/reload/resume
    cycles (``chaos-c`` by push, the others by path) run on two replicas, and
    replica 0's engine process is killed. Samples keep arriving until the
    group has rebuilt it; every one must complete, with each version range's
    tokens from the weights that version names."""
    rng = random.Random(4321)
    word_id = {w: tokenizer.encode(w, add_special_tokens=False)[0] for w in WORDS}
    said: dict[tuple[str, int], int] = {}
    done = asyncio.Event()

    async def swap(client: RemoteInferenceClient, name: str, word: str) -> None:
        folder = str(embedded_model.adapters[word])
        try:
            if name == "chaos-c":
                infos = await client.push_lora_adapter(name, folder)
            else:
                infos = await client.load_lora_adapter(name, folder)
        except FanOutError as partial:  # the replica that is down
            infos = list(partial.results.values())
        for info in infos:
            said[(name, info.version)] = word_id[word]

    async with RemoteInferenceClient(soak_group.urls) as client:
        for name, (word, _) in WEIGHTS.items():
            await swap(client, name, word)

        async def one(i: int) -> tuple[str, dict, SampleResponse]:
            name = rng.choice(list(WEIGHTS))
            params = {"max_tokens": rng.randint(20, 160), "temperature": 0.0, "ignore_eos": True}
            prompt = tokenizer.encode(
                rng.choice(["hello", "hello there"]), add_special_tokens=False
            )
            result = await client.sample_with_retry(prompt, sampling_params=params, lora_name=name)
            return name, params, result

        async def arrivals() -> list[asyncio.Task]:
            started = []
            while not done.is_set() or len(started) < 60:
                started.append(asyncio.create_task(one(len(started))))
                await asyncio.sleep(rng.uniform(0.05, 0.3))
            return started

        async def chaos() -> int:
            cycles = 0
            while not done.is_set():
                await asyncio.sleep(rng.uniform(0.5, 1.5))  # RL-step cadence
                name = rng.choice(list(WEIGHTS))
                with contextlib.suppress(FanOutError):
                    await client.pause_generation(lora_name=name)
                await swap(client, name, WEIGHTS[name][(cycles + 1) % 2])
                with contextlib.suppress(FanOutError):
                    await client.resume_generation(lora_name=name)
                cycles += 1
            return cycles

        async def kill_and_heal() -> float:
            await asyncio.sleep(3)
            killed = time.monotonic()
            await asyncio.to_thread(soak_group.kill_engine, 0)
            (restart,) = await asyncio.to_thread(soak_group.wait_restarts, 1, 400)
            done.set()
            return restart.detected_at + restart.seconds - killed

        started = time.monotonic()
        arriving = asyncio.create_task(arrivals())
        cycles, heal_s = await asyncio.wait_for(asyncio.gather(chaos(), kill_and_heal()), 480)
        results = await asyncio.wait_for(asyncio.gather(*await arriving), 300)
        elapsed = time.monotonic() - started
        for name in WEIGHTS:  # leave nothing paused behind a failed fan-out
            await client.resume_generation(lora_name=name)

    lost = 0
    for name, params, result in results:
        (seq,) = result.sequences
        lost += len(seq.tokens) != params["max_tokens"]
        assert seq.versions[0].start == 0 and seq.versions[-1].end == len(seq.tokens)
        for before, after in zip(seq.versions, seq.versions[1:]):
            assert before.end == after.start and before.version <= after.version
        for r in seq.versions:
            assert set(seq.tokens[r.start : r.end]) == {said[(name, r.version)]}, (name, r)
    assert lost == 0 and cycles > 0
    with capsys.disabled():
        print(
            f"\nchaos soak over 2 replicas: {len(results)} samples, {cycles} pause/swap/resume "
            f"cycles, engine killed and replica serving again after {heal_s:.1f} s, "
            f"{lost} samples lost, {elapsed:.1f} s"
        )
