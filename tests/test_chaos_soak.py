"""Chaos soak: 200+ concurrent resumable samples over three adapters while
random pause / reload / resume cycles run. Bounded to a couple of minutes;
a ``soak`` test, which ``.ci/run`` runs at ``SKYRL_TEST_SOAK_SCALE``.

Every reload swaps the adapter's weights between two words, so each version
range of every result can be checked against the word its version must say.

The same soak over a two-replica group with an engine kill is a drill of
``tests/test_group_engine.py``, on that module's group (one group start
for both).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.types import SampleResponse
from tests.conftest import EngineServer, soak_size

pytestmark = [pytest.mark.engine, pytest.mark.soak]

WEIGHTS = {"chaos-a": ("meow", "woof"), "chaos-b": ("moo", "quack"), "chaos-c": ("woof", "moo")}
SAMPLES = soak_size(210, least=20)
CYCLES = soak_size(24, least=4)


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
