"""Two real CPU vLLM replicas in a local Ray cluster, driven by one client.

Module-scoped: the group starts once for these tests, and the failover drill
(which kills a replica) runs last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.types import SampleResponse

pytestmark = pytest.mark.engine

LONG = 300


@pytest.fixture(scope="module")
def group(embedded_model: Any, local_ray: Any) -> Iterator[Any]:
    from skyrl_lora.server.group import GroupConfig, ServerGroup
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    config = GroupConfig(num_replicas=2, argv=embedded_server_argv(embedded_model), env=CPU_ENV)
    with ServerGroup(config) as started:
        yield started


def greedy(max_tokens: int = LONG) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def engine_counts(client: RemoteInferenceClient, name: str) -> dict[str, int]:
    counts = {}
    for url in client.urls:
        listing = await client.list_adapters(url)
        (state,) = [a for a in listing.adapters if a.lora_name == name]
        counts[url] = state.engine_requests
    return counts


async def wait_everywhere(client: RemoteInferenceClient, name: str) -> None:
    deadline = time.monotonic() + 90
    while min((await engine_counts(client, name)).values()) == 0:
        assert time.monotonic() < deadline, f"{name} never ran on every replica"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)


def text(tokenizer: Any, result: SampleResponse) -> list[str]:
    return tokenizer.decode(result.sequences[0].tokens).split()


async def test_group_serves_on_every_replica(group, embedded_model, tokenizer) -> None:
    assert len(set(group.urls)) == 2
    async with RemoteInferenceClient(group.urls) as client:
        infos = await client.load_lora_adapter("g-meow", str(embedded_model.adapters["meow"]))
        assert [i.version for i in infos] == [1, 1]


async def test_pause_on_both_replicas_leaves_other_adapters_running(
    group, embedded_model, tokenizer
) -> None:
    async with RemoteInferenceClient(group.urls) as client:
        await client.load_lora_adapter("g-meow", str(embedded_model.adapters["meow"]))
        await client.load_lora_adapter("g-woof", str(embedded_model.adapters["woof"]))
        prompt = tokenizer.encode("hello there", add_special_tokens=False)

        def run(name: str) -> asyncio.Task[SampleResponse]:
            return asyncio.create_task(
                client.sample_with_retry(prompt, sampling_params=greedy(), lora_name=name)
            )

        meow = [run("g-meow") for _ in range(4)]
        woof = [run("g-woof") for _ in range(4)]
        await wait_everywhere(client, "g-meow")
        await wait_everywhere(client, "g-woof")
        acks = await client.pause_generation(lora_name="g-meow")
        assert len(acks) == 2 and all(a.aborted > 0 for a in acks), acks
        for _ in range(8):  # while paused: meow runs nowhere, woof runs on both
            meow_counts = await engine_counts(client, "g-meow")
            woof_counts = await engine_counts(client, "g-woof")
            assert set(meow_counts.values()) == {0}, meow_counts
            assert min(woof_counts.values()) > 0, woof_counts
            assert not any(t.done() for t in meow)
            await asyncio.sleep(0.1)
        await client.resume_generation(lora_name="g-meow")
        for r in await asyncio.gather(*meow):
            assert text(tokenizer, r) == ["meow"] * LONG and r.sequences[0].segments >= 2
        for r in await asyncio.gather(*woof):
            assert text(tokenizer, r) == ["woof"] * LONG and r.sequences[0].segments == 1


async def test_killing_a_replica_mid_flight_loses_no_sample(
    group, embedded_model, tokenizer
) -> None:
    async with RemoteInferenceClient(group.urls) as client:
        await client.load_lora_adapter("g-moo", str(embedded_model.adapters["moo"]))
        prompt = tokenizer.encode("hello there", add_special_tokens=False)
        tasks = [
            asyncio.create_task(
                client.sample_with_retry(prompt, sampling_params=greedy(), lora_name="g-moo")
            )
            for _ in range(6)
        ]
        await wait_everywhere(client, "g-moo")
        doomed = group.urls[0]
        group.kill(0)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        for r in results:
            (seq,) = r.sequences
            assert seq.stop_reason == "length" and len(seq.tokens) == LONG
            assert text(tokenizer, r) == ["moo"] * LONG
            assert len(seq.logprobs) == LONG
        assert not client.replicas.replicas[doomed].healthy
        assert client.replicas.replicas[group.urls[1]].healthy
