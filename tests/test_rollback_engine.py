"""One replica's side of an atomic group swap, on the real engine: a load that
keeps its previous version, then ``/skyrl/v1/adapters/rollback`` or ``.../commit``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.conftest import TENANT_KEYS, EngineServer

pytestmark = pytest.mark.engine

API = "/skyrl/v1"
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
NAME = "atom-one"


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def current(http: aiohttp.ClientSession, server: EngineServer) -> dict[str, Any]:
    async with http.get(server.url + f"{API}/adapters") as resp:
        listing = await resp.json()
    (found,) = [a for a in listing["adapters"] if a["lora_name"] == NAME]
    return found


async def greedy(http: aiohttp.ClientSession, server: EngineServer) -> tuple[int, set[str]]:
    body = {
        "prompt_token_ids": server.encode("hello"),
        "sampling_params": GREEDY,
        "lora_name": NAME,
    }
    status, out = await post(http, server.url + f"{API}/sample", body)
    assert status == 200, out
    words = set(server.tokenizer.decode(out["sequences"][0]["tokens"]).split())
    return out["adapter_version"], words


async def load(http: aiohttp.ClientSession, server: EngineServer, word: str, **extra: Any) -> Any:
    body = {"lora_name": NAME, "lora_path": str(server.model.adapters[word]), **extra}
    status, info = await post(http, server.url + f"{API}/adapters/load", body)
    assert status == 200, info
    return info


async def test_rollback_serves_the_kept_version_and_frees_the_number(
    engine_server: EngineServer, http: aiohttp.ClientSession
) -> None:
    url = engine_server.url
    first = await load(http, engine_server, "meow")
    v = first["version"]
    info = await load(http, engine_server, "woof", version=v + 1, keep_previous_s=60)
    assert info["version"] == v + 1
    assert await greedy(http, engine_server) == (v + 1, {"woof"})
    await asyncio.sleep(0.5)  # a retire would have run by now: the kept version is still there
    assert [d["version"] for d in (await current(http, engine_server))["draining"]] == [v]

    status, settled = await post(
        http, url + f"{API}/adapters/rollback", {"lora_name": NAME, "version": v + 1}
    )
    assert status == 200 and settled == {"lora_name": NAME, "version": v, "changed": True}
    assert await greedy(http, engine_server) == (v, {"meow"})
    assert (await current(http, engine_server))["draining"] == []
    status, again = await post(
        http, url + f"{API}/adapters/rollback", {"lora_name": NAME, "version": v + 1}
    )
    assert status == 200 and again == {"lora_name": NAME, "version": v, "changed": False}
    pinned = {
        "prompt_token_ids": engine_server.encode("hello"),
        "sampling_params": GREEDY,
        "lora_name": NAME,
        "lora_version": v + 1,
    }
    assert (await post(http, url + f"{API}/sample", pinned))[0] == 410

    # The rolled back number loads again (other weights: moo), then commits.
    await load(http, engine_server, "moo", version=v + 1, keep_previous_s=60)
    assert await greedy(http, engine_server) == (v + 1, {"moo"})
    status, settled = await post(
        http, url + f"{API}/adapters/commit", {"lora_name": NAME, "version": v + 1}
    )
    assert status == 200 and settled == {"lora_name": NAME, "version": v + 1, "changed": True}
    deadline = time.monotonic() + 30
    while (await current(http, engine_server))["draining"]:  # the kept version retires
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    status, noop = await post(
        http, url + f"{API}/adapters/rollback", {"lora_name": NAME, "version": v + 1}
    )
    assert status == 200 and noop["changed"] is False  # committed: nothing to undo
    assert await greedy(http, engine_server) == (v + 1, {"moo"})


async def test_an_uncommitted_swap_commits_by_itself(
    engine_server: EngineServer, http: aiohttp.ClientSession
) -> None:
    v = (await load(http, engine_server, "meow"))["version"]
    await load(http, engine_server, "woof", keep_previous_s=0.5)
    deadline = time.monotonic() + 30
    while (await current(http, engine_server))["draining"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    status, noop = await post(
        http, engine_server.url + f"{API}/adapters/rollback", {"lora_name": NAME, "version": v + 1}
    )
    assert status == 200 and noop == {"lora_name": NAME, "version": v + 1, "changed": False}


async def test_bad_input_and_other_tenants_are_refused(
    engine_server: EngineServer, http: aiohttp.ClientSession
) -> None:
    url = engine_server.url
    await load(http, engine_server, "meow")
    for bad in (0, -1, 7200):
        body = {"lora_name": NAME, "lora_path": str(engine_server.model.adapters["woof"])}
        status, _ = await post(http, url + f"{API}/adapters/load", {**body, "keep_previous_s": bad})
        assert status in (400, 422)
    for bad_ref in ({"lora_name": NAME, "version": 0}, {"lora_name": NAME}):
        for step in ("commit", "rollback"):
            assert (await post(http, url + f"{API}/adapters/{step}", bad_ref))[0] in (400, 422)
    headers = {"Authorization": f"Bearer {TENANT_KEYS['sec-a']}"}
    async with aiohttp.ClientSession(headers=headers) as tenant:
        for step in ("commit", "rollback"):
            status, _ = await post(
                tenant, url + f"{API}/adapters/{step}", {"lora_name": NAME, "version": 1}
            )
            assert status == 403


async def test_a_sample_running_on_the_rolled_back_version_finishes_on_the_kept_one(
    engine_server: EngineServer, http: aiohttp.ClientSession
) -> None:
    from skyrl_lora.client import RemoteInferenceClient

    v = (await load(http, engine_server, "meow"))["version"]
    await load(http, engine_server, "woof", version=v + 1, keep_previous_s=60)
    long = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        running = asyncio.create_task(
            c.sample_with_retry(engine_server.encode("hello"), sampling_params=long, lora_name=NAME)
        )
        await asyncio.sleep(0.5)
        status, settled = await post(
            http,
            engine_server.url + f"{API}/adapters/rollback",
            {"lora_name": NAME, "version": v + 1},
        )
        assert status == 200 and settled["changed"] and settled["version"] == v
        (seq,) = (await asyncio.wait_for(running, 120)).sequences
    assert len(seq.tokens) == 200 and seq.stop_reason == "length"
    assert [r.version for r in seq.versions] == [v + 1, v]
    first, second = seq.versions
    words = engine_server.tokenizer.decode
    assert set(words(seq.tokens[first.start : first.end]).split()) == {"woof"}
    assert set(words(seq.tokens[second.start : second.end]).split()) == {"meow"}
