"""Shared benchmark plumbing: a real server on the embedded model, token meters."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from skyrl_lora.client import RemoteInferenceClient

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on this host now (for a server that cannot pick its own)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def skyrl_event(line: str) -> dict[str, Any] | None:
    """The event a server log line carries (``... skyrl_event {json}``), else None."""
    _, sep, body = line.partition("skyrl_event ")
    return json.loads(body) if sep else None


def int_list(text: str) -> list[int]:
    """A comma-separated list of counts, as benchmark flags take them (``64,256``)."""
    return [int(v) for v in text.split(",") if v]


def current_commit() -> str:
    """The checkout's short commit, for the figures a benchmark writes ("unknown" outside git).

    ``SKYRL_COMMIT`` wins where it is set: a copy of the work tree on another
    machine (the lent GPU's) can carry an older ``.git`` than its files.
    """
    if os.environ.get("SKYRL_COMMIT"):
        return os.environ["SKYRL_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def greeting_prompt(model: Any) -> list[int]:
    """The benchmarks' prompt: a short greeting in the embedded model's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.model_dir)
    return list(tokenizer.encode("hello there how are you", add_special_tokens=False))


@contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage collection in this (the measuring) process while measuring.

    Arrival times are taken by this process's event loop, so one of its own
    full collections (tens of ms once the logs hold many thousand lists)
    would be recorded as a stall of the server. Like ``timeit``, measure
    with the collector off; the heap built so far is frozen so the
    collection afterwards does not walk it either.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


@dataclass
class TokenMeter:
    """Tokens per tenant over time, for rates and timelines.

    A sample's tokens are spread evenly over its lifetime rather than counted
    when it completes: samples finish in waves, and counting completions
    would make the rate of a few-second window jump by whole waves.
    """

    spans: list[tuple[float, float, str, int]] = field(default_factory=list)

    def add(self, tenant: str, tokens: int, started: float) -> None:
        self.spans.append((started, time.monotonic(), tenant, tokens))

    def tokens_in(self, tenants: Sequence[str], start: float, end: float) -> float:
        total = 0.0
        for s, e, who, n in self.spans:
            if who in tenants and e > start and s < end:
                total += n * (min(e, end) - max(s, start)) / max(e - s, 1e-9)
        return total

    def rate(self, tenants: Sequence[str], start: float, end: float) -> float:
        return self.tokens_in(tenants, start, end) / (end - start)


def completion_lengths(mean: int, spread: float, seed: str) -> Iterator[int]:
    """Endless ``max_tokens`` draws, uniform in ``mean * (1 +- spread)``, seeded.

    Streams that all ask for the same length start and finish together
    forever, so every step's mix of prefills and decodes depends on the
    phase the previous window left them in (a pause resumes them in step).
    Varied lengths spread the streams out within a few completions, which
    makes the load the same in every window. ``spread=0`` gives ``mean``.
    """
    rng = random.Random(seed)
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    while True:
        yield rng.randint(low, high)


async def keep_sampling(
    client: RemoteInferenceClient,
    tenant: str,
    prompt: list[int],
    meter: TokenMeter,
    stop: asyncio.Event,
    streams: int,
    max_tokens: int,
    length_spread: float = 0.0,
) -> None:
    """``streams`` concurrent loops of short greedy samples until ``stop``."""

    async def loop(stream: int) -> None:
        for length in completion_lengths(max_tokens, length_spread, seed=f"{tenant}:bulk:{stream}"):
            if stop.is_set():
                return
            params = {"max_tokens": length, "temperature": 0.0, "ignore_eos": True}
            started = time.monotonic()
            out = await client.sample_with_retry(prompt, sampling_params=params, lora_name=tenant)
            meter.add(tenant, len(out.sequences[0].tokens), started)

    await asyncio.gather(*(loop(i) for i in range(streams)))


async def wait_engine_requests(
    client: RemoteInferenceClient, tenant: str, count: int, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listing = await client.list_adapters()
        (state,) = [a for a in listing.adapters if a.lora_name == tenant]
        if state.engine_requests >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tenant}: {state.engine_requests} of {count} requests running")
        await asyncio.sleep(0.01)


async def serving_rate(
    url: str,
    tenants: Sequence[str],
    prompt: list[int],
    streams: int,
    settle_s: float,
    round_s: float,
    max_tokens: int = 256,
) -> float:
    """Tokens/s of every tenant's ``streams`` greedy sample loops
    (:func:`keep_sampling`, lengths spread by half) over ``round_s``
    seconds, after ``settle_s`` seconds of the same load."""
    meter = TokenMeter()
    stop = asyncio.Event()
    async with RemoteInferenceClient(url) as client:
        load = [
            asyncio.create_task(
                keep_sampling(client, t, prompt, meter, stop, streams, max_tokens, 0.5)
            )
            for t in tenants
        ]
        await asyncio.sleep(settle_s)
        start = time.monotonic()
        await asyncio.sleep(round_s)
        end = time.monotonic()
        stop.set()
        await asyncio.gather(*load)
    return meter.rate(tenants, start, end)


async def interleaved_rounds(
    variants: Sequence[str],
    rounds: int,
    measure: Callable[[str], Awaitable[T]],
    show: Callable[[T], str],
) -> dict[str, list[T]]:
    """``measure(variant)`` for every variant in each of ``rounds`` rounds, in
    the order AB, BA, AB, ... so that neither variant always runs first;
    each result printed as ``show`` writes it."""
    results: dict[str, list[T]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            results[variant].append(await measure(variant))
            print(f"round {r + 1} {variant}: {show(results[variant][-1])}", flush=True)
    return results


async def interleaved_rates(
    variants: Sequence[str], rounds: int, rate: Callable[[str], Awaitable[float]]
) -> dict[str, list[float]]:
    """:func:`interleaved_rounds` of a tokens/s figure."""
    return await interleaved_rounds(variants, rounds, rate, lambda v: f"{v:.0f} tok/s")


def add_ab_flags(parser: argparse.ArgumentParser, *, streams: int) -> None:
    """The flags every two-server A/B on one GPU shares: its load's loops,
    its rounds, each server's GPU share, and the labels of its JSON."""
    parser.add_argument("--streams", type=int, default=streams, help="sample loops per tenant")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--round-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--gpu-mem", type=float, default=0.3, help="each server's share")
    parser.add_argument("--work", type=Path, help="where the model is built (default: a temp dir)")
    parser.add_argument("--machine", default="")
    parser.add_argument("--commit", default=current_commit())
    parser.add_argument("--json", type=Path)


def serve_side_by_side(
    argv_of: dict[str, list[str]],
    logs: Path,
    measure: Callable[[dict[str, str]], Coroutine[Any, Any, dict[str, Any]]],
) -> dict[str, Any]:
    """Start one ``serve --no-ray`` per variant, run ``measure`` on their
    URLs, and stop them all, however it ends.

    The servers start one after the other: vLLM sizes its memory from what
    is free at its start, and two servers profiling at once left one
    without room.
    """
    from skyrl_lora.server.cluster.process import start_serve

    logs.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for variant, argv in argv_of.items():
            servers[variant] = start_serve(["--no-ray", *argv], logs / f"{variant}.log")
        return asyncio.run(measure({v: s.url for v, s in servers.items()}))
    finally:
        for server in servers.values():
            server.stop()
            server.kill_all()


def tenants_on_random_model(
    args: argparse.Namespace,
    work: Path,
    flags: dict[str, list[str]],
    *,
    size: str | None = None,
    preload: bool = False,
) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """The GPU perf model (``size``; the default shape if None) with
    ``args.tenants`` rank-16 adapters ``t0``, ``t1``, ... built under
    ``work``, and one ``serve`` argv per variant of ``flags`` (its extra
    flags) with each server's share ``args.gpu_mem``; with ``preload`` every
    server loads the adapters at its start. Sets ``args.vocab``."""
    from skyrl_lora.server.embedded.random_model import (
        DEFAULT_SIZE,
        VOCAB_SIZE,
        build_random_model,
        write_model_adapter,
    )
    from skyrl_lora.server.presets import random_model_server_argv

    args.vocab = VOCAB_SIZE
    model = build_random_model(work, rank=16, size=size or DEFAULT_SIZE)
    adapters = {
        f"t{i}": write_model_adapter(model.model_dir, work / "tenants" / f"t{i}", 16, seed=100 + i)
        for i in range(args.tenants)
    }
    modules = [f"{name}={path}" for name, path in adapters.items()]
    served = ["--lora-modules", *modules] if preload else []
    argv_of = {
        v: random_model_server_argv(
            model.model_dir,
            max_lora_rank=16,
            max_loras=args.tenants,
            gpu_memory_utilization=args.gpu_mem,
            extra=[*served, *extra],
        )
        for v, extra in flags.items()
    }
    return adapters, argv_of


def finish_ab(
    result: dict[str, Any],
    args: Any,
    *,
    tenants: int,
    ratio: str,
    what: str,
    check: str,
) -> int:
    """Close an A/B of two servers' tokens/s: label ``result`` with the run
    (``args.commit``, ``args.machine``, ``args.streams``, ``args.round_s``),
    print its ``ratio`` spread (a :class:`benchmarks.stats.Spread` as a dict)
    as ``what`` and its ``check``, write ``args.json`` if given; the exit
    status, 1 where the check failed."""
    result.update(
        commit=args.commit,
        date=time.strftime("%Y-%m-%d"),
        machine=args.machine,
        tenants=tenants,
        streams_per_tenant=args.streams,
        round_s=args.round_s,
    )
    spread = result[ratio]
    print(
        f"{what} tokens/s: {spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f}, "
        f"{spread['rounds']} rounds); {check.replace('_', ' ')}: {result[check]}",
        flush=True,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result[check] else 1
