"""The demo: three tenants share one server; one swaps weights twice mid-flight.

It starts a real server on the embedded model in a local Ray actor, samples
for three tenants at once through ``sample_with_retry``, swaps tenant A's
adapter twice while its samples are in flight (meow -> woof -> quack
weights), prints live per-tenant progress, and ends with the stitched
outputs and the adapter version that produced each stretch of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.types import SampleResponse

TENANTS = {"tenant-a": "meow", "tenant-b": "woof", "tenant-c": "moo"}
SWAPS = ("woof", "quack")  # tenant-a's weights after the first and second swap


@dataclass
class TenantProgress:
    started: int = 0
    done: int = 0
    tokens: int = 0
    results: list[SampleResponse] = field(default_factory=list)


async def _sample_tenant(
    client: RemoteInferenceClient,
    tenant: str,
    prompt: list[int],
    samples: int,
    max_tokens: int,
    progress: TenantProgress,
) -> None:
    async def one() -> None:
        progress.started += 1
        result = await client.sample_with_retry(
            prompt,
            sampling_params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            lora_name=tenant,
        )
        progress.done += 1
        progress.tokens += len(result.sequences[0].tokens)
        progress.results.append(result)

    await asyncio.gather(*(one() for _ in range(samples)))


async def _swap_period(client: RemoteInferenceClient, prompt: list[int], max_tokens: int) -> float:
    """Seconds between the swaps, so both land while the samples run.

    A lone 50-token sample, after one that warms the server up, sets the pace; the
    demo's 12 concurrent samples decode no faster than one alone, so swaps at
    a third and two thirds of a lone sample's time land mid-sample on a fast
    machine and a slow one alike.
    """
    pace_tokens = 50
    params = {"max_tokens": pace_tokens, "temperature": 0.0, "ignore_eos": True}
    await client.sample(prompt, sampling_params=params, lora_name="tenant-a")  # warm-up
    started = time.monotonic()
    await client.sample(prompt, sampling_params=params, lora_name="tenant-a")
    return (time.monotonic() - started) / pace_tokens * max_tokens / 3


async def _generating(client: RemoteInferenceClient, tenant: str) -> bool:
    listing = await client.list_adapters()
    return any(a.engine_requests for a in listing.adapters if a.lora_name == tenant)


async def _swap_twice(
    client: RemoteInferenceClient, adapters: dict[str, Any], log: list[str], every: float
) -> None:
    # Start the clock once tenant-a's samples are really generating: the first
    # requests of a fresh server also pay for its warm-up.
    while not await _generating(client, "tenant-a"):  # noqa: ASYNC110 (polls the server)
        await asyncio.sleep(0.05)
    for weights in SWAPS:
        await asyncio.sleep(every)
        started = time.monotonic()
        (paused,) = await client.pause_generation(lora_name="tenant-a")
        (info,) = await client.reload_lora_adapter("tenant-a", str(adapters[weights]))
        await client.resume_generation(lora_name="tenant-a")
        log.append(
            f"swap: tenant-a -> {weights} weights (v{info.version}); aborted {paused.aborted} "
            f"in flight, pause took {paused.drain_seconds * 1000:.1f} ms, "
            f"pause+reload+resume {(time.monotonic() - started) * 1000:.0f} ms"
        )
        print("  " + log[-1], flush=True)


async def _show_progress(
    client: RemoteInferenceClient,
    progress: dict[str, TenantProgress],
    samples: int,
    stop: asyncio.Event,
) -> None:
    started = time.monotonic()
    while not stop.is_set():
        listing = {a.lora_name: a for a in (await client.list_adapters()).adapters}
        cells = []
        for tenant, p in progress.items():
            a = listing[tenant]
            state = "PAUSED" if a.paused else "serving"
            cells.append(
                f"{tenant} v{a.version} {state}: {p.started - p.done} running, "
                f"{p.done}/{samples} done ({a.in_flight} in engine, {a.held} held)"
            )
        print(f"[{time.monotonic() - started:5.1f}s] " + " | ".join(cells), flush=True)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


def _runs(words: list[str]) -> str:
    """'meow meow woof' -> 'meow x2, woof x1'."""
    out: list[str] = []
    for w in words:
        if out and out[-1].split(" x")[0] == w:
            head, count = out[-1].split(" x")
            out[-1] = f"{head} x{int(count) + 1}"
        else:
            out.append(f"{w} x1")
    return ", ".join(out)


async def run(url: str, model: Any, tokenizer: Any, samples: int, max_tokens: int) -> int:
    prompt = list(tokenizer.encode("hello there how are you", add_special_tokens=False))
    progress = {t: TenantProgress() for t in TENANTS}
    swap_log: list[str] = []
    async with RemoteInferenceClient(url) as client:
        for tenant, weights in TENANTS.items():
            await client.load_lora_adapter(tenant, str(model.adapters[weights]))
        every = await _swap_period(client, prompt, max_tokens)
        stop = asyncio.Event()
        shower = asyncio.create_task(_show_progress(client, progress, samples, stop))
        started = time.monotonic()
        await asyncio.gather(
            *(_sample_tenant(client, t, prompt, samples, max_tokens, progress[t]) for t in TENANTS),
            _swap_twice(client, model.adapters, swap_log, every=every),
        )
        elapsed = time.monotonic() - started
        stop.set()
        await shower
    print(f"\nAll {samples * len(TENANTS)} samples finished in {elapsed:.1f} s.\n")
    for tenant, p in progress.items():
        # Show the sample that saw the most versions (for tenant-a: the swaps).
        result = max(p.results, key=lambda r: len(r.sequences[0].versions))
        (seq,) = result.sequences
        text = tokenizer.decode(seq.tokens).split()
        print(
            f"{tenant} (started on {TENANTS[tenant]} weights), one sample, "
            f"{len(seq.tokens)} tokens, stop={seq.stop_reason}, {seq.segments} segment(s):"
        )
        for r in seq.versions:
            stretch = _runs(text[r.start : r.end])
            print(f"    tokens {r.start:3}-{r.end:3} from v{r.version}: {stretch}")
        print(f"    text: {' '.join(text[:6])} ... {' '.join(text[-6:])}")
    print("\n" + "\n".join(swap_log))
    return 0


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="skyrl-lora demo", description=__doc__)
    parser.add_argument("--samples", type=int, default=4, help="samples per tenant")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    args = parser.parse_args(list(argv))

    from transformers import AutoTokenizer

    from .embedded import ensure_embedded_model

    model = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model.model_dir)
    if args.url:
        return asyncio.run(run(args.url, model, tokenizer, args.samples, args.max_tokens))

    from .cluster.local import embedded_server

    print("Starting a skyrl-lora server on the embedded model (about 40 s on CPU)...", flush=True)
    with embedded_server() as (url, _):
        print(f"Server ready at {url}\n", flush=True)
        return asyncio.run(run(url, model, tokenizer, args.samples, args.max_tokens))
