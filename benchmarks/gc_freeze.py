"""The API process's garbage collector under sampling load, frozen start-up heap or not.

Importing torch, transformers and vLLM leaves the API server process with
hundreds of thousands of objects the collector tracks; each full collection
walks them all while the event loop that answers every tenant waits.
vLLM's own server freezes them once it has started; ``skyrl-lora serve`` does
the same unless ``--no-gc-freeze``. Two servers on the embedded model, one
each way, take the same load in alternating rounds (A B B A ...): ``streams``
sample loops with logprobs on one adapter, and a prober that asks
``server_info`` every 20 ms and times the answer. Per round: the probe's
p50 / p99 / max, the share of the round's wall time the API process spent
collecting (and its full collections: count and mean), and tokens/s; the
figures are medians over each server's rounds with their spread.

``python -m benchmarks.gc_freeze [--rounds 6] [--round-s 8] [--json PATH]`` on the
embedded model; ``--gpu`` runs both servers on one GPU on the random 0.8B
Llama (no Ray), where sampling runs fast enough to reach full collections.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import current_commit
from benchmarks.stats import Spread, Tail
from skyrl_lora.client import RemoteInferenceClient

ADAPTER = "bench-gc"
PROBE_EVERY_S = 0.02
MODES = ("frozen", "not frozen")
NO_FREEZE: dict[str, tuple[str, ...]] = {"frozen": (), "not frozen": ("--no-gc-freeze",)}
#: Each GPU server's KV cache: room for 256 samples of 512 tokens and their prompts.
GPU_KV_CACHE_BYTES = 12 << 30
_GC_LINE = re.compile(r'^skyrl_gc_pause_seconds_(sum|count)\{generation="(\d)"\} (\S+)$')


@dataclass(frozen=True)
class Load:
    streams: int = 16
    max_tokens: int = 128
    rounds: int = 6
    round_s: float = 8.0


async def gc_totals(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``{"sum2": ..., "count2": ..., "sum": ...}`` from the server's /metrics."""
    async with session.get(f"{url}/metrics") as reply:
        text = await reply.text()
    totals: dict[str, float] = {"sum": 0.0}
    for line in text.splitlines():
        match = _GC_LINE.match(line)
        if match is None:
            continue
        kind, generation, value = match.group(1), match.group(2), float(match.group(3))
        if kind == "sum":
            totals["sum"] += value
        if generation == "2":
            totals[f"{kind}2"] = value
    return totals


def gc_figures(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """What the collector cost between two :func:`gc_totals` readings ``wall``
    seconds apart: its share of the time, the full (generation 2) collections
    and their mean length."""
    full = after.get("count2", 0.0) - before.get("count2", 0.0)
    full_s = after.get("sum2", 0.0) - before.get("sum2", 0.0)
    return {
        "gc_share": (after["sum"] - before["sum"]) / wall,
        "full_collections": full,
        "full_collection_mean_ms": full_s / full * 1000 if full else 0.0,
    }


async def _round(url: str, prompt: list[int], load: Load) -> dict[str, float]:
    stop = asyncio.Event()
    tokens = 0
    probes_ms: list[float] = []

    async def sampling(client: RemoteInferenceClient) -> None:
        nonlocal tokens
        params = {"max_tokens": load.max_tokens, "temperature": 1.0, "ignore_eos": True}
        while not stop.is_set():
            out = await client.sample_with_retry(
                prompt, sampling_params=params, lora_name=ADAPTER, num_samples=4
            )
            tokens += sum(len(s.tokens) for s in out.sequences)

    async def probing(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            async with session.get(f"{url}/skyrl/v1/server_info") as reply:
                await reply.read()
            probes_ms.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(PROBE_EVERY_S)

    async with RemoteInferenceClient(url) as client, aiohttp.ClientSession() as session:
        before = await gc_totals(session, url)
        started = time.perf_counter()
        tasks = [asyncio.create_task(sampling(client)) for _ in range(load.streams)]
        tasks.append(asyncio.create_task(probing(session)))
        await asyncio.sleep(load.round_s)
        stop.set()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        after = await gc_totals(session, url)
    tail = Tail.of(probes_ms)
    return {
        "probe_p50_ms": tail.p50,
        "probe_p99_ms": tail.p99,
        "probe_max_ms": tail.max,
        **gc_figures(before, after, wall),
        "tokens_per_s": tokens / wall,
    }


async def _prepare(url: str, adapter_path: str) -> dict[str, Any]:
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter(ADAPTER, adapter_path)
        return (await client.server_info()).model_dump()


def run(urls: dict[str, str], prompt: list[int], load: Load) -> dict[str, Any]:
    """Rounds A B B A ... over the two servers; per-mode spreads of each figure."""
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for i in range(load.rounds * 2):
        mode = MODES[(i + i // 2) % 2]  # A B B A A B B A ...
        figures = asyncio.run(_round(urls[mode], prompt, load))
        rounds[mode].append(figures)
        print(
            f"round {i + 1:2} {mode:10} probe p99 {figures['probe_p99_ms']:7.1f} ms "
            f"max {figures['probe_max_ms']:7.1f} ms  GC {figures['gc_share']:6.1%} "
            f"({figures['full_collections']:.0f} full, "
            f"{figures['full_collection_mean_ms']:.0f} ms each)  "
            f"{figures['tokens_per_s']:.0f} tok/s",
            flush=True,
        )
    return {
        mode: {key: Spread.of(r[key] for r in per_mode).to_json() for key in per_mode[0]}
        for mode, per_mode in rounds.items()
    }


@contextlib.contextmanager
def _cpu_servers() -> Iterator[tuple[dict[str, str], str, list[int], str]]:
    """Both servers on the embedded model (Ray actors): urls, adapter path, prompt, machine."""
    from benchmarks.common import greeting_prompt
    from skyrl_lora.server.cluster.local import embedded_server

    with ExitStack() as stack:
        urls = {}
        for mode in MODES:
            urls[mode], model = stack.enter_context(embedded_server(NO_FREEZE[mode]))
        machine = f"{platform.machine()}, {os.cpu_count()} cores"
        yield urls, str(model.adapters["meow"]), greeting_prompt(model), machine


@contextlib.contextmanager
def _gpu_servers(root: Path) -> Iterator[tuple[dict[str, str], str, list[int], str]]:
    """Both servers on the random 0.8B Llama on one GPU (no Ray), started side by side."""
    import torch

    from skyrl_lora.server.cluster.process import ServeProcess, start_serve
    from skyrl_lora.server.embedded.random_model import build_random_model
    from skyrl_lora.server.presets import random_model_server_argv

    model = build_random_model(root, rank=16, size="0.8b")
    torch.cuda.empty_cache()
    log_dir = Path(os.environ.get("OUT") or root)

    def start(mode: str) -> ServeProcess:
        # A fixed KV cache: two servers profiling GPU memory side by side
        # otherwise size theirs differently (one ran 1/3 the tokens of the other).
        argv = random_model_server_argv(
            model.model_dir, max_lora_rank=16, max_loras=4, gpu_memory_utilization=0.35,
            extra=(*NO_FREEZE[mode], "--kv-cache-memory-bytes", str(GPU_KV_CACHE_BYTES)),
        )  # fmt: skip
        return start_serve(["--no-ray", *argv], log_dir / f"gc_freeze_{mode.replace(' ', '_')}.log")

    with concurrent.futures.ThreadPoolExecutor(len(MODES)) as pool:
        futures = {mode: pool.submit(start, mode) for mode in MODES}
    servers = {mode: f.result() for mode, f in futures.items() if f.exception() is None}
    failed = [exc for f in futures.values() if (exc := f.exception()) is not None]
    try:
        if failed:
            raise failed[0]
        adapter = str(next(iter(model.adapters.values())))
        machine = f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} cores"
        yield {m: s.url for m, s in servers.items()}, adapter, list(range(1, 33)), machine
    finally:
        for server in servers.values():
            server.stop()
            server.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=Load.rounds, help="rounds per server")
    parser.add_argument("--round-s", type=float, default=Load.round_s)
    parser.add_argument("--streams", type=int, default=Load.streams)
    parser.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    parser.add_argument(
        "--gpu", action="store_true", help="CUDA vLLM on the random 0.8B Llama instead of the CPU"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    load = Load(args.streams, args.max_tokens, args.rounds, args.round_s)

    with ExitStack() as stack:
        if args.gpu:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            servers = stack.enter_context(_gpu_servers(root))
        else:
            servers = stack.enter_context(_cpu_servers())
        urls, adapter, prompt, machine = servers
        infos = {mode: asyncio.run(_prepare(url, adapter)) for mode, url in urls.items()}
        figures = run(urls, prompt, load)
    result = {
        "commit": current_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{machine}, vLLM {infos[MODES[0]]['vllm_version']}, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "load": load.__dict__,
        "gc_frozen_objects": {mode: infos[mode]["gc_frozen_objects"] for mode in MODES},
        "figures": figures,
    }
    for mode in MODES:
        f = figures[mode]
        print(
            f"{mode:10}: probe p99 {f['probe_p99_ms']['median']:.1f} ms "
            f"(rounds {f['probe_p99_ms']['min']:.1f}-{f['probe_p99_ms']['max']:.1f}), "
            f"max {f['probe_max_ms']['median']:.1f} ms, GC {f['gc_share']['median']:.1%} "
            f"of the time, full collections {f['full_collection_mean_ms']['median']:.0f} ms, "
            f"{f['tokens_per_s']['median']:.0f} tok/s"
        )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
