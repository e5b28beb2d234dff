"""Structured outputs through the OpenAI SDK on the real CPU engine, the logits guard in place.

A structured output's grammar sets every token it forbids to -inf before
vLLM's sampler. The logits guard (:mod:`skyrl_lora.server.logits_guard`)
once took such a row for a broken one, zeroed it, and the engine drew a
token the grammar refused: vLLM ended the request with an internal error
and the client got a 500. The embedded model's vocabulary is its words
(xgrammar reads it raw, ``▁`` and all), so the grammars here are spelled
in its tokens, and none of their words is a prefix of another token.
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from tests.conftest import EngineServer

pytestmark = pytest.mark.engine

WORD = "\u2581"  # the tokenizer's word mark
EOS = "</s>"


def _client(server: EngineServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=server.admin_key or "none", max_retries=0
    )


async def _complete(server: EngineServer, **structured: Any) -> Any:
    async with _client(server) as client:
        return await client.completions.create(
            model="tiny-llama",
            prompt="hello there",
            max_tokens=8,
            temperature=0.0,
            logprobs=1,
            extra_body={"structured_outputs": structured, "return_token_ids": True},
        )


def _tokens_of(server: EngineServer, choice: Any) -> list[str]:
    return [server.tokenizer.convert_ids_to_tokens(t) for t in choice.token_ids]


async def test_a_choice_is_one_of_its_words_with_finite_logprobs(engine_server) -> None:
    out = await _complete(engine_server, choice=[f"{WORD}quack", f"{WORD}oink"])
    (choice,) = out.choices
    assert _tokens_of(engine_server, choice) in ([f"{WORD}quack", EOS], [f"{WORD}oink", EOS])
    assert choice.text.strip() in ("quack", "oink") and choice.finish_reason == "stop"
    assert all(math.isfinite(lp) for lp in choice.logprobs.token_logprobs)


async def test_a_regex_holds_for_every_token(engine_server) -> None:
    out = await _complete(engine_server, regex=f"({WORD}moo|{WORD}baa){{3}}")
    (choice,) = out.choices
    tokens = _tokens_of(engine_server, choice)
    assert len(tokens) == 4 and set(tokens[:3]) <= {f"{WORD}moo", f"{WORD}baa"}
    assert tokens[3] == EOS and choice.finish_reason == "stop"  # the grammar's end
    assert all(math.isfinite(lp) for lp in choice.logprobs.token_logprobs)
