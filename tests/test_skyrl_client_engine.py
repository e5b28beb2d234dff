"""SkyRL's own ``RemoteInferenceClient`` (``skyrl`` 0.3.0, unchanged) against the real server.

References come from ``/skyrl/v1/sample`` through our client on the same
server. The session server has API keys: SkyRL's client sends none, so it
is handed an aiohttp session that carries the admin key (its only seam);
every request is still built and read by SkyRL's own code.
"""

from __future__ import annotations

import asyncio
import sys
import typing
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from skyrl_lora.client import RemoteInferenceClient as OurClient
from tests.conftest import EngineServer
from tests.test_tinker_sdk_engine import wait_in_flight

pytestmark = pytest.mark.engine

# LONG keeps a greedy request running for a few seconds on the CPU engine.
LONG = 600


def _import_skyrl_client() -> Any:
    """SkyRL's client module; on Python 3.11 pydantic needs typing_extensions'
    TypedDict for its TypedDicts (the shim is undone after the import)."""
    typing_extensions = pytest.importorskip("typing_extensions")
    original = typing.TypedDict
    if sys.version_info < (3, 12):
        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    try:
        return pytest.importorskip(
            "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"
        )
    finally:
        typing.TypedDict = original  # type: ignore[misc]


skyrl = _import_skyrl_client()


def skyrl_client(server: EngineServer, **options: Any) -> Any:
    client = skyrl.RemoteInferenceClient(
        proxy_url=server.url,
        server_urls=[server.url],
        data_parallel_size=1,
        model_name="tiny-llama",
        **options,
    )
    if server.admin_key:
        client._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {server.admin_key}"}
        )
    return client


@pytest.fixture(scope="module")
async def ours(engine_server: EngineServer) -> AsyncIterator[OurClient]:
    async with OurClient(engine_server.url, api_key=engine_server.admin_key) as c:
        await c.load_lora_adapter("skyrl-meow", str(engine_server.model.adapters["meow"]))
        await c.load_lora_adapter("skyrl-babble", str(engine_server.model.adapters["babble"]))
        yield c


@pytest.fixture
async def client(engine_server: EngineServer) -> AsyncIterator[Any]:
    c = skyrl_client(engine_server)
    try:
        yield c
    finally:
        await c.resume()  # never leave the shared server paused
        await c.teardown()


async def reference(ours: OurClient, prompt: list[int], lora: str | None, **params: Any) -> Any:
    params = {"temperature": 0.0, **params}
    return (await ours.sample(prompt, sampling_params=params, lora_name=lora)).sequences[0]


def batch(prompts: list[list[int]], **params: Any) -> Any:
    return {"prompt_token_ids": prompts, "sampling_params": {"temperature": 0.0, **params}}


@pytest.mark.parametrize("lora", [None, "skyrl-meow"])
async def test_generate_equals_skyrl_sample_greedy(engine_server, ours, client, lora) -> None:
    prompts = [engine_server.encode("hello there"), engine_server.encode("once upon a time")]
    out = await client.generate(batch(prompts, max_tokens=24, logprobs=0), model=lora)
    for i, prompt in enumerate(prompts):
        ref = await reference(ours, prompt, lora, max_tokens=24)
        assert out["response_ids"][i] == ref.tokens
        assert out["stop_reasons"][i] == ref.stop_reason
        assert out["response_logprobs"][i] == pytest.approx(ref.logprobs, abs=1e-4)
        assert out["responses"][i] == engine_server.tokenizer.decode(ref.tokens)
    # SkyRL's generator also sends min_tokens=1, min_p=0 and output-only fields.
    skyrl_defaults = {"min_tokens": 1, "min_p": 0.0, "skip_special_tokens": True, "top_k": -1}
    again = await client.generate(
        batch(prompts[:1], max_tokens=24, include_stop_str_in_output=True, **skyrl_defaults),
        model=lora,
    )
    assert again["response_ids"][0] == out["response_ids"][0]
    assert again["response_logprobs"] is None  # not asked for


async def test_tinker_style_sample_with_greedy_num_samples(engine_server, ours, client) -> None:
    prompt = engine_server.encode("the cat sat on the mat")
    ref = await reference(ours, prompt, "skyrl-meow", max_tokens=16)
    answer = await client.sample(
        {
            "json": {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "num_samples": 3,
                "sampling_params": {"temperature": 0.0, "max_tokens": 16},
                "include_prompt_logprobs": True,
                "topk_prompt_logprobs": 2,
                "model": "skyrl-meow",
            }
        }
    )
    assert [s["tokens"] for s in answer["sequences"]] == [ref.tokens] * 3
    assert answer["sequences"][0]["logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    scored = await ours.sample(
        prompt, sampling_params={"max_tokens": 1}, lora_name="skyrl-meow", prompt_logprobs=True
    )
    assert answer["prompt_logprobs"][0] is None
    assert answer["prompt_logprobs"][1:] == pytest.approx(scored.prompt_logprobs[1:], abs=1e-4)
    assert all(len(row) == 2 for row in answer["topk_prompt_logprobs"][1:])


async def test_keep_pause_holds_new_and_running_requests_to_the_uninterrupted_answer(
    engine_server, ours, client
) -> None:
    prompt = engine_server.encode("hello there how are you")
    params = {"max_tokens": LONG, "ignore_eos": True}
    ref = await reference(ours, prompt, "skyrl-babble", **params)
    short = await reference(ours, prompt, "skyrl-meow", max_tokens=16)
    running = asyncio.ensure_future(
        client.generate(batch([prompt], logprobs=0, **params), model="skyrl-babble")
    )
    await wait_in_flight(ours, "skyrl-babble")
    await client.pause(mode="keep")
    try:
        sent_paused = asyncio.ensure_future(
            client.generate(batch([prompt], max_tokens=16), model="skyrl-meow")
        )
        await asyncio.sleep(1.5)
        assert not running.done() and not sent_paused.done(), "a keep pause must freeze both"
    finally:
        await client.resume()
    out = await asyncio.wait_for(running, 180)
    assert out["response_ids"][0] == ref.tokens
    assert out["response_logprobs"][0] == pytest.approx(ref.logprobs, abs=1e-4)
    assert out["stop_reasons"][0] == "length"
    assert (await asyncio.wait_for(sent_paused, 60))["response_ids"][0] == short.tokens


async def test_abort_pause_returns_running_requests_aborted(engine_server, ours, client) -> None:
    prompt = engine_server.encode("hello there how are you")
    params = {"max_tokens": LONG, "ignore_eos": True}
    ref = await reference(ours, prompt, "skyrl-babble", **params)
    running = asyncio.ensure_future(
        client.generate(batch([prompt], **params), model="skyrl-babble")
    )
    await wait_in_flight(ours, "skyrl-babble")
    answers = await client.pause(mode="abort")
    try:
        out = await asyncio.wait_for(running, 60)
    finally:
        await client.resume()
    assert answers[engine_server.url]["body"]["aborted"] >= 1
    assert out["stop_reasons"][0] == "abort"
    tokens = out["response_ids"][0]
    assert 0 < len(tokens) < LONG and tokens == ref.tokens[: len(tokens)]


async def test_wait_pause_lets_running_requests_finish(engine_server, ours, client) -> None:
    prompt = engine_server.encode("hello there")
    ref = await reference(ours, prompt, None, max_tokens=64, ignore_eos=True)
    running = asyncio.ensure_future(
        client.generate(batch([prompt], max_tokens=64, ignore_eos=True))
    )
    await asyncio.sleep(0.3)
    await client.pause(mode="wait")
    try:
        assert running.done(), "a wait pause answers once what runs has finished"
        assert (await running)["response_ids"][0] == ref.tokens
        held = asyncio.ensure_future(client.generate(batch([prompt], max_tokens=8)))
        await asyncio.sleep(1.0)
        assert not held.done(), "a wait pause holds new requests"
    finally:
        await client.resume()
    assert (await asyncio.wait_for(held, 60))["response_ids"][0] == ref.tokens[:8]


async def test_lora_sync_in_a_keep_pause_moves_running_requests_to_the_new_weights(
    engine_server, ours, client
) -> None:
    """SkyRL's LoRA sync: pause(keep), load the new adapter in place, resume."""
    prompt = engine_server.encode("hello there")
    meow, woof = engine_server.model.adapters["meow"], engine_server.model.adapters["woof"]
    await client.load_lora_adapter("skyrl-sync", str(meow))
    before = await reference(ours, prompt, "skyrl-sync", max_tokens=24)
    await client.pause(mode="keep")
    try:
        held = asyncio.ensure_future(
            client.generate(batch([prompt], max_tokens=24), model="skyrl-sync")
        )
        answer = await asyncio.wait_for(client.load_lora_adapter("skyrl-sync", str(woof)), 60)
        assert answer[engine_server.url]["status"] == 200
    finally:
        await client.resume()
    out = await asyncio.wait_for(held, 60)
    now = await reference(ours, prompt, "skyrl-sync", max_tokens=24)
    assert out["response_ids"][0] == now.tokens
    assert now.tokens != before.tokens, "the reload must change the adapter's answer"
    await client.unload_lora_adapter("skyrl-sync")
    with pytest.raises(aiohttp.ClientResponseError) as gone:
        await client.generate(batch([prompt], max_tokens=4), model="skyrl-sync")
    assert gone.value.status == 404 and "skyrl-sync" in gone.value.message


async def test_control_calls(engine_server, http, client) -> None:
    assert await client.get_world_size() == (1, 1)
    async with http.get(f"{engine_server.url}/get_server_info") as resp:
        info = await resp.json()
        assert resp.status == 200 and info["world_size"] == 1 and info["model"] == "tiny-llama"
    answers = await client.reset_prefix_cache()
    assert answers[engine_server.url]["body"]["status"] == "ok"
    await client.sleep(level=1)
    async with http.get(f"{engine_server.url}/skyrl/v1/adapters") as resp:
        assert (await resp.json())["engine_paused"], "without sleep mode, /sleep pauses"
    await client.wake_up()
    async with http.get(f"{engine_server.url}/skyrl/v1/adapters") as resp:
        assert not (await resp.json())["engine_paused"]
    texts = await client.detokenize(await client.tokenize(["hello there"]))
    assert texts == ["hello there"]


async def test_full_weight_sync_is_refused_by_name(client) -> None:
    for call in (
        client.update_named_weights({"names": ["w"]}),
        client.start_weight_update(),
        client.finish_weight_update(),
    ):
        with pytest.raises(aiohttp.ClientResponseError) as refused:
            await call
        assert refused.value.status == 422
        assert "full-weight sync is not supported" in refused.value.message


async def test_bad_requests_get_a_400_naming_the_field(client) -> None:
    cases = [
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"repetition_penalty": 1.2}, "sampling_params.repetition_penalty"),
        ({"best_of": 2}, "sampling_params.best_of"),
        ({"max_tokens": 0}, "sampling_params.max_tokens"),
    ]
    for params, field in cases:
        with pytest.raises(aiohttp.ClientResponseError) as bad:
            await client.generate(batch([[5, 6]], **params))
        assert bad.value.status == 400 and field in bad.value.message, bad.value.message
    with pytest.raises(aiohttp.ClientResponseError) as unknown:
        await client.generate(batch([[5, 6]]), model="no-such-adapter")
    assert unknown.value.status == 404 and "no-such-adapter" in unknown.value.message
