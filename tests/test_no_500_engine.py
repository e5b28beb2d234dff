"""No 500 for any request a real client can build, on the Tinker and SkyRL surfaces.

Hypothesis draws requests with the clients' own request types: the Tinker
SDK's ``SampleRequest`` (serialized as the SDK serializes it, sent to
``/api/v1/asample`` and followed by ``retrieve_future``, as the SDK does) and
SkyRL's ``RemoteInferenceClient`` (its ``generate`` and ``sample`` build and
send the payloads themselves). Sampling parameters, prompt shapes, sample
counts, logprob options and model names range over what those types accept,
edges and nonsense included. Every answer must be a result or a 4xx whose
message names what was wrong; never a 5xx. The requests are drawn first and
sent concurrently (no shrinking: a failure lists the requests that got it),
so ``TOTAL`` requests take well under a minute on the 2-core CI machine.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import EngineServer
from tests.test_skyrl_client_engine import skyrl_client

pytestmark = pytest.mark.engine

tinker = pytest.importorskip("tinker")
tinker_compat = pytest.importorskip("tinker._compat")

#: Requests sent in all; at most ``CONCURRENCY`` at once.
TOTAL = 2400
CONCURRENCY = 48
ADAPTER = "fuzz-meow"
MAX_MODEL_LEN = 1024  # the embedded preset's --max-model-len
VOCAB = 256
#: What a 4xx message may name: the request's fields, or the thing it names.
NAMES = (
    "num_samples",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "prompt",
    "token",
    "logprobs",
    "model",
    "adapter",
    "sampling",
    "n ",
    "min_",
    "penalty",
    "best_of",
    "version",
)

# -- strategies ------------------------------------------------------------
token = st.integers(-3, VOCAB + 10) | st.integers(0, VOCAB - 1)
prompts = (
    st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=8)
    | st.lists(token, min_size=0, max_size=8)
    | st.sampled_from([MAX_MODEL_LEN - 2, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 5]).map(
        lambda n: [7] * n
    )
)
small_max_tokens = st.integers(-2, 4)
temperature = st.floats(-1.0, 3.0) | st.sampled_from([0.0, 1e-6, 1.0, math.inf, math.nan])
top_p = st.floats(-0.5, 1.5) | st.sampled_from([0.0, 1.0, math.nan])
top_k = st.integers(-3, 300)
seed = st.none() | st.integers(-5, 10) | st.just(2**64 + 1)
stop = (
    st.none()
    | st.just([])
    | st.text(max_size=3)
    | st.lists(st.text(max_size=3), max_size=3)
    | st.lists(token, max_size=3)
)
tinker_models = st.sampled_from(
    [
        {"base_model": "tiny-llama"},
        {"base_model": "not-served"},
        {"model_path": f"tinker://{ADAPTER}"},
        {"model_path": "tinker://no-such-adapter"},
        {"model_path": f"tinker://{ADAPTER}/sampler_weights/999"},
        {"model_path": f"tinker://{ADAPTER}/sampler_weights/x"},
        {"model_path": "s3://elsewhere"},
        {},
    ]
)
skyrl_models = st.sampled_from(["tiny-llama", ADAPTER, "no-such-adapter", ""])


@st.composite
def tinker_request(draw: Any) -> dict[str, Any]:
    params = tinker.types.SamplingParams(
        max_tokens=draw(small_max_tokens),
        temperature=draw(temperature),
        top_p=draw(top_p),
        top_k=draw(top_k),
        seed=draw(seed),
        stop=draw(stop),
    )
    request = tinker.types.SampleRequest(
        num_samples=draw(st.integers(-1, 4) | st.just(300)),
        prompt=tinker.types.ModelInput.from_ints(draw(prompts)),
        sampling_params=params,
        prompt_logprobs=draw(st.none() | st.booleans()),
        topk_prompt_logprobs=draw(st.integers(-1, 4)),
        topk_sample_logprobs=draw(st.sampled_from([0, 0, 0, 2])),
        prompt_logprobs_last_n=draw(st.none() | st.integers(-1, 9)),
        **draw(tinker_models),
    )
    return tinker_compat.model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


@st.composite
def vllm_sampling_params(draw: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_tokens": draw(small_max_tokens),
        "temperature": draw(temperature),
        "top_p": draw(top_p),
        "top_k": draw(top_k),
        "logprobs": draw(st.none() | st.integers(-1, 3)),
    }
    optional = {
        "seed": seed,
        "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
        "stop_token_ids": st.none() | st.lists(token, max_size=3),
        "min_tokens": st.integers(-1, 3),
        "min_p": st.sampled_from([0.0, 0.1, -1.0]),
        "ignore_eos": st.booleans(),
        "prompt_logprobs": st.none() | st.integers(-1, 3),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "repetition_penalty": st.sampled_from([1.0, 1.1]),
        "best_of": st.just(2),
        "n": st.integers(0, 3),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        params[key] = draw(optional[key])
    return params


@st.composite
def skyrl_generate(draw: Any) -> dict[str, Any]:
    return {
        "input_batch": {
            "prompt_token_ids": [draw(prompts)],
            "sampling_params": draw(vllm_sampling_params()),
        },
        "model": draw(skyrl_models),
    }


@st.composite
def skyrl_sample(draw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": draw(prompts)}]},
        "num_samples": draw(st.integers(-1, 4)),
        "sampling_params": {
            "max_tokens": draw(small_max_tokens),
            "temperature": draw(temperature),
            "top_p": draw(top_p),
            "top_k": draw(top_k),
            "seed": draw(seed),
            "stop_tokens": draw(st.none() | st.lists(token, max_size=2)),
        },
        "include_prompt_logprobs": draw(st.booleans()),
        "topk_prompt_logprobs": draw(st.integers(-1, 3)),
        "model": draw(skyrl_models),
    }
    return {"json": body}


requests_drawn = st.one_of(
    st.tuples(st.just("tinker"), tinker_request()),
    st.tuples(st.just("skyrl-generate"), skyrl_generate()),
    st.tuples(st.just("skyrl-sample"), skyrl_sample()),
)

#: Requests that once got a 500, kept as they were drawn.
REGRESSIONS: list[tuple[str, dict[str, Any]]] = []


def draw_requests(count: int) -> list[tuple[str, dict[str, Any]]]:
    drawn: list[tuple[str, dict[str, Any]]] = []

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(requests_drawn)
    def collect(request: tuple[str, dict[str, Any]]) -> None:
        drawn.append(request)

    collect()
    return drawn


# -- sending ---------------------------------------------------------------
@dataclass
class Answer:
    kind: str
    request: dict[str, Any]
    status: int  # 200 for a result; 0 when the client refused to send it
    message: str = ""


def describe(answer: Answer) -> str:
    """One line per answer, with each prompt as its length (some are 1,000 tokens)."""

    def short(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        if isinstance(value, list) and len(value) > 12:
            return f"<{len(value)} items>"
        if isinstance(value, list):
            return [short(v) for v in value]
        return value

    return f"{answer.status} {answer.kind} {short(answer.request)}: {answer.message[:300]}"


async def send_tinker(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    async with http.post(f"{url}/api/v1/asample", json=body) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            return Answer("tinker", body, resp.status, str(answer.get("error")))
    request_id = answer["request_id"]
    while True:
        async with http.post(
            f"{url}/api/v1/retrieve_future", json={"request_id": request_id}
        ) as resp:
            if resp.status != 200:
                error = (await resp.json(content_type=None)).get("error")
                return Answer("tinker", body, resp.status, str(error))
            if resp.content_type == "application/x-protobuf":
                await resp.read()
                return Answer("tinker", body, 200)
            state = await resp.json()
            if state.get("type") != "try_again":
                return Answer("tinker", body, 200)


async def send_skyrl(client: Any, kind: str, request: dict[str, Any]) -> Answer:
    try:
        if kind == "skyrl-generate":
            await client.generate(request["input_batch"], model=request["model"] or None)
        else:
            await client.sample(request)
    except aiohttp.ClientResponseError as exc:
        return Answer(kind, request, exc.status, str(exc.message))
    except (ValueError, TypeError, KeyError) as exc:
        return Answer(kind, request, 0, f"client-side: {exc}")  # never sent
    return Answer(kind, request, 200)


@pytest.fixture(scope="module")
async def setup(engine_server: EngineServer, http: aiohttp.ClientSession) -> AsyncIterator[None]:
    path = str(engine_server.model.adapters["meow"])
    async with http.post(
        f"{engine_server.url}/skyrl/v1/adapters/load",
        json={"lora_name": ADAPTER, "lora_path": path},
    ) as resp:
        assert resp.status == 200, await resp.text()
    yield


@pytest.fixture(scope="module")
async def http(engine_server: EngineServer) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {engine_server.admin_key}"}
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        yield session


async def test_client_requests_never_get_a_500(engine_server, http, setup) -> None:
    drawn = REGRESSIONS + draw_requests(TOTAL)
    client = skyrl_client(engine_server)
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(kind: str, request: dict[str, Any]) -> Answer:
        async with slots:
            if kind == "tinker":
                return await send_tinker(http, engine_server.url, request)
            return await send_skyrl(client, kind, request)

    started = time.monotonic()
    try:
        answers = await asyncio.gather(*(one(kind, request) for kind, request in drawn))
    finally:
        await client.teardown()
    seconds = time.monotonic() - started
    sent = [a for a in answers if a.status != 0]
    by_status: dict[int, int] = {}
    for answer in sent:
        by_status[answer.status] = by_status.get(answer.status, 0) + 1
    print(f"{len(sent)} requests sent in {seconds:.1f} s: {sorted(by_status.items())}")
    failures = [a for a in sent if a.status >= 500 or a.status < 200]
    assert not failures, "\n".join(map(describe, failures[:10]))
    unnamed = [
        a for a in sent if a.status >= 400 and not any(name in a.message.lower() for name in NAMES)
    ]
    assert not unnamed, "\n".join(map(describe, unnamed[:10]))
    assert len(sent) >= 2000
    assert by_status.get(200, 0) >= 200, "the drawn requests must also reach the engine"


async def test_seeded_prompts_prefilled_in_chunks_keep_the_engine_alive(
    engine_server, http, setup
) -> None:
    """The CPU build rewound a seeded request's generator after a step that
    discarded its sample (a prompt prefilled in chunks) and died: fixed by
    ``compat.keep_cpu_seeded_requests_alive``; found by the test above."""
    client = skyrl_client(engine_server)
    params = {"max_tokens": 2, "temperature": 1.0, "seed": 4}
    prompts = [[7 + i] * (MAX_MODEL_LEN - 8) for i in range(6)]  # more than one step holds
    try:
        answers = await asyncio.gather(
            *(
                client.generate({"prompt_token_ids": [p], "sampling_params": params}, model=m)
                for p in prompts
                for m in (None, ADAPTER)
            )
        )
        assert all(len(a["response_ids"][0]) == 2 for a in answers)
        after = await client.generate({"prompt_token_ids": [[5, 6]], "sampling_params": params})
        assert len(after["response_ids"][0]) == 2, "the engine must still serve"
    finally:
        await client.teardown()
