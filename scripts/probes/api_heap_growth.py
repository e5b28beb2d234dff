"""What the API server process keeps alive under RL-shaped load.

On the H100 (main 27fbe3a, 2026-11-24) the API process's full collections
grew from 0.2 s to 1.1 s over a 4.5-minute RL run even with the start-up heap
frozen: something serving creates stays alive. This probe runs ``serve`` in
this process on the embedded model, drives it like the RL example does
(tenants sampling with logprobs while each pushes a new version every
``--push-every-s``), and every ``--report-every-s`` collects and prints the
object types whose count grew most since the first report.

``python scripts/probes/api_heap_growth.py [--seconds 90]``; ``--gpu`` serves the
random 0.8B Llama on CUDA vLLM instead of the embedded model.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import shutil
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def type_counts() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(
        f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()
    )


def print_holders(type_names: str, samples: int = 3, depth: int = 7) -> None:
    """Who keeps a few objects of each type (comma-separated names) alive: a
    chain of first referrers, skipping frames and this function's own lists."""
    for type_name in type_names.split(","):
        found = [o for o in gc.get_objects() if type(o).__qualname__ == type_name]
        mine = {id(found)}
        for index in range(min(samples, len(found))):
            chain, current = [], found[index]
            seen = {id(current)}
            for _ in range(depth):
                referrers = gc.get_referrers(current)
                mine.add(id(referrers))
                holders = [
                    r
                    for r in referrers
                    if id(r) not in mine
                    and id(r) not in seen
                    and not isinstance(r, types.FrameType)
                    and type(r).__name__ != "list_iterator"
                ]
                mine.add(id(holders))
                if not holders:
                    break
                current = holders[0]
                seen.add(id(current))
                described = f"{type(current).__module__}.{type(current).__qualname__}"
                if isinstance(current, dict):
                    described += f"(keys {[str(k)[:40] for k in list(current)[:5]]})"
                chain.append(described)
            print(f"    {type_name} ({len(found)}) <- " + " <- ".join(chain), flush=True)


def vllm_requests(engine_client: object) -> str:
    """The sizes of vLLM's per-request tables in this (the API) process."""
    processor = getattr(engine_client, "output_processor", None)
    if processor is None:
        return ""
    return (
        f"; vLLM request_states {len(processor.request_states)}, "
        f"parent_requests {len(getattr(processor, 'parent_requests', {}))}"
    )


async def drive(
    url: str, adapters: dict[str, Path], args: argparse.Namespace, engine_client: object = None
) -> None:
    from skyrl_lora.client import RemoteInferenceClient

    tenants = [f"t{i}" for i in range(args.tenants)]
    folders = list(adapters.values())
    stop = asyncio.Event()
    async with RemoteInferenceClient(url) as client:
        for i, tenant in enumerate(tenants):
            await client.push_lora_adapter(tenant, folders[i % len(folders)])

        async def sampling(tenant: str) -> None:
            params = {"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
            while not stop.is_set():
                await client.sample_with_retry(
                    [1, 2, 3, 4], num_samples=4, sampling_params=params, lora_name=tenant
                )

        async def pushing(tenant: str, offset: int) -> None:
            n = offset
            while not stop.is_set():
                await asyncio.sleep(args.push_every_s)
                n += 1
                await client.push_lora_adapter(tenant, folders[n % len(folders)])

        tasks = [asyncio.create_task(sampling(t)) for t in tenants for _ in range(args.streams)]
        tasks += [asyncio.create_task(pushing(t, i)) for i, t in enumerate(tenants)]
        first = type_counts()
        full = FullCollections()
        started = time.monotonic()
        while time.monotonic() - started < args.seconds:
            await asyncio.sleep(args.report_every_s)
            now = type_counts()
            grown = (now - first).most_common(args.top)
            print(
                f"--- {time.monotonic() - started:5.0f} s: {sum(now.values())} objects "
                f"(+{sum(now.values()) - sum(first.values())}), frozen {gc.get_freeze_count()}; "
                f"{full.drain()}{vllm_requests(engine_client)}",
                flush=True,
            )
            for name, count in grown:
                print(f"  +{count:7d} {name}", flush=True)
            if args.holders:
                print_holders(args.holders)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


class FullCollections:
    """Times the process's full (generation 2) collections, as the loop monitor does."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._started = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._started) * 1000)

    def drain(self) -> str:
        pauses, self.pauses_ms = self.pauses_ms, []
        if not pauses:
            return "no full collections"
        return f"{len(pauses)} full collections, max {max(pauses):.0f} ms, sum {sum(pauses):.0f} ms"


def server_argv(args: argparse.Namespace, work: Path) -> tuple[list[str], dict[str, Path]]:
    extra = ["--max-loras", str(args.tenants * 2), "--adapter-snapshot-dir", str(work)]
    if args.gpu:
        from skyrl_lora.server.embedded.random_model import build_random_model
        from skyrl_lora.server.presets import random_model_server_argv

        model = build_random_model(work / "model", rank=16, size="0.8b")
        argv = random_model_server_argv(
            model.model_dir, max_lora_rank=16, max_loras=args.tenants * 2,
            gpu_memory_utilization=0.5, extra=extra[2:],
        )  # fmt: skip
        return argv, dict(model.adapters)
    from skyrl_lora.server.embedded import ensure_embedded_model
    from skyrl_lora.server.presets import embedded_server_argv

    embedded = ensure_embedded_model()
    return embedded_server_argv(embedded, extra=extra), dict(embedded.adapters)


async def main(args: argparse.Namespace) -> None:
    from skyrl_lora.server.http.app import RunningServer, parse_server_args, serve

    work = Path(tempfile.mkdtemp())
    stop = asyncio.Event()
    argv, adapters = server_argv(args, work)
    server_args = parse_server_args(argv)

    async def on_ready(running: RunningServer) -> None:
        async def run() -> None:
            try:
                await drive(running.url, adapters, args, running.engine.engine_client)
            finally:
                stop.set()

        asyncio.get_running_loop().create_task(run())

    try:
        await serve(server_args, on_ready=on_ready, stop=stop)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--report-every-s", type=float, default=30)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--push-every-s", type=float, default=1.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gpu", action="store_true", help="CUDA vLLM, random 0.8B Llama")
    parser.add_argument("--holders", help="also print who holds objects of this type name")
    asyncio.run(main(parser.parse_args()))
