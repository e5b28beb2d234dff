"""The official Tinker SDK (the ``tinker`` test extra, 0.38.0) against the real server.

Every call goes through the unchanged SDK: its handshake, ``asample``, the
``retrieve_future`` polling and its own protobuf decoder. References come
from ``/skyrl/v1/sample`` through our own client on the same server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from skyrl_lora.client import RemoteInferenceClient
from tests.conftest import TENANT_KEYS, EngineServer

pytestmark = pytest.mark.engine

tinker = pytest.importorskip("tinker")
types = tinker.types

# Long enough that three pauses land mid-sample on the CPU engine.
LONG = 900
#: ``tk-babble``'s weights under another name: the uninterrupted reference
#: runs beside the sample under test, which pauses ``tk-babble`` only. The
#: engine answers a greedy request batched beside another the same, token
#: and logprob for logprob (1000 tokens of babble in a probe at 2ba83d6, on
#: the 2-core CPU machine), and the two take the time of one.
TWIN = "tk-babble-twin"
BAD_INPUT_S = 10.0


def greedy(max_tokens: int, stop: Any = None) -> Any:
    return types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)


@pytest.fixture(scope="module")
async def admin(engine_server: EngineServer) -> AsyncIterator[RemoteInferenceClient]:
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        await c.load_lora_adapter("tk-meow", str(engine_server.model.adapters["meow"]))
        await c.load_lora_adapter("tk-babble", str(engine_server.model.adapters["babble"]))
        await c.load_lora_adapter(TWIN, str(engine_server.model.adapters["babble"]))
        await c.load_lora_adapter("sec-a", str(engine_server.model.adapters["meow"]))
        await c.load_lora_adapter("sec-b", str(engine_server.model.adapters["woof"]))
        yield c


def service_for(server: EngineServer, key: str) -> Any:
    return tinker.ServiceClient(base_url=server.url, api_key=f"tml-{key}")


@pytest.fixture(scope="module")
def service(engine_server: EngineServer) -> Iterator[Any]:
    client = service_for(engine_server, engine_server.admin_key or "open")
    yield client
    client.close("success")


async def sampler(service: Any, **target: str) -> Any:
    return await asyncio.to_thread(lambda: service.create_sampling_client(**target).result())


async def reference(admin: RemoteInferenceClient, prompt: list[int], lora: str | None, n: int):
    params = {"max_tokens": n, "temperature": 0.0}
    return (await admin.sample(prompt, sampling_params=params, lora_name=lora)).sequences[0]


@pytest.mark.parametrize("lora", [None, "tk-meow"])
async def test_greedy_equals_skyrl_sample(engine_server, admin, service, lora) -> None:
    target = {"base_model": "tiny-llama"} if lora is None else {"model_path": f"tinker://{lora}"}
    client = await sampler(service, **target)
    prompt = engine_server.encode("hello there")
    ref = await reference(admin, prompt, lora, 24)
    result = await client.sample(types.ModelInput.from_ints(prompt), 1, greedy(24))
    (seq,) = result.sequences
    assert seq.tokens == ref.tokens
    assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert seq.stop_reason == ref.stop_reason
    assert seq.sequence_id  # the SDK stamps the ids asample answered


async def test_compute_logprobs_and_topk_prompt_logprobs(engine_server, admin, service) -> None:
    client = await sampler(service, model_path="tinker://tk-meow")
    prompt = engine_server.encode("the cat sat on the mat")
    ours = await admin.sample(
        prompt, sampling_params={"max_tokens": 1}, lora_name="tk-meow", prompt_logprobs=True
    )
    logprobs = await client.compute_logprobs(types.ModelInput.from_ints(prompt))
    assert logprobs[0] is None
    assert logprobs[1:] == pytest.approx(ours.prompt_logprobs[1:], abs=1e-4)

    result = await client.sample(
        types.ModelInput.from_ints(prompt),
        1,
        greedy(2),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    )
    assert result.prompt_logprobs[1:] == pytest.approx(ours.prompt_logprobs[1:], abs=1e-4)
    rows = result.topk_prompt_logprobs
    assert rows[0] is None and len(rows) == len(prompt)
    for token, chosen, row in zip(prompt[1:], result.prompt_logprobs[1:], rows[1:]):
        assert len(row) == 3
        assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        assert row[0][1] >= chosen - 1e-5  # the top one is at least as likely as the prompt's
        if token in dict(row):
            assert dict(row)[token] == pytest.approx(chosen, abs=1e-4)


async def test_num_samples_and_stop(engine_server, service) -> None:
    client = await sampler(service, base_model="tiny-llama")
    prompt = types.ModelInput.from_ints(engine_server.encode("once upon a time"))
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=7, stop=[])
    result = await client.sample(prompt, 4, params)
    assert len(result.sequences) == 4
    assert all(len(s.tokens) == 12 and s.stop_reason == "length" for s in result.sequences)
    assert len({s.sequence_id for s in result.sequences}) == 4
    assert len({tuple(s.tokens) for s in result.sequences}) > 1, "samples must differ"
    # A stop token ends the sequence on it.
    (first,) = (await client.sample(prompt, 1, greedy(12, stop=[]))).sequences
    stop_token = first.tokens[3]
    (cut,) = (await client.sample(prompt, 1, greedy(12, stop=[stop_token]))).sequences
    assert cut.stop_reason == "stop"
    assert cut.tokens == first.tokens[: first.tokens.index(stop_token) + 1]


async def test_a_paused_adapter_waits_then_completes(engine_server, admin, service) -> None:
    client = await sampler(service, model_path="tinker://tk-meow")
    prompt = engine_server.encode("hello there")
    ref = await reference(admin, prompt, "tk-meow", 16)
    await admin.pause_generation(lora_name="tk-meow")
    try:
        task = asyncio.ensure_future(
            client.sample(types.ModelInput.from_ints(prompt), 1, greedy(16)).result_async()
        )
        await asyncio.sleep(2.0)
        assert not task.done(), "a paused adapter's sample must wait, not fail or finish"
    finally:
        await admin.resume_generation(lora_name="tk-meow")
    (seq,) = (await asyncio.wait_for(task, 60)).sequences
    assert seq.tokens == ref.tokens


async def test_pauses_mid_sample_give_the_uninterrupted_answer(
    engine_server, admin, service
) -> None:
    client = await sampler(service, model_path="tinker://tk-babble")
    prompt = engine_server.encode("hello there how are you")
    params = {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
    uninterrupted = asyncio.ensure_future(
        admin.sample(prompt, sampling_params=params, lora_name=TWIN)
    )
    task = asyncio.ensure_future(
        client.sample(types.ModelInput.from_ints(prompt), 1, greedy(LONG, stop=[])).result_async()
    )
    aborted = await pauses_mid_sample(admin, "tk-babble", times=3)
    (seq,) = (await asyncio.wait_for(task, 180)).sequences
    ref = (await uninterrupted).sequences[0]
    assert aborted == 3, "each pause must have landed mid-sample"
    assert seq.tokens == ref.tokens
    assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert seq.stop_reason == "length"


async def pauses_mid_sample(
    admin: RemoteInferenceClient, name: str, times: int, hold_s: float = 0.3
) -> int:
    """Pause ``name`` ``times`` times while its sample runs; how many requests they aborted."""
    aborted = 0
    for _ in range(times):
        await wait_in_flight(admin, name)
        (paused,) = await admin.pause_generation(lora_name=name)
        aborted += paused.aborted
        await asyncio.sleep(hold_s)
        await admin.resume_generation(lora_name=name)
    return aborted


async def wait_in_flight(admin: RemoteInferenceClient, name: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        (state,) = [a for a in (await admin.list_adapters()).adapters if a.lora_name == name]
        if state.engine_requests >= 1:
            break
        assert time.monotonic() < deadline, "the sample never reached the engine"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)


async def test_after_a_reload_a_new_client_samples_the_new_weights(
    engine_server, admin, service
) -> None:
    await admin.load_lora_adapter("tk-swap", str(engine_server.model.adapters["meow"]))
    (old,) = [a for a in (await admin.list_adapters()).adapters if a.lora_name == "tk-swap"]
    path = f"tinker://tk-swap/sampler_weights/{old.version}"
    pinned = await sampler(service, model_path=path)
    prompt = types.ModelInput.from_ints(engine_server.encode("hello there"))
    meow = (await pinned.sample(prompt, 1, greedy(16))).sequences[0].tokens
    headers = {"Authorization": f"Bearer {engine_server.admin_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        lease_url = f"{engine_server.url}/skyrl/v1/adapters/lease"
        async with http.post(lease_url, json={"lora_name": "tk-swap"}) as resp:
            lease = await resp.json()
            assert resp.status == 200, lease
        await admin.load_lora_adapter("tk-swap", str(engine_server.model.adapters["woof"]))
        client = await sampler(service, model_path="tinker://tk-swap")
        woof = (await client.sample(prompt, 1, greedy(16))).sequences[0].tokens
        assert woof == (await reference(admin, prompt.to_ints(), "sec-b", 16)).tokens
        assert woof != meow
        # The leased old version still serves the pinned sampler, and a new one.
        assert (await pinned.sample(prompt, 1, greedy(16))).sequences[0].tokens == meow
        again = await sampler(service, model_path=path)
        assert (await again.sample(prompt, 1, greedy(16))).sequences[0].tokens == meow
        async with http.delete(f"{lease_url}/{lease['lease_id']}") as resp:
            assert resp.status == 200
    started = time.monotonic()
    with pytest.raises(Exception, match="no longer held"):
        await pinned.sample(prompt, 1, greedy(16))
    with pytest.raises(Exception, match="no longer held"):
        await sampler(service, model_path=path)
    assert time.monotonic() - started < BAD_INPUT_S


async def test_bad_input_errors_within_seconds(engine_server, admin, service) -> None:
    client = await sampler(service, model_path="tinker://tk-meow")
    vocab = len(engine_server.tokenizer)
    cases = {
        "out of vocabulary": [1, 2, vocab + 1000],
        "context": [1] * 2000,
    }
    for what, prompt in cases.items():
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            await client.sample(types.ModelInput.from_ints(prompt), 1, greedy(4))
        assert time.monotonic() - started < BAD_INPUT_S, what
        print(f"{what}: {caught.value}")
    started = time.monotonic()
    with pytest.raises(Exception, match="not loaded"):
        await sampler(service, model_path="tinker://no-such-adapter")
    with pytest.raises(Exception, match="serves base model"):
        await sampler(service, base_model="Qwen/Qwen3-8B")
    assert time.monotonic() - started < BAD_INPUT_S
    # The server keeps serving afterwards.
    ok = await client.sample(types.ModelInput.from_ints(engine_server.encode("hi")), 1, greedy(4))
    assert len(ok.sequences[0].tokens) >= 1


async def test_tenant_keys_reach_only_their_own_adapters(engine_server, admin) -> None:
    tenant = await asyncio.to_thread(service_for, engine_server, TENANT_KEYS["sec-a"])
    try:
        own = await sampler(tenant, model_path="tinker://sec-a")
        prompt = engine_server.encode("hello there")
        result = await own.sample(types.ModelInput.from_ints(prompt), 1, greedy(8))
        assert result.sequences[0].tokens == (await reference(admin, prompt, "sec-a", 8)).tokens
        for target in ({"model_path": "tinker://sec-b"}, {"base_model": "tiny-llama"}):
            with pytest.raises(Exception, match="may not use"):
                await sampler(tenant, **target)
    finally:
        tenant.close("success")
    with pytest.raises(Exception, match="unknown API key"):
        bad = await asyncio.to_thread(service_for, engine_server, "not-a-key")
        await sampler(bad, model_path="tinker://sec-a")


async def test_training_calls_say_sampling_only(engine_server, service) -> None:
    started = time.monotonic()
    with pytest.raises(Exception, match="not supported: sampling-only server"):
        await asyncio.to_thread(
            lambda: service.create_lora_training_client(base_model="tiny-llama").result()
        )
    assert time.monotonic() - started < BAD_INPUT_S
    # The calls a training client would make, as the SDK sends them.
    headers = {"X-API-Key": f"tml-{engine_server.admin_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for path in ("forward_backward", "optim_step", "save_weights_for_sampler", "save_weights"):
            async with http.post(f"{engine_server.url}/api/v1/{path}", json={}) as resp:
                body = await resp.json()
            assert resp.status == 400, path
            assert body["category"] == "user"
            assert body["error"].startswith("not supported: sampling-only server"), path


async def test_the_wire_reports_a_pause_as_paused_rate_limit(engine_server, admin) -> None:
    """The protocol as the SDK speaks it: a pause mid-sample reads ``try_again`` with
    ``paused_rate_limit``, then the whole sequence arrives as protobuf."""
    from tinker.proto.response_conv import deserialize_sample_response

    prompt = engine_server.encode("hello there how are you")
    # EOS stays on: same as stop=None; beside the sample under test (TWIN)
    uninterrupted = asyncio.ensure_future(reference(admin, prompt, TWIN, LONG))
    headers = {"X-API-Key": f"tml-{engine_server.admin_key}"}
    api = f"{engine_server.url}/api/v1"
    async with aiohttp.ClientSession(headers=headers) as http:

        async def post(path: str, body: dict) -> tuple[int, str, bytes]:
            async with http.post(f"{api}/{path}", json=body) as resp:
                return resp.status, resp.content_type, await resp.read()

        session = await post(
            "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "x"}
        )
        session_id = json.loads(session[2])["session_id"]
        created = await post(
            "create_sampling_session",
            {
                "session_id": session_id,
                "sampling_session_seq_id": 0,
                "model_path": "tinker://tk-babble",
            },
        )
        sampler_id = json.loads(created[2])["sampling_session_id"]
        submitted = await post(
            "asample",
            {
                "sampling_session_id": sampler_id,
                "seq_id": 0,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": LONG, "temperature": 0.0},
            },
        )
        answer = json.loads(submitted[2])
        request_id = answer["request_id"]
        assert len(answer["sample_sequence_ids"]) == 1
        await wait_in_flight(admin, "tk-babble")
        poll = asyncio.ensure_future(post("retrieve_future", {"request_id": request_id}))
        await asyncio.sleep(0.3)
        await admin.pause_generation(lora_name="tk-babble")
        try:
            paused = json.loads((await asyncio.wait_for(poll, 30))[2])
            assert paused == {
                "type": "try_again",
                "request_id": request_id,
                "queue_state": "paused_rate_limit",
            }
        finally:
            await admin.resume_generation(lora_name="tk-babble")
        while True:
            done = await post("retrieve_future", {"request_id": request_id})
            if done[1] == "application/x-protobuf":
                break
            assert json.loads(done[2])["type"] == "try_again"
        (seq,) = deserialize_sample_response(done[2]).sequences
        assert seq.tokens == (await uninterrupted).tokens
        gone = await post("retrieve_future", {"request_id": "skyrl-future-unknown"})
        assert gone[0] == 410


async def test_tinker_base_url_from_the_environment(engine_server, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_BASE_URL", engine_server.url)
    monkeypatch.setenv("TINKER_API_KEY", f"tml-{engine_server.admin_key}")
    service = await asyncio.to_thread(tinker.ServiceClient)
    try:
        client = await sampler(service, base_model="tiny-llama")
        result = await client.sample(types.ModelInput.from_ints([1, 2, 3]), 1, greedy(4))
        assert len(result.sequences[0].tokens) >= 1
    finally:
        service.close("success")
