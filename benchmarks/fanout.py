"""Pause fan-out time against many lightweight servers (50 ms to answer each)."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

from aiohttp import web

from skyrl_lora.client import RemoteInferenceClient

DELAY_S = 0.05


async def _slow_pause(request: web.Request) -> web.Response:
    body = await request.json()
    await asyncio.sleep(DELAY_S)
    return web.json_response(
        {"lora_name": body.get("lora_name"), "paused": True, "was_paused": False, "aborted": 0}
    )


async def _server(stack: AsyncExitStack) -> str:
    app = web.Application()
    app.router.add_post("/skyrl/v1/pause", _slow_pause)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"http://127.0.0.1:{port}"


async def run(
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), repeats: int = 5
) -> dict[int, list[float]]:
    """Milliseconds of each pause, by number of servers."""
    result: dict[int, list[float]] = {}
    async with AsyncExitStack() as stack:
        urls = [await _server(stack) for _ in range(max(sizes))]
        for n in sizes:
            async with RemoteInferenceClient(urls[:n]) as client:
                await client.pause_generation(lora_name="warm")
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    await client.pause_generation(lora_name="a")
                    times.append((time.perf_counter() - started) * 1000)
                result[n] = times
    return result
