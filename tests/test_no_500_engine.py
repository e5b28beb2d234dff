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
so ``TOTAL`` requests take well under a minute on the 2-core CI machine (a
``soak`` test: ``.ci/run`` sends ``SKYRL_TEST_SOAK_SCALE`` of them).
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

from tests.conftest import EngineServer, soak_size
from tests.test_skyrl_client_engine import skyrl_client

pytestmark = pytest.mark.engine

tinker = pytest.importorskip("tinker")
tinker_compat = pytest.importorskip("tinker._compat")

#: Requests sent in all; at most ``CONCURRENCY`` at once.
TOTAL = soak_size(2400, least=240)
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
# Each field has values a server must serve and values it must refuse; a
# third of the requests ("wild") draw every field from both, the rest only
# from the first, so results and refusals both come in the thousands.
token = st.integers(4, VOCAB - 1)
any_token = st.integers(-3, VOCAB + 10)
long_prompt = st.sampled_from(
    [MAX_MODEL_LEN - 2, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 5]
)
FIELDS: dict[str, tuple[Any, Any]] = {
    "prompt": (
        st.lists(token, min_size=1, max_size=8),
        st.lists(any_token, max_size=8) | long_prompt.map(lambda n: [7] * n),
    ),
    "max_tokens": (st.integers(1, 4), st.integers(-2, 0)),
    "temperature": (
        st.floats(0.0, 2.0) | st.sampled_from([0.0, 1e-6]),
        st.floats(-1.0, 3.0) | st.sampled_from([math.inf, math.nan]),
    ),
    "top_p": (st.floats(0.05, 1.0), st.floats(-0.5, 1.5) | st.sampled_from([0.0, math.nan])),
    "top_k": (st.just(-1) | st.integers(1, VOCAB), st.integers(-3, 300)),
    "seed": (st.none() | st.integers(0, 2**32), st.integers(-5, 0) | st.just(2**64 + 1)),
    "stop": (
        st.none() | st.just([]) | st.text(max_size=3) | st.lists(token, max_size=2),
        st.lists(st.text(max_size=3), max_size=3) | st.lists(any_token, max_size=3),
    ),
    "stop_token_ids": (st.none() | st.lists(token, max_size=2), st.lists(any_token, max_size=3)),
    "num_samples": (st.integers(1, 4), st.integers(-1, 0) | st.just(300)),
    "n": (st.just(1), st.integers(0, 3)),
    "logprobs": (st.none() | st.integers(0, 1), st.integers(-1, 3)),
    "prompt_logprobs": (st.none() | st.integers(0, 2), st.integers(-1, 3)),
    "topk_prompt_logprobs": (st.integers(0, 3), st.integers(-1, 5)),
    "topk_sample_logprobs": (st.just(0), st.just(2)),
    "prompt_logprobs_last_n": (st.none(), st.integers(-1, 9)),
    "tinker_model": (
        st.sampled_from([{"base_model": "tiny-llama"}, {"model_path": f"tinker://{ADAPTER}"}]),
        st.sampled_from(
            [
                {"base_model": "not-served"},
                {"model_path": "tinker://no-such-adapter"},
                {"model_path": f"tinker://{ADAPTER}/sampler_weights/999"},
                {"model_path": f"tinker://{ADAPTER}/sampler_weights/x"},
                {"model_path": "s3://elsewhere"},
                {},
            ]
        ),
    ),
    "skyrl_model": (st.sampled_from(["tiny-llama", ADAPTER]), st.sampled_from(["nope", ""])),
    # vLLM fields SkyRL's generator may send; the second values are not served.
    "min_tokens": (st.integers(0, 1), st.integers(2, 3)),
    "min_p": (st.just(0.0), st.sampled_from([0.1, -1.0])),
    "repetition_penalty": (st.just(1.0), st.just(1.1)),
    "best_of": (st.just(1), st.just(2)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
}
OPTIONAL_VLLM = (
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "min_p",
    "ignore_eos",
    "prompt_logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "repetition_penalty",
    "best_of",
    "n",
)


class Drawer:
    """Draws one request's fields: from the served values, or from both kinds when wild."""

    def __init__(self, draw: Any) -> None:
        self.draw = draw
        self.wild = draw(st.integers(0, 2)) == 0

    def __call__(self, name: str) -> Any:
        served, refused = FIELDS[name]
        return self.draw(served | refused if self.wild else served)


@st.composite
def tinker_request(draw: Any) -> dict[str, Any]:
    field = Drawer(draw)
    params = tinker.types.SamplingParams(
        max_tokens=field("max_tokens"),
        temperature=field("temperature"),
        top_p=field("top_p"),
        top_k=field("top_k"),
        seed=field("seed"),
        stop=field("stop"),
    )
    request = tinker.types.SampleRequest(
        num_samples=field("num_samples"),
        prompt=tinker.types.ModelInput.from_ints(field("prompt")),
        sampling_params=params,
        prompt_logprobs=draw(st.none() | st.booleans()),
        topk_prompt_logprobs=field("topk_prompt_logprobs"),
        topk_sample_logprobs=field("topk_sample_logprobs"),
        prompt_logprobs_last_n=field("prompt_logprobs_last_n"),
        **field("tinker_model"),
    )
    return tinker_compat.model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


@st.composite
def skyrl_generate(draw: Any) -> dict[str, Any]:
    field = Drawer(draw)
    params = {name: field(name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
    params["logprobs"] = field("logprobs")
    for name in draw(st.lists(st.sampled_from(OPTIONAL_VLLM), max_size=4, unique=True)):
        params[name] = field(name)
    return {
        "input_batch": {"prompt_token_ids": [field("prompt")], "sampling_params": params},
        "model": field("skyrl_model"),
    }


@st.composite
def skyrl_sample(draw: Any) -> dict[str, Any]:
    field = Drawer(draw)
    body: dict[str, Any] = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": field("prompt")}]},
        "num_samples": field("num_samples"),
        "sampling_params": {
            "max_tokens": field("max_tokens"),
            "temperature": field("temperature"),
            "top_p": field("top_p"),
            "top_k": field("top_k"),
            "seed": field("seed"),
            "stop_tokens": field("stop_token_ids"),
        },
        "include_prompt_logprobs": draw(st.booleans()),
        "topk_prompt_logprobs": field("topk_prompt_logprobs"),
        "model": field("skyrl_model"),
    }
    return {"json": body}


requests_drawn = st.one_of(
    st.tuples(st.just("tinker"), tinker_request()),
    st.tuples(st.just("skyrl-generate"), skyrl_generate()),
    st.tuples(st.just("skyrl-sample"), skyrl_sample()),
)

#: Requests that once got a 500, kept as they were drawn.
REGRESSIONS: list[tuple[str, dict[str, Any]]] = [
    # A seed beyond 64 bits: vLLM passed it on and answered an empty 500.
    (
        "skyrl-sample",
        {
            "json": {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [84, 142]}]},
                "num_samples": 1,
                "sampling_params": {"max_tokens": 1, "temperature": 1e-06, "seed": 2**64 + 1},
                "include_prompt_logprobs": True,
                "topk_prompt_logprobs": 3,
                "model": ADAPTER,
            }
        },
    ),
    # vLLM's own temperature limit (2) raised past the sampler's ValueError
    # check: the Tinker SDK got "internal server error".
    (
        "tinker",
        {
            "num_samples": 1,
            "prompt": {"chunks": [{"tokens": [5, 6], "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 2, "temperature": 2.4, "top_k": -1, "top_p": 1.0},
            "base_model": "tiny-llama",
            "type": "sample",
        },
    ),
]


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
            if "error" in state:  # a failed future: Tinker answers it with 200 and a category
                status = 500 if state.get("category") == "server" else 400
                return Answer("tinker", body, status, str(state["error"]))
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


@pytest.mark.soak
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
    assert len(sent) >= TOTAL * 5 // 6
    assert by_status.get(200, 0) >= TOTAL * 5 // 12, "most drawn requests must be served"
    assert sum(n for status, n in by_status.items() if status >= 400) >= TOTAL // 8


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
