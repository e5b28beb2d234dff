"""Shared fixtures: the embedded model and real CPU vLLM servers on Ray.

Servers run in Ray actors, exactly as ``skyrl-lora serve`` runs them. They
start lazily, so the pure unit tests never pay for them.
"""

from __future__ import annotations

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
def tokenizer(embedded_model: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model.model_dir)


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    """One local Ray instance for every engine test (4 logical CPUs: the
    single server and a two-replica group fit side by side)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_server(embedded_model: Any, local_ray: Any, tokenizer: Any) -> Iterator[EngineServer]:
    from skyrl_lora.server.actor import ActorOptions, start_server_actor
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    argv = embedded_server_argv(embedded_model)
    handle, url = start_server_actor(argv, ActorOptions(env=CPU_ENV))
    try:
        yield EngineServer(url, embedded_model, tokenizer)
    finally:
        local_ray.get(handle.shutdown.remote(), timeout=120)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session
