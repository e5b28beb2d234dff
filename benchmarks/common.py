"""Shared benchmark plumbing: a real server on the embedded model, token meters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from skyrl_lora.client import RemoteInferenceClient


@contextmanager
def embedded_server(extra: Sequence[str] = ()) -> Iterator[tuple[str, Any]]:
    """A skyrl-lora server in a Ray actor on the embedded model; yields (url, model)."""
    import ray

    from skyrl_lora.server.actor import ActorOptions, start_server_actor
    from skyrl_lora.server.embedded import ensure_embedded_model
    from skyrl_lora.server.presets import CPU_ENV, embedded_server_argv

    model = ensure_embedded_model()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    handle, url = start_server_actor(
        embedded_server_argv(model, extra=extra), ActorOptions(env=CPU_ENV)
    )
    try:
        yield url, model
    finally:
        ray.get(handle.shutdown.remote(), timeout=120)


@dataclass
class TokenMeter:
    """Tokens per tenant over time, for rates and timelines.

    A sample's tokens are spread evenly over its lifetime rather than counted
    when it completes: samples finish in waves, and counting completions
    would make the rate of a few-second window jump by whole waves.
    """

    spans: list[tuple[float, float, str, int]] = field(default_factory=list)

    def add(self, tenant: str, tokens: int, started: float) -> None:
        self.spans.append((started, time.monotonic(), tenant, tokens))

    def tokens_in(self, tenants: Sequence[str], start: float, end: float) -> float:
        total = 0.0
        for s, e, who, n in self.spans:
            if who in tenants and e > start and s < end:
                total += n * (min(e, end) - max(s, start)) / max(e - s, 1e-9)
        return total

    def rate(self, tenants: Sequence[str], start: float, end: float) -> float:
        return self.tokens_in(tenants, start, end) / (end - start)


async def keep_sampling(
    client: RemoteInferenceClient,
    tenant: str,
    prompt: list[int],
    meter: TokenMeter,
    stop: asyncio.Event,
    streams: int,
    max_tokens: int,
) -> None:
    """``streams`` concurrent loops of short greedy samples until ``stop``."""
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    async def loop() -> None:
        while not stop.is_set():
            started = time.monotonic()
            out = await client.sample_with_retry(prompt, sampling_params=params, lora_name=tenant)
            meter.add(tenant, len(out.sequences[0].tokens), started)

    await asyncio.gather(*(loop() for _ in range(streams)))


async def wait_engine_requests(
    client: RemoteInferenceClient, tenant: str, count: int, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listing = await client.list_adapters()
        (state,) = [a for a in listing.adapters if a.lora_name == tenant]
        if state.engine_requests >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tenant}: {state.engine_requests} of {count} requests running")
        await asyncio.sleep(0.01)
