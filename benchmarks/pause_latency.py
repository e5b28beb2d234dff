"""Pause latency: pause call to every in-flight request of the adapter returned.

64 ``sample_with_retry`` calls keep tenant A busy (they resubmit after each
resume); each round waits until vLLM runs all 64, then times the pause call,
which returns only once every aborted request has come back. The design this
replaces slept a fixed 5 s before aborting.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import median, percentile, wait_engine_requests
from skyrl_lora.client import RemoteInferenceClient


@dataclass
class PauseLatency:
    rounds: int
    in_flight: int
    client_ms: list[float]
    server_ms: list[float]
    aborted: list[int]

    @property
    def summary(self) -> dict[str, float]:
        return {
            "median_ms": median(self.client_ms),
            "p99_ms": percentile(self.client_ms, 99),
            "server_median_ms": median(self.server_ms),
            "server_p99_ms": percentile(self.server_ms, 99),
            "aborted_min": min(self.aborted),
            "aborted_median": median(self.aborted),
        }


async def run(
    url: str, model: Any, prompt: list[int], rounds: int = 50, in_flight: int = 64
) -> PauseLatency:
    client_ms: list[float] = []
    server_ms: list[float] = []
    aborted: list[int] = []
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("lat-a", str(model.adapters["meow"]))
        params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        stop = asyncio.Event()

        async def stream() -> None:  # one sample after another, so 64 stay in flight
            while not stop.is_set():
                await client.sample_with_retry(prompt, sampling_params=params, lora_name="lat-a")

        load = [asyncio.create_task(stream()) for _ in range(in_flight)]
        for _ in range(rounds):
            await wait_engine_requests(client, "lat-a", in_flight)
            started = time.perf_counter()
            (ack,) = await client.pause_generation(lora_name="lat-a")
            client_ms.append((time.perf_counter() - started) * 1000)
            server_ms.append(ack.drain_seconds * 1000)
            aborted.append(ack.aborted)  # a stream between two samples may miss one pause
            await client.resume_generation(lora_name="lat-a")
        stop.set()
        await asyncio.gather(*load)
    return PauseLatency(rounds, in_flight, client_ms, server_ms, aborted)
