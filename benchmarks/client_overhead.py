"""Client overhead: requests/s at 256 concurrent calls against a no-op server.

RemoteInferenceClient.sample next to a plain aiohttp loop posting the same
JSON and the OpenAI SDK's async client, all in this process against one
no-op server in another process.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import aiohttp

from benchmarks.stats import Spread
from skyrl_lora.client import RemoteInferenceClient

PROMPT = list(range(1, 9))
PARAMS = {"max_tokens": 16, "temperature": 1.0}


@contextmanager
def noop_server() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.noop_server"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


async def _drive(
    call: Callable[[], Awaitable[object]], total: int, concurrency: int
) -> tuple[float, float]:
    """(requests/s, microseconds of this process's CPU per request).

    Requests/s also depends on the no-op server and on whatever else the
    machine runs; CPU time per request depends only on the client itself.
    """
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu_us = (time.process_time() - cpu) / total * 1e6
    return total / (time.perf_counter() - started), cpu_us


async def _ours(url: str, total: int, concurrency: int) -> tuple[float, float]:
    async with RemoteInferenceClient(url) as client:
        await client.sample(PROMPT, sampling_params=PARAMS, lora_name="a")
        return await _drive(
            lambda: client.sample(PROMPT, sampling_params=PARAMS, lora_name="a"), total, concurrency
        )


async def _raw(url: str, total: int, concurrency: int) -> tuple[float, float]:
    body = {"prompt_token_ids": PROMPT, "lora_name": "a", "sampling_params": PARAMS}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def call() -> object:
            async with session.post(url + "/skyrl/v1/sample", json=body) as resp:
                return await resp.json()

        await call()
        return await _drive(call, total, concurrency)


async def _openai(url: str, total: int, concurrency: int) -> tuple[float, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:

        async def call() -> object:
            return await client.completions.create(model="a", prompt=PROMPT, max_tokens=16)

        await call()
        return await _drive(call, total, concurrency)
    finally:
        await client.close()


async def run(
    total: int = 6000, concurrency: int = 256, rounds: int = 5, sdk_total: int = 1000
) -> dict[str, list[float]]:
    """Requests/s (and CPU us per request) of each client in every round, back to back.

    Ratios are taken within a round (see :func:`ratios`), never best-of-N
    across rounds: a best-of picks each side's luckiest moment. The SDK is
    ~10x slower, so it gets fewer requests per round.
    """
    out: dict[str, list[float]] = {}
    with noop_server() as url:
        for _ in range(rounds):
            for name, fn, n in (
                ("raw aiohttp", _raw, total),
                ("skyrl client", _ours, total),
                ("openai sdk", _openai, sdk_total),
            ):
                rps, cpu_us = await fn(url, n, concurrency)
                out.setdefault(name, []).append(rps)
                out.setdefault(f"{name} cpu_us", []).append(cpu_us)
    return out


def ratios(rps: dict[str, list[float]]) -> dict[str, Spread]:
    """Per-round ratios: requests/s against raw aiohttp and the SDK, CPU per request."""
    ours = rps["skyrl client"]
    return {
        "vs_raw": Spread.of(o / r for o, r in zip(ours, rps["raw aiohttp"])),
        "vs_sdk": Spread.of(o / s for o, s in zip(ours, rps["openai sdk"])),
        "cpu_vs_raw": Spread.of(
            o / r for o, r in zip(rps["skyrl client cpu_us"], rps["raw aiohttp cpu_us"])
        ),
    }
