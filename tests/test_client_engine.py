"""RemoteInferenceClient on the real CPU vLLM engine: the scenarios trainers rely on."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.types import SampleResponse
from tests.conftest import EngineServer

pytestmark = pytest.mark.engine

# GPU runs set these: the CUDA engine is fast enough to finish short samples
# before a pause could land.
LONG = int(os.environ.get("SKYRL_TEST_LONG", "300"))
SETTLE_S = float(os.environ.get("SKYRL_TEST_SETTLE_S", "0.3"))


@pytest.fixture
async def client(engine_server: EngineServer) -> AsyncIterator[RemoteInferenceClient]:
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        yield c


def greedy(max_tokens: int = LONG) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def load(client: RemoteInferenceClient, server: EngineServer, name: str, adapter: str) -> int:
    (info,) = await client.load_lora_adapter(name, str(server.model.adapters[adapter]))
    return info.version


async def wait_in_flight(client: RemoteInferenceClient, name: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        (state,) = [a for a in (await client.list_adapters()).adapters if a.lora_name == name]
        if state.engine_requests >= count:
            break
        assert time.monotonic() < deadline, "requests never reached the engine"
        await asyncio.sleep(0.05)
    await asyncio.sleep(SETTLE_S)


def words(server: EngineServer, response: SampleResponse) -> list[str]:
    return server.tokenizer.decode(response.sequences[0].tokens).split()


async def test_other_adapter_unaffected_while_one_is_paused(engine_server, client) -> None:
    await load(client, engine_server, "iso-meow", "meow")
    await load(client, engine_server, "iso-woof", "woof")
    prompt = engine_server.encode("hello there")
    await client.pause_generation(lora_name="iso-meow")
    try:
        started = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(
                *(
                    client.sample_with_retry(
                        prompt, sampling_params=greedy(40), lora_name="iso-woof"
                    )
                    for _ in range(4)
                )
            ),
            timeout=60,
        )
        elapsed = time.monotonic() - started
    finally:
        await client.resume_generation(lora_name="iso-meow")
    for r in results:
        assert words(engine_server, r) == ["woof"] * 40
        assert r.sequences[0].segments == 1
    print(f"4 woof samples while meow paused: {elapsed:.2f} s")


async def test_recovery_from_abort_mid_flight(engine_server, client) -> None:
    await load(client, engine_server, "rec-meow", "meow")
    await load(client, engine_server, "rec-woof", "woof")
    prompt = engine_server.encode("hello there how are you")

    def run(name: str) -> asyncio.Task[SampleResponse]:
        return asyncio.create_task(
            client.sample_with_retry(prompt, sampling_params=greedy(), lora_name=name)
        )

    meow = [run("rec-meow") for _ in range(4)]
    woof = [run("rec-woof") for _ in range(4)]
    await wait_in_flight(client, "rec-meow", 4)
    assert not any(t.done() for t in meow + woof), "all 8 must still be running at the pause"
    (paused,) = await client.pause_generation(lora_name="rec-meow")
    assert paused.aborted == 4
    for _ in range(10):  # a second with meow paused: none of its samples may finish
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in meow), "a meow sample escaped the pause"
    await client.resume_generation(lora_name="rec-meow")
    for r in await asyncio.gather(*meow):
        (seq,) = r.sequences
        assert seq.stop_reason == "length" and len(seq.tokens) == LONG
        assert seq.segments >= 2, "the abort must have been resumed"
        assert words(engine_server, r) == ["meow"] * LONG
        assert len(seq.logprobs) == LONG
    for r in await asyncio.gather(*woof):
        assert r.sequences[0].segments == 1 and words(engine_server, r) == ["woof"] * LONG


async def test_swap_in_mid_sample(engine_server, client) -> None:
    v1 = await load(client, engine_server, "mid-swap", "meow")
    prompt = engine_server.encode("hello there")
    task = asyncio.create_task(
        client.sample_with_retry(prompt, sampling_params=greedy(), lora_name="mid-swap")
    )
    await wait_in_flight(client, "mid-swap", 1)
    await client.pause_generation(lora_name="mid-swap")
    v2 = await load(client, engine_server, "mid-swap", "woof")
    await client.resume_generation(lora_name="mid-swap")
    result = await asyncio.wait_for(task, 120)
    (seq,) = result.sequences
    text = words(engine_server, result)
    first, second = seq.versions
    assert (first.version, second.version) == (v1, v2) == (v1, v1 + 1)
    assert first.start == 0 and first.end == second.start and second.end == LONG
    assert text[: first.end] == ["meow"] * first.end
    assert text[first.end :] == ["woof"] * (LONG - first.end)
    assert 0 < first.end < LONG
    print("stitched:", " ".join(text[first.end - 3 : first.end + 3]), seq.versions)


async def test_global_pause_through_the_client(engine_server, client) -> None:
    prompt = engine_server.encode("hello")
    task = asyncio.create_task(
        client.sample_with_retry(prompt, sampling_params=greedy(LONG // 2), lora_name="meow")
    )
    await wait_in_flight(client, "meow", 1)
    await client.pause_all()
    try:
        assert (await client.list_adapters()).engine_paused
        await asyncio.sleep(0.8)
        assert not task.done()
    finally:  # a failure here must not leave the engine paused for every later test
        await client.resume_all()
    result = await asyncio.wait_for(task, 60)
    assert result.sequences[0].segments == 1, "keep mode must not abort"
    assert len(result.sequences[0].tokens) == LONG // 2


async def test_the_global_pause_is_held_until_every_client_resumed(engine_server, client) -> None:
    from skyrl_lora.client import RemoteInferenceClient

    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as other:
        first = await client.pause_all()
        second = await other.pause_all()
        try:
            assert not first.was_paused and second.was_paused and second[0].holders == 2
            released = await client.resume_all()
            assert released.paused and released[0].holders == 1
            assert (await client.list_adapters()).engine_paused, "the other client still holds it"
        finally:
            await client.resume_all()
            last = await other.resume_all()
        assert not last.paused and last[0].holders == 0
        assert not (await client.list_adapters()).engine_paused


async def test_greedy_resumed_three_times_equals_uninterrupted(engine_server, client) -> None:
    await load(client, engine_server, "greedy", "babble")
    # the same weights under another name: the uninterrupted reference runs
    # beside the sample (``test_tinker_sdk_engine.TWIN`` says why it may)
    await load(client, engine_server, "greedy-twin", "babble")
    prompt = engine_server.encode("hello there how are you")
    # Three pauses must each land mid-sample: on a quiet CPU 300 tokens took
    # about 1 s, less than three settle times, so use most of the context.
    params = greedy(min(3 * LONG, 1000))
    uninterrupted = asyncio.create_task(
        client.sample(prompt, sampling_params=params, lora_name="greedy-twin")
    )
    task = asyncio.create_task(
        client.sample_with_retry(prompt, sampling_params=params, lora_name="greedy")
    )
    for _ in range(3):
        await wait_in_flight(client, "greedy", 1)
        (paused,) = await client.pause_generation(lora_name="greedy")
        assert paused.aborted == 1
        await client.resume_generation(lora_name="greedy")
    (seq,) = (await asyncio.wait_for(task, 120)).sequences
    (reference,) = (await uninterrupted).sequences
    assert seq.segments == 4
    assert seq.tokens == reference.tokens
    assert seq.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert len(set(seq.tokens)) > 3, "the babble adapter should not repeat one word"
