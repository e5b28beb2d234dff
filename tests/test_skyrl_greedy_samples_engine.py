"""Greedy ``num_samples > 1``: one generation served ``n`` times, on every surface.

vLLM refuses ``n > 1`` with greedy sampling; the server generates one
sequence and answers it ``n`` times (``server/http/sample.py``). Checked on
``/skyrl/v1/sample``, our client's ``sample_with_retry`` across pauses, and the
real Tinker SDK (which got a 500 for it before).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from skyrl_lora.client import RemoteInferenceClient
from tests.conftest import EngineServer
from tests.test_tinker_sdk_engine import pauses_mid_sample

pytestmark = pytest.mark.engine

LONG = 600
#: ``greedy-babble``'s weights under another name, for a reference that runs
#: beside the samples under test (``test_tinker_sdk_engine.TWIN`` says why).
TWIN = "greedy-babble-twin"


@pytest.fixture(scope="module")
async def admin(engine_server: EngineServer) -> AsyncIterator[RemoteInferenceClient]:
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        await c.load_lora_adapter("greedy-meow", str(engine_server.model.adapters["meow"]))
        await c.load_lora_adapter("greedy-babble", str(engine_server.model.adapters["babble"]))
        await c.load_lora_adapter(TWIN, str(engine_server.model.adapters["babble"]))
        yield c


async def one(admin: RemoteInferenceClient, prompt: list[int], lora: str | None, **params: Any):
    answer = await admin.sample(
        prompt, sampling_params={"temperature": 0.0, **params}, lora_name=lora
    )
    return answer.sequences[0]


@pytest.mark.parametrize("lora", [None, "greedy-meow"])
async def test_skyrl_sample_greedy_n_gives_n_copies(engine_server, admin, lora) -> None:
    prompt = engine_server.encode("once upon a time")
    ref = await one(admin, prompt, lora, max_tokens=20)
    answer = await admin.sample(
        prompt, 3, sampling_params={"temperature": 0.0, "max_tokens": 20}, lora_name=lora
    )
    assert len(answer.sequences) == 3
    for seq in answer.sequences:
        assert seq.tokens == ref.tokens and seq.stop_reason == ref.stop_reason
        assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


async def test_sample_with_retry_greedy_n_across_pauses(engine_server, admin) -> None:
    prompt = engine_server.encode("hello there how are you")
    params = {"temperature": 0.0, "max_tokens": LONG, "ignore_eos": True}
    uninterrupted = asyncio.ensure_future(
        one(admin, prompt, TWIN, max_tokens=LONG, ignore_eos=True)
    )
    task = asyncio.ensure_future(
        admin.sample_with_retry(prompt, 3, sampling_params=params, lora_name="greedy-babble")
    )
    aborted = await pauses_mid_sample(admin, "greedy-babble", times=2)
    answer = await asyncio.wait_for(task, 180)
    ref = await uninterrupted
    assert aborted >= 2, "each pause must have landed mid-sample"
    assert [s.tokens for s in answer.sequences] == [ref.tokens] * 3
    assert all(s.segments > 1 for s in answer.sequences), "each copy was resumed"


@pytest.mark.parametrize("lora", [None, "greedy-meow"])
async def test_tinker_sdk_greedy_num_samples(engine_server, admin, lora) -> None:
    tinker = pytest.importorskip("tinker")
    service = tinker.ServiceClient(
        base_url=engine_server.url, api_key=f"tml-{engine_server.admin_key}"
    )
    try:
        target = (
            {"base_model": "tiny-llama"} if lora is None else {"model_path": f"tinker://{lora}"}
        )
        client = await asyncio.to_thread(lambda: service.create_sampling_client(**target).result())
        prompt = engine_server.encode("the cat sat on the mat")
        ref = await one(admin, prompt, lora, max_tokens=20)
        params = tinker.types.SamplingParams(max_tokens=20, temperature=0.0)
        result = await client.sample(tinker.types.ModelInput.from_ints(prompt), 3, params)
        assert [s.tokens for s in result.sequences] == [ref.tokens] * 3
        for seq in result.sequences:
            assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert len({s.sequence_id for s in result.sequences}) == 3
    finally:
        service.close("success")
