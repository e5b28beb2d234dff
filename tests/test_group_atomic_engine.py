"""Atomic group swaps on two real CPU vLLM replicas, one of which refuses a load.

Replica 1 runs with a ``--max-adapter-bytes`` just above the embedded
adapters' size; a push of the same weights with a padded safetensors header
(a larger, equally valid file) lands on replica 0 and is refused by replica 1.
The group must then roll replica 0 back: both serve the old version, at the
same number, and the error is replica 1's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyrl_lora.client import InMemoryAdapter, RemoteInferenceClient
from skyrl_lora.errors import FanOutError, PayloadTooLargeError
from tests.conftest import staged_file_reads

pytestmark = pytest.mark.engine

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PAD = 64 * 1024


def files_of(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def padded(folder: Path) -> dict[str, bytes]:
    """The adapter's files with ``PAD`` bytes of safetensors metadata: the same
    weights in a larger file that every replica without a byte limit loads."""
    from safetensors.torch import load, save

    files = files_of(folder)
    weights = "adapter_model.safetensors"
    files[weights] = save(load(files[weights]), metadata={"pad": "x" * PAD})
    return files


@pytest.fixture(scope="module")
def group(embedded_model: Any, local_ray: Any) -> Iterator[Any]:
    from skyrl_lora.server.cluster.group import GroupConfig, ServerGroup
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    size = sum(len(b) for b in files_of(embedded_model.adapters["moo"]).values())
    config = GroupConfig(
        num_replicas=2,
        argv=embedded_server_argv(embedded_model),
        env=CPU_ENV,
        health_interval_s=0.5,
        replica_argv={1: ["--max-adapter-bytes", str(size + PAD // 2)]},
    )
    with ServerGroup(config) as started:
        yield started


async def served(url: str, tokenizer: Any, name: str) -> tuple[int | None, set[str] | None]:
    """(version, greedy words) of ``name`` on one replica; (None, None) when not loaded."""
    async with RemoteInferenceClient(url) as client:
        listing = await client.list_adapters()
        found = [a for a in listing.adapters if a.lora_name == name]
        if not found:
            return None, None
        out = await client.sample(
            tokenizer.encode("hello", add_special_tokens=False),
            sampling_params=GREEDY,
            lora_name=name,
        )
        assert out.adapter_version == found[0].version
        return found[0].version, set(tokenizer.decode(out.sequences[0].tokens).split())


async def everywhere(group: Any, tokenizer: Any, name: str) -> list[tuple[Any, Any]]:
    return [await served(url, tokenizer, name) for url in group.urls]


async def test_a_push_one_replica_refuses_lands_nowhere(group, embedded_model, tokenizer) -> None:
    adapters = embedded_model.adapters
    push = group.push_lora_adapter
    infos = await asyncio.to_thread(push, "atom", files_of(adapters["moo"]))
    assert [i.version for i in infos] == [1, 1]
    assert await everywhere(group, tokenizer, "atom") == [(1, {"moo"})] * 2

    before = [await staged_file_reads(url) for url in group.urls]
    with pytest.raises(PayloadTooLargeError) as caught:
        await asyncio.to_thread(push, "atom", padded(adapters["woof"]))
    # Replica 0 staged (and installed) version 2; replica 1 refused it unread.
    assert [await staged_file_reads(url) for url in group.urls] == [before[0] + 1, before[1]]
    assert "--max-adapter-bytes" in str(caught.value)
    assert any("replica 1" in note for note in getattr(caught.value, "__notes__", []))
    # Replica 0 had loaded version 2: it serves version 1's weights again.
    assert await everywhere(group, tokenizer, "atom") == [(1, {"moo"})] * 2
    assert group.record()["atom"].version == 1

    # The same version number lands everywhere once every replica takes it.
    infos = await asyncio.to_thread(push, "atom", files_of(adapters["woof"]))
    assert [i.version for i in infos] == [2, 2]
    assert await everywhere(group, tokenizer, "atom") == [(2, {"woof"})] * 2
    await asyncio.sleep(1.5)  # supervision rounds: nothing is caught up or rebuilt
    assert await everywhere(group, tokenizer, "atom") == [(2, {"woof"})] * 2
    assert group.restarts == []


async def test_a_first_load_one_replica_refuses_leaves_the_name_unloaded(
    group, embedded_model, tokenizer
) -> None:
    with pytest.raises(PayloadTooLargeError):
        await asyncio.to_thread(
            group.push_lora_adapter, "atom-new", padded(embedded_model.adapters["meow"])
        )
    assert await everywhere(group, tokenizer, "atom-new") == [(None, None)] * 2
    assert "atom-new" not in group.record()
    infos = await asyncio.to_thread(
        group.push_lora_adapter, "atom-new", files_of(embedded_model.adapters["meow"])
    )
    assert [i.version for i in infos] == [1, 1]
    assert await everywhere(group, tokenizer, "atom-new") == [(1, {"meow"})] * 2


async def test_the_clients_fan_out_is_atomic_too(group, embedded_model, tokenizer) -> None:
    """The same refusal through the client's HTTP push to every replica: replica 1
    answers 413, replica 0 is rolled back through ``/skyrl/v1/adapters/rollback``."""
    woof = embedded_model.adapters["woof"]
    files = padded(woof)
    big = InMemoryAdapter(files["adapter_model.safetensors"], files["adapter_config.json"])
    async with RemoteInferenceClient(group.urls) as client:
        first = await client.push_lora_adapter("atom-http", embedded_model.adapters["moo"])
        assert first.version == 1 and first.consistent
        assert await everywhere(group, tokenizer, "atom-http") == [(1, {"moo"})] * 2
        with pytest.raises(FanOutError) as caught:
            await client.push_lora_adapter("atom-http", big)
        assert list(caught.value.failures) == [group.urls[1]]
        assert isinstance(caught.value.failures[group.urls[1]], PayloadTooLargeError)
        assert "rolled back" in str(caught.value)
        assert await everywhere(group, tokenizer, "atom-http") == [(1, {"moo"})] * 2
        loaded = await client.push_lora_adapter("atom-http", woof)
        assert loaded.version == 2 and loaded.consistent
        assert await everywhere(group, tokenizer, "atom-http") == [(2, {"woof"})] * 2
