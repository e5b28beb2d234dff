"""Streamed load with per-token arrival times, for tokens/s and stall gaps.

The other tenants' load goes through vLLM's own streamed ``/v1/completions``
(``model=<tenant>``; those routes pass the same per-adapter gate), because
only a stream shows *when* each token arrived: a non-streamed sample reports
its tokens at the end, which hides a 0.3 s freeze inside an average. Each
chunk's arrival is recorded with the number of tokens it carried, so the
same record gives rates over any window and every inter-token gap.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import aiohttp

from benchmarks.common import completion_lengths
from benchmarks.stats import Gap


@dataclass
class StreamLog:
    """Chunk arrivals of every completion of one tenant: (monotonic time, tokens)."""

    tenant: str
    streams: list[list[tuple[float, int]]] = field(default_factory=list)

    def tokens_in(self, start: float, end: float) -> int:
        return sum(n for s in self.streams for t, n in s if start <= t < end)

    def gaps(self, start: float, end: float) -> list[Gap]:
        """Gaps between consecutive chunks of one completion, both inside [start, end)."""
        out: list[Gap] = []
        for s in self.streams:
            inside = [t for t, _ in s if start <= t < end]
            out.extend(Gap(a, b) for a, b in itertools.pairwise(inside))
        return out


#: A streamed completion lasts as long as the engine takes, not a set time:
#: aiohttp's default (300 s in all) ended the pause-latency probe's 400-token
#: stream on a slow 2-core machine, where every pause of the 64-request tenant
#: re-prefills its requests and the probe waits seconds per pause. What would
#: mean a stuck server is a minute without a chunk.
STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)


async def _one_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    arrivals: list[tuple[float, int]],
) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"streamed completion failed: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.monotonic()
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                ids = choice.get("token_ids")
                arrivals.append((now, len(ids) if ids is not None else 1))


async def keep_streaming(
    url: str,
    tenant: str,
    prompt: list[int],
    log: StreamLog,
    stop: asyncio.Event,
    streams: int,
    max_tokens: int,
    api_key: str | None = None,
    length_spread: float = 0.0,
) -> None:
    """``streams`` back-to-back streamed greedy completions until ``stop``.

    Each completion's arrivals are one list, so a gap is always between two
    tokens of one sequence (the inter-token latency the tenant sees), never
    the next request's queueing and prefill.
    """
    body = {
        "model": tenant,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=STREAM_TIMEOUT
    ) as session:

        async def loop(stream: int) -> None:
            lengths = completion_lengths(max_tokens, length_spread, seed=f"{tenant}:{stream}")
            for length in lengths:
                if stop.is_set():
                    return
                arrivals: list[tuple[float, int]] = []
                log.streams.append(arrivals)
                await _one_stream(session, url, {**body, "max_tokens": length}, arrivals)

        await asyncio.gather(*(loop(i) for i in range(streams)))
