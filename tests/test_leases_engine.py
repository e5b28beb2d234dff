"""Pinned versions and leases on the real engine: a rollout keeps the version it started on."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import VersionGoneError
from skyrl_lora.server.adapters.leases import DEFAULT_MAX_VERSIONS_PER_ADAPTER
from tests.conftest import TENANT_KEYS, EngineServer

pytestmark = pytest.mark.engine

API = "/skyrl/v1"
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
async def admin(engine_server: EngineServer):
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        yield c


async def call(
    server: EngineServer, method: str, path: str, key: str | None, body: Any = None
) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.request(method, server.url + API + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def lease(server: EngineServer, body: dict, key: str | None = None) -> tuple[int, dict]:
    return await call(server, "POST", "/adapters/lease", key or server.admin_key, body)


async def release(server: EngineServer, lease_id: str, key: str | None = None) -> tuple[int, dict]:
    return await call(server, "DELETE", f"/adapters/lease/{lease_id}", key or server.admin_key)


async def fresh(admin: RemoteInferenceClient, server: EngineServer, word: str) -> str:
    name = f"lease-{uuid.uuid4().hex[:6]}"
    await admin.push_lora_adapter(name, server.model.adapters[word])
    return name


async def pinned(
    client: RemoteInferenceClient, server: EngineServer, name: str, version: int | None
) -> tuple[set[str], int | None]:
    out = await client.sample(
        server.encode("hello"), sampling_params=GREEDY, lora_name=name, lora_version=version
    )
    return set(server.tokenizer.decode(out.sequences[0].tokens).split()), out.adapter_version


async def state(client: RemoteInferenceClient, name: str):
    (found,) = [a for a in (await client.list_adapters()).adapters if a.lora_name == name]
    return found


async def test_a_leased_old_version_answers_with_its_own_weights_until_released(
    engine_server, admin
) -> None:
    name = await fresh(admin, engine_server, "meow")
    status, granted = await lease(engine_server, {"lora_name": name, "ttl_s": 120})
    assert status == 200, granted
    assert granted["lora_name"] == name and granted["version"] == 1
    assert 119 <= granted["expires_in_s"] <= 120
    (info,) = await admin.push_lora_adapter(name, engine_server.model.adapters["woof"])
    assert info.version == 2 and info.leased == [1]
    assert [d.version for d in info.draining] == [1]
    assert await pinned(admin, engine_server, name, 1) == ({"meow"}, 1)
    assert await pinned(admin, engine_server, name, 2) == ({"woof"}, 2)
    assert await pinned(admin, engine_server, name, None) == ({"woof"}, 2)
    retried = await admin.sample_with_retry(
        engine_server.encode("hello"), sampling_params=GREEDY, lora_name=name, lora_version=1
    )
    assert [r.version for r in retried.sequences[0].versions] == [1]
    status, released = await release(engine_server, granted["lease_id"])
    assert status == 200 and released["version"] == 1
    with pytest.raises(VersionGoneError, match=f"version 1 of LoRA adapter '{name}'"):
        await pinned(admin, engine_server, name, 1)
    status, body = await call(
        engine_server,
        "POST",
        "/sample",
        engine_server.admin_key,
        {"prompt_token_ids": [1, 2], "lora_name": name, "lora_version": 1},
    )
    assert status == 410 and body["error"]["type"] == "version_gone"
    for _ in range(100):  # retired: listed as draining until its slot and snapshot are freed
        if (await state(admin, name)).draining == []:
            break
        await asyncio.sleep(0.02)
    assert (await state(admin, name)).draining == []
    assert not (engine_server.snapshot_dir / name / "v1").exists()
    status, body = await release(engine_server, granted["lease_id"])
    assert status == 404 and body["error"]["type"] == "lease_not_found"


async def test_a_lease_expires_on_its_own(engine_server, admin) -> None:
    name = await fresh(admin, engine_server, "moo")
    status, granted = await lease(engine_server, {"lora_name": name, "version": 1, "ttl_s": 1.0})
    assert status == 200, granted
    await admin.push_lora_adapter(name, engine_server.model.adapters["quack"])
    assert await pinned(admin, engine_server, name, 1) == ({"moo"}, 1)
    await asyncio.sleep(1.5)  # the trainer "crashed": nobody releases it
    with pytest.raises(VersionGoneError):
        await pinned(admin, engine_server, name, 1)
    after = await state(admin, name)
    assert after.leased == [] and after.version == 2
    status, _ = await release(engine_server, granted["lease_id"])
    assert status == 404


async def test_versions_held_per_adapter_are_bounded(engine_server, admin) -> None:
    """The default bound: the current version and N-1 leased ones."""
    bound = DEFAULT_MAX_VERSIONS_PER_ADAPTER
    name = await fresh(admin, engine_server, "meow")
    granted = []
    for version in range(1, bound):
        status, body = await lease(engine_server, {"lora_name": name, "ttl_s": 60})
        assert status == 200 and body["version"] == version, body
        granted.append(body["lease_id"])
        await admin.push_lora_adapter(name, engine_server.model.adapters["woof"])
    status, body = await lease(engine_server, {"lora_name": name, "ttl_s": 60})
    assert status == 409 and f"--max-versions-per-adapter={bound}" in body["error"]["message"]
    status, body = await lease(engine_server, {"lora_name": name, "version": 1, "ttl_s": 60})
    assert status == 200, "a version already leased costs nothing"
    granted.append(body["lease_id"])
    current = await state(admin, name)
    assert current.version == bound and current.leased == list(range(1, bound))
    for lease_id in granted:
        assert (await release(engine_server, lease_id))[0] == 200
    status, body = await lease(engine_server, {"lora_name": name, "ttl_s": 60})
    assert status == 200 and body["version"] == bound
    await release(engine_server, body["lease_id"])


async def test_a_pinned_rollout_resumes_on_its_leased_version_after_an_abort_resume_swap(
    engine_server, admin
) -> None:
    name = await fresh(admin, engine_server, "meow")
    status, granted = await lease(engine_server, {"lora_name": name, "ttl_s": 120})
    assert status == 200
    long = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    rollout = asyncio.create_task(
        admin.sample_with_retry(
            engine_server.encode("hello"), sampling_params=long, lora_name=name, lora_version=1
        )
    )
    await asyncio.sleep(0.5)
    (info,) = await admin.push_lora_adapter(name, engine_server.model.adapters["woof"])
    assert info.applied_swap_policy == "abort_resume" and info.version == 2
    (seq,) = (await asyncio.wait_for(rollout, 120)).sequences
    assert len(seq.tokens) == 200 and set(seq.tokens) == {engine_server.word_id("meow")}
    assert {r.version for r in seq.versions} == {1}
    await release(engine_server, granted["lease_id"])


async def test_an_unleased_pinned_rollout_is_not_resumed_on_another_version(
    engine_server, admin
) -> None:
    name = await fresh(admin, engine_server, "meow")
    long = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    rollout = asyncio.create_task(
        admin.sample_with_retry(
            engine_server.encode("hello"), sampling_params=long, lora_name=name, lora_version=1
        )
    )
    await asyncio.sleep(0.5)
    await admin.push_lora_adapter(name, engine_server.model.adapters["woof"])
    with pytest.raises(VersionGoneError):
        await asyncio.wait_for(rollout, 120)


async def test_finish_old_serves_pinned_samples_while_the_old_version_drains(
    engine_server, admin
) -> None:
    name = await fresh(admin, engine_server, "moo")
    long = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    old = asyncio.create_task(
        admin.sample(engine_server.encode("hello"), sampling_params=long, lora_name=name)
    )
    await asyncio.sleep(0.5)
    (info,) = await admin.push_lora_adapter(
        name, engine_server.model.adapters["quack"], swap_policy="finish_old"
    )
    assert info.applied_swap_policy == "finish_old"
    assert await pinned(admin, engine_server, name, 1) == ({"moo"}, 1)
    assert (await old).sequences[0].stop_reason == "length"
    for _ in range(100):
        if not (await state(admin, name)).draining:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(VersionGoneError):
        await pinned(admin, engine_server, name, 1)


async def test_bad_lease_requests_get_a_clear_4xx_and_lose_nothing_in_flight(
    engine_server, admin
) -> None:
    await admin.load_lora_adapter("sec-b", str(engine_server.model.adapters["woof"]))
    name = await fresh(admin, engine_server, "meow")
    long = {"max_tokens": 150, "temperature": 0.0, "ignore_eos": True}
    running = asyncio.create_task(
        admin.sample(engine_server.encode("hello"), sampling_params=long, lora_name=name)
    )
    await asyncio.sleep(0.3)
    tenant = TENANT_KEYS["sec-a"]
    cases: list[tuple[str, int, tuple[str, dict | str], str | None]] = [
        ("negative ttl", 400, ("POST", {"lora_name": name, "ttl_s": -1}), None),
        ("version 0", 400, ("POST", {"lora_name": name, "version": 0}), None),
        ("gone version", 410, ("POST", {"lora_name": name, "version": 99}), None),
        ("unknown adapter", 404, ("POST", {"lora_name": "no-such-adapter"}), None),
        ("another tenant's", 403, ("POST", {"lora_name": "sec-b"}), tenant),
        ("unknown lease id", 404, ("DELETE", "lease-never-granted"), None),
    ]
    for label, expected, (method, what), key in cases:
        if method == "POST":
            assert isinstance(what, dict)
            status, body = await lease(engine_server, what, key)
        else:
            assert isinstance(what, str)
            status, body = await release(engine_server, what, key)
        assert status == expected, (label, body)
        assert body["error"]["message"], label
    status, others = await lease(engine_server, {"lora_name": "sec-b", "ttl_s": 30})
    assert status == 200
    status, body = await release(engine_server, others["lease_id"], tenant)
    assert status == 403, "a tenant may not release another tenant's lease"
    assert (await release(engine_server, others["lease_id"]))[0] == 200
    (seq,) = (await running).sequences
    assert seq.stop_reason == "length" and len(seq.tokens) == 150
    assert (await state(admin, name)).in_flight == 0


async def test_a_tenant_leases_and_releases_its_own_adapter(engine_server, admin) -> None:
    await admin.load_lora_adapter("sec-a", str(engine_server.model.adapters["meow"]))
    tenant = TENANT_KEYS["sec-a"]
    status, granted = await lease(engine_server, {"lora_name": "sec-a", "ttl_s": 30}, tenant)
    assert status == 200, granted
    status, _ = await release(engine_server, granted["lease_id"], tenant)
    assert status == 200
