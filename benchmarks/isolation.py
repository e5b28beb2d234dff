"""Isolation: other tenants' tokens/s while one tenant swaps weights.

Three phases in one run, same load: no swap (baseline), per-adapter pause +
reload + resume of tenant A every ``period`` seconds, and the same swap done
with vLLM's global keep-mode pause. Each swap holds the pause for ``hold``
seconds, standing in for the trainer's weight transfer. Reported: B and C's
tokens/s in each swap phase over the baseline.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import TokenMeter, keep_sampling
from skyrl_lora.client import RemoteInferenceClient

TENANTS = {"iso-a": "meow", "iso-b": "woof", "iso-c": "moo"}
OTHERS = ("iso-b", "iso-c")


@dataclass
class Phase:
    name: str
    start: float
    end: float
    others_rate: float
    swaps: int
    windows: list[tuple[float, float]]


async def _swapper(
    client: RemoteInferenceClient,
    model: Any,
    stop: asyncio.Event,
    mode: str,
    period: float,
    hold: float,
    windows: list[tuple[float, float]],
) -> int:
    swaps = 0
    weights = ["woof", "meow"]
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period)
            break
        except asyncio.TimeoutError:
            pass
        lora = "iso-a" if mode == "per_adapter" else None
        paused_at = time.monotonic()
        await client.pause_generation(lora_name=lora)
        await asyncio.sleep(hold)
        await client.reload_lora_adapter("iso-a", str(model.adapters[weights[swaps % 2]]))
        await client.resume_generation(lora_name=lora)
        windows.append((paused_at, time.monotonic()))
        swaps += 1
    return swaps


async def run(
    url: str,
    model: Any,
    prompt: list[int],
    seconds: float = 8.0,
    period: float = 1.0,
    hold: float = 0.3,
    streams: int = 8,
) -> tuple[list[Phase], TokenMeter]:
    meter = TokenMeter()
    phases: list[Phase] = []
    async with RemoteInferenceClient(url) as client:
        for tenant, weights in TENANTS.items():
            await client.load_lora_adapter(tenant, str(model.adapters[weights]))
        for mode in ("no_swap", "per_adapter", "global"):
            stop = asyncio.Event()
            load = [
                asyncio.create_task(keep_sampling(client, t, prompt, meter, stop, streams, 32))
                for t in TENANTS
            ]
            await asyncio.sleep(1.0)  # warm up to steady state
            start = time.monotonic()
            windows: list[tuple[float, float]] = []
            swapper = (
                asyncio.create_task(_swapper(client, model, stop, mode, period, hold, windows))
                if mode != "no_swap"
                else None
            )
            await asyncio.sleep(seconds)
            end = time.monotonic()
            stop.set()
            swaps = await swapper if swapper else 0
            await asyncio.gather(*load)
            rate = meter.rate(OTHERS, start, end)
            phases.append(Phase(mode, start, end, rate, swaps, windows))
    return phases, meter
