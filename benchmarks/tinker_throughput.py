"""Tinker SDK sampling throughput against ``/skyrl/v1/sample`` through our client.

Both clients send the same load to the same server: ``requests`` samples at
once (one LoRA adapter, ``max_tokens`` each, EOS off so every sample is the
same length), rounds alternating SDK, ours, SDK, ours... Each round's ratio
is the SDK's tokens/s over ours in the round beside it, so drift of the
machine between rounds does not enter a ratio; the figure is the median
with min and max. The SDK pays one more round trip per sample (``asample``,
then ``retrieve_future``) and the server's protobuf encoding; target >= 0.8x.

Run: ``python -m benchmarks.tinker_throughput`` (starts a server on the
embedded model), or ``--url`` for a running one (``--api-key`` its admin key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from benchmarks.common import current_commit
from benchmarks.stats import Spread
from skyrl_lora.client import RemoteInferenceClient

ADAPTER = "bench-tinker"
TARGET = 0.8


@dataclass(frozen=True)
class Load:
    requests: int = 32
    max_tokens: int = 64
    rounds: int = 5


async def _ours(client: RemoteInferenceClient, prompt: list[int], load: Load) -> float:
    params = {"max_tokens": load.max_tokens, "temperature": 1.0, "ignore_eos": True}
    started = time.perf_counter()
    answers = await asyncio.gather(
        *(
            client.sample(prompt, sampling_params=params, lora_name=ADAPTER)
            for _ in range(load.requests)
        )
    )
    elapsed = time.perf_counter() - started
    return sum(len(a.sequences[0].tokens) for a in answers) / elapsed


async def _sdk(sampler: Any, prompt: list[int], load: Load) -> float:
    import tinker

    params = tinker.types.SamplingParams(max_tokens=load.max_tokens, temperature=1.0, stop=[])
    model_input = tinker.types.ModelInput.from_ints(prompt)
    started = time.perf_counter()
    futures = [sampler.sample(model_input, 1, params) for _ in range(load.requests)]
    answers = [await f for f in futures]
    elapsed = time.perf_counter() - started
    return sum(len(a.sequences[0].tokens) for a in answers) / elapsed


async def measure(url: str, api_key: str | None, adapter_path: str, load: Load) -> dict[str, Any]:
    import tinker

    async with RemoteInferenceClient(url, api_key=api_key) as client:
        await client.load_lora_adapter(ADAPTER, adapter_path)
        prompt = [1, *range(100, 120)]
        service = tinker.ServiceClient(base_url=url, api_key=f"tml-{api_key or 'open'}")
        try:
            sampler = await asyncio.to_thread(
                lambda: service.create_sampling_client(model_path=f"tinker://{ADAPTER}").result()
            )
            await _sdk(sampler, prompt, Load(4, 8, 1))  # warm both paths up
            await _ours(client, prompt, Load(4, 8, 1))
            sdk: list[float] = []
            ours: list[float] = []
            for _ in range(load.rounds):
                sdk.append(await _sdk(sampler, prompt, load))
                ours.append(await _ours(client, prompt, load))
        finally:
            service.close("success")
    ratio = Spread.of(s / o for s, o in zip(sdk, ours))
    return {
        "ratio": ratio.to_json(),
        "sdk_tokens_per_s": sdk,
        "ours_tokens_per_s": ours,
        "load": load.__dict__,
        "target": TARGET,
    }


def _describe(result: dict[str, Any]) -> str:
    r = result["ratio"]
    sdk = Spread.of(result["sdk_tokens_per_s"]).median
    ours = Spread.of(result["ours_tokens_per_s"]).median
    load = result["load"]
    return (
        f"Tinker SDK / /skyrl/v1/sample tokens/s: {r['median']:.2f}x "
        f"(min {r['min']:.2f}, max {r['max']:.2f}, {r['rounds']} rounds; target >= {TARGET}x); "
        f"{sdk:.0f} vs {ours:.0f} tokens/s, {load['requests']} samples x "
        f"{load['max_tokens']} tokens at once"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start one on the embedded model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--adapter-path", default=None, help="adapter folder the server can read")
    parser.add_argument("--requests", type=int, default=Load.requests)
    parser.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    parser.add_argument("--rounds", type=int, default=Load.rounds)
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    args = parser.parse_args()
    load = Load(args.requests, args.max_tokens, args.rounds)
    with ExitStack() as stack:
        url, adapter_path = args.url, args.adapter_path
        if url is None:
            from skyrl_lora.server.cluster.local import embedded_server

            url, model = stack.enter_context(embedded_server())
            adapter_path = adapter_path or str(model.adapters["meow"])
        if adapter_path is None:
            parser.error("--adapter-path is needed with --url")
        result = asyncio.run(measure(url, args.api_key, adapter_path, load))
    result["commit"] = current_commit()
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(_describe(result))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
