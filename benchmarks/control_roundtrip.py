"""Idle control round trip: pause + resume of an adapter with nothing in flight.

Two HTTP calls and no engine work, so this is what a control call costs by
itself, client to server and back; a constant wait or timer on that path
shows here directly (issue 10 saw 88 ms on the GPU server).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.stats import Tail
from skyrl_lora.client import RemoteInferenceClient


async def run(url: str, model: Any, rounds: int = 3, repeats: int = 50) -> list[Tail]:
    tails: list[Tail] = []
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("idle-ctl", str(model.adapters["meow"]))
        await client.pause_generation(lora_name="idle-ctl")  # warm the connection
        await client.resume_generation(lora_name="idle-ctl")
        for _ in range(rounds):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                await client.pause_generation(lora_name="idle-ctl")
                await client.resume_generation(lora_name="idle-ctl")
                times.append((time.perf_counter() - started) * 1000)
            tails.append(Tail.of(times))
    return tails
