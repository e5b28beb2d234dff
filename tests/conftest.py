"""Shared fixtures: the embedded model and one real CPU vLLM server per session.

The server runs in a Ray actor, exactly as ``skyrl-lora serve`` runs it. It is
started lazily, so the pure unit tests never pay for it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest


@dataclass(frozen=True)
class EngineServer:
    url: str
    model: Any  # skyrl_lora.server.embedded.EmbeddedModel
    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def word_id(self, word: str) -> int:
        (token,) = self.encode(word)
        return token


@pytest.fixture(scope="session")
def embedded_model() -> Any:
    from skyrl_lora.server.embedded import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="session")
def engine_server(embedded_model: Any) -> Iterator[EngineServer]:
    ray = pytest.importorskip("ray")
    from transformers import AutoTokenizer

    from skyrl_lora.server.actor import ActorOptions, start_server_actor
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        ignore_reinit_error=True,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
    )
    handle, url = start_server_actor(
        embedded_server_argv(embedded_model), ActorOptions(env=CPU_ENV)
    )
    try:
        yield EngineServer(
            url, embedded_model, AutoTokenizer.from_pretrained(embedded_model.model_dir)
        )
    finally:
        ray.get(handle.shutdown.remote(), timeout=120)
        ray.shutdown()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session
