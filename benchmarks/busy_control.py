"""Control calls and first requests while a long sample runs, from a fresh client process.

A trainer's pause must reach the server while that tenant's samples are
generating. A long non-streamed completion (900 tokens) runs; 0.15 s into
it, a fresh HTTP session sends its first request (``server_info``: a new
connection), then a control call on the same session (pause + resume of an
idle adapter). Each round uses a new session; the rounds run in a client
process started fresh for the benchmark, alternating between our client
(``RemoteInferenceClient``), plain aiohttp, and plain aiohttp addressing the
server as ``localhost`` (a name to resolve, IPv6 first), so all see the same
server state. ``python -m benchmarks.busy_control`` starts a server of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import aiohttp

from benchmarks.stats import Tail
from skyrl_lora.client import RemoteInferenceClient

IDLE_ADAPTER = "busy-ctl"
LONG_TOKENS = 900
START_AFTER_S = 0.15
KINDS = ("skyrl client", "plain aiohttp", "aiohttp, localhost")


async def _long_sample(session: aiohttp.ClientSession, url: str, model: str) -> float:
    body = {
        "model": model,
        "prompt": [1, 2, 3],
        "max_tokens": LONG_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        await reply.read()
    return time.perf_counter() - started


async def _ours(url: str) -> tuple[float, float]:
    started = time.perf_counter()
    async with RemoteInferenceClient(url) as client:
        await client.server_info()
        first = time.perf_counter() - started
        started = time.perf_counter()
        await client.pause_generation(lora_name=IDLE_ADAPTER)
        await client.resume_generation(lora_name=IDLE_ADAPTER)
        return first, time.perf_counter() - started


async def _plain(url: str) -> tuple[float, float]:
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/skyrl/v1/server_info") as reply:
            await reply.read()
        first = time.perf_counter() - started
        started = time.perf_counter()
        for route in ("pause", "resume"):
            async with session.post(
                f"{url}/skyrl/v1/{route}", json={"lora_name": IDLE_ADAPTER}
            ) as reply:
                reply.raise_for_status()
                await reply.read()
        return first, time.perf_counter() - started


async def _child(url: str, model: str, rounds: int) -> dict[str, Any]:
    """The fresh client process: ``rounds`` rounds of each kind, alternating."""
    by_name = url.replace("127.0.0.1", "localhost")

    async def _plain_by_name(_: str) -> tuple[float, float]:
        return await _plain(by_name)

    calls = {"skyrl client": _ours, "plain aiohttp": _plain, "aiohttp, localhost": _plain_by_name}
    out: dict[str, dict[str, list[float]]] = {k: {"first": [], "control": []} for k in KINDS}
    sample_s: list[float] = []
    async with aiohttp.ClientSession() as sampler:
        await _long_sample(sampler, url, model)  # the engine and connection warm
        for i in range(rounds * len(KINDS)):
            kind = KINDS[i % len(KINDS)]
            long = asyncio.create_task(_long_sample(sampler, url, model))
            await asyncio.sleep(START_AFTER_S)
            first, control = await calls[kind](url)
            out[kind]["first"].append(first * 1000)
            out[kind]["control"].append(control * 1000)
            sample_s.append(await long)
    return {"calls_ms": out, "long_sample_s": sample_s}


def measure(url: str, model: str, rounds: int = 50) -> dict[str, Any]:
    """Run the rounds in a fresh process; tails per kind and call."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.busy_control", "--child", url, model, str(rounds)],
        capture_output=True,
        text=True,
        check=True,
    )
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    tails = {
        kind: {call: Tail.of(ms).to_json() for call, ms in calls.items()}
        for kind, calls in raw["calls_ms"].items()
    }
    return {
        "rounds": rounds,
        "tails_ms": tails,
        "long_sample_s": Tail.of(raw["long_sample_s"]).to_json(),
        "raw": raw,
    }


def _print(result: dict[str, Any]) -> None:
    print(
        f"{'client':18} {'call':8} {'p50':>8} {'p99':>8} {'max':>8}"
        f"  (ms, {result['rounds']} rounds)"
    )
    for kind, calls in result["tails_ms"].items():
        for call, tail in calls.items():
            print(f"{kind:18} {call:8} {tail['p50']:8.1f} {tail['p99']:8.1f} {tail['max']:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=3, metavar=("URL", "MODEL", "ROUNDS"))
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        url, model, rounds = args.child
        print(json.dumps(asyncio.run(_child(url, model, int(rounds)))))
        return
    from skyrl_lora.server.cluster.local import embedded_server
    from skyrl_lora.server.presets import EMBEDDED_MODEL_NAME

    with embedded_server() as (url, model):
        asyncio.run(_load_idle_adapter(url, str(model.adapters["meow"])))
        result = measure(url, EMBEDDED_MODEL_NAME, args.rounds)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


async def _load_idle_adapter(url: str, path: str) -> None:
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter(IDLE_ADAPTER, path)


if __name__ == "__main__":
    main()
