"""A trainer's sync (pause, weights in, resume) by how the weights travel.

``python -m benchmarks.transport_swap`` times the sync a colocated trainer
pays five ways, in interleaved rounds on one server (the order rotates each
round), idle and while other tenants sample:

* ``path``: the server loads the trainer's adapter folder (shared disk);
* ``push``: the folder's bytes in the HTTP body (no shared disk);
* ``push_stream``: the same bytes over the server's push stream
  (on by default), opened over HTTP;
* ``handover``: the trainer's tensors by handle (:class:`AdapterHandover`):
  CUDA IPC where CUDA is there, a shared-memory file on a CPU;
* ``handover_swap``: the same hand-over in one call, no pause or resume of
  the trainer's own: the server stages the new version while the old one
  still serves, then pauses the adapter around the install and resumes it
  (``swap_policy="abort_resume"``). Two HTTP calls fewer, each of which
  waits its turn on the API server's loop under load.

Each figure is the median over rounds of each round's median (min-max
beside it), with the pooled p99 and max; ratios are against ``path`` from
the same rounds. On a CUDA machine it serves the random perf model
(``--size``, ``--rank``); on a CPU, the embedded model. Writes
``benchmarks/out/transport_swap.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.common import current_commit
from benchmarks.stats import Spread, Tail
from skyrl_lora.client import AdapterHandover, RemoteInferenceClient

ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ("path", "push", "push_stream", "handover", "handover_swap")
#: What the server is started with: every transport on (the push stream is by default).
SERVER_FLAGS = ("--allow-handover",)
#: ``under_load``: the other tenants sample from this process, on the event
#: loop that times the syncs. ``under_load_apart``: from a process of their
#: own, as other RL runs would; their client work (56 streams' requests and
#: answers) then no longer shares the trainer's loop and GIL. The swapper's
#: own samples (``swapper_samples``) stay here in both: a trainer's rollouts.
LOADS = ("idle", "under_load", "under_load_apart")


@dataclass(frozen=True)
class TransportConfig:
    rounds: int = 5
    swaps: int = 6  # per transport, load and round
    others: int = 3  # tenants sampling under load
    streams: int = 16  # per other tenant
    max_tokens: int = 256
    swapper: str = "swapper"
    #: The transports measured (``path`` always: the ratios are against it).
    transports: tuple[str, ...] = TRANSPORTS
    #: Under load, the swapper samples too (as many streams as each other
    #: tenant), so every sync aborts requests of its own and resumes them:
    #: a trainer that syncs while its rollouts run.
    swapper_samples: bool = False
    #: The loads measured, in this order in every round (:data:`LOADS`).
    loads: tuple[str, ...] = ("idle", "under_load")

    def __post_init__(self) -> None:
        unknown = set(self.transports) - set(TRANSPORTS)
        if unknown or "path" not in self.transports:
            raise ValueError(f"transports must include path and come from {TRANSPORTS}")
        if not self.loads or set(self.loads) - set(LOADS):
            raise ValueError(f"loads must come from {LOADS}, got {self.loads}")

    @property
    def other_names(self) -> list[str]:
        """The tenants other than the swapper."""
        return [f"other{i}" for i in range(self.others)]

    @property
    def samplers(self) -> list[str]:
        """The tenants sampling under load."""
        others = self.other_names
        return [*others, self.swapper] if self.swapper_samples else others


@contextlib.contextmanager
def server(size: str, rank: int, tenants: int) -> Iterator[tuple[str, list[Path], str]]:
    """A server taking hand-overs, two adapter folders of ``rank`` and the machine's name."""
    import torch

    if not torch.cuda.is_available():
        from benchmarks.swap_time import build_rank_adapters
        from skyrl_lora.server.cluster.local import embedded_server

        with embedded_server(list(SERVER_FLAGS)) as (url, model):
            yield url, build_rank_adapters(model, (rank,))[rank], "CPU, vLLM-CPU"
        return
    from skyrl_lora.server.cluster.process import serving
    from skyrl_lora.server.embedded.random_model import build_random_model, write_model_adapter
    from skyrl_lora.server.presets import random_model_server_argv

    work = Path(tempfile.mkdtemp(prefix="skyrl-transport-"))
    model = build_random_model(work, rank=rank, size=size)
    torch.cuda.empty_cache()
    folders = [write_model_adapter(model.model_dir, work / f"a{i}", rank, i) for i in (1, 2)]
    argv = random_model_server_argv(
        model.model_dir,
        max_lora_rank=rank,
        max_loras=tenants + 2,
        gpu_memory_utilization=0.6,
        extra=list(SERVER_FLAGS),
    )
    log = Path(os.environ.get("OUT") or work) / "transport_swap_server.log"
    with serving(["--no-ray", *argv], log) as running:
        yield running.url, folders, f"{torch.cuda.get_device_name(0)}, vLLM 0.26.0"


def device_tensors(folder: Path) -> dict[str, Any]:
    """The adapter as a trainer holds it: on its GPU where there is one."""
    import torch
    from safetensors.torch import load_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        k: v.to(device) for k, v in load_file(str(folder / "adapter_model.safetensors")).items()
    }


@dataclass(frozen=True)
class SyncTimes:
    """One trainer sync as the trainer saw it, in ms: the whole, and its
    parts (the pause, the trainer's copy into its hand-over buffer, the
    weights' call, the resume); ``handover_swap`` has no pause or resume
    of its own (the server's are inside its one call)."""

    total: float
    pause: float = 0.0
    update: float = 0.0
    weights: float = 0.0
    resume: float = 0.0

    PARTS: ClassVar[tuple[str, ...]] = ("pause", "update", "weights", "resume")


class _Clock:
    """Milliseconds since the last reading."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        lap, self._last = (now - self._last) * 1000, now
        return lap

    def total(self) -> float:
        return (time.perf_counter() - self.started) * 1000


async def sync_once(
    client: RemoteInferenceClient,
    name: str,
    transport: str,
    folder: Path,
    handover: AdapterHandover,
    tensors: dict[str, Any],
) -> SyncTimes:
    """One trainer sync: pause, weights in (the hand-over's copy into its
    buffer counted), resume; for ``handover_swap`` the server's own."""
    clock = _Clock()
    if transport == "handover_swap":
        handover.update(tensors)
        update = clock.lap()
        await client.push_lora_adapter(name, handover, swap_policy="abort_resume")
        return SyncTimes(clock.total(), update=update, weights=clock.lap())
    await client.pause_generation(lora_name=name)
    pause, update, weights = clock.lap(), 0.0, 0.0
    try:
        if transport == "path":
            await client.load_lora_adapter(name, str(folder))
        elif transport in ("push", "push_stream"):
            streamed = client.metrics().pushes_streamed
            await client.push_lora_adapter(name, folder, push_stream=transport == "push_stream")
            if (client.metrics().pushes_streamed > streamed) != (transport == "push_stream"):
                raise RuntimeError(f"a {transport} sync did not go as asked: no push stream?")
        else:
            handover.update(tensors)
            update = clock.lap()
            await client.push_lora_adapter(name, handover)
        weights = clock.lap()
    finally:
        await client.resume_generation(lora_name=name)
    return SyncTimes(clock.total(), pause, update, weights, clock.lap())


async def tenants_sampling(
    client: RemoteInferenceClient, names: list[str], cfg: TransportConfig, stop: asyncio.Event
) -> int:
    """The ``names`` tenants' streams until ``stop``; returns their tokens."""
    tokens = 0

    async def stream(name: str) -> None:
        nonlocal tokens
        params = {"max_tokens": cfg.max_tokens, "temperature": 1.0, "ignore_eos": True}
        while not stop.is_set():
            out = await client.sample_with_retry(
                [1, 2, 3, 4], sampling_params=params, lora_name=name
            )
            tokens += sum(len(s.tokens) for s in out.sequences)

    tasks = [asyncio.create_task(stream(n)) for n in names for _ in range(cfg.streams)]
    await stop.wait()
    await asyncio.gather(*tasks)
    return tokens


class SamplingProcess:
    """:func:`tenants_sampling` of ``names`` from a process of its own,
    started at once (``spawn``: this process runs an event loop)."""

    def __init__(
        self, url: str, api_key: str | None, names: list[str], cfg: TransportConfig
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results, child_end = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_sample_apart,
            args=(url, api_key, names, cfg, self._stop, child_end),
            name="others-sampling",
            daemon=True,
        )
        self._process.start()

    async def stop(self, timeout: float = 120.0) -> int:
        """Stop (requests in flight finish); the tokens the tenants got."""
        return await asyncio.to_thread(self._stop_and_collect, timeout)

    def _stop_and_collect(self, timeout: float) -> int:
        self._stop.set()
        if not self._results.poll(timeout):
            self._process.kill()
            raise RuntimeError(f"the others' sampling did not stop in {timeout} s")
        status, payload = self._results.recv()
        self._process.join(10)
        if status != "ok":
            raise RuntimeError(f"the others' sampling failed: {payload}")
        return int(payload)


def _sample_apart(
    url: str,
    api_key: str | None,
    names: list[str],
    cfg: TransportConfig,
    stop: Any,
    results: multiprocessing.connection.Connection,
) -> None:
    async def run() -> int:
        done = asyncio.Event()

        async def watch() -> None:
            await asyncio.to_thread(stop.wait)  # the driving process's event
            done.set()

        async with RemoteInferenceClient(url, api_key=api_key) as client:
            tokens, _ = await asyncio.gather(tenants_sampling(client, names, cfg, done), watch())
        return tokens

    try:
        results.send(("ok", asyncio.run(run())))
    except BaseException as exc:  # reported to the driving process, which raises it
        results.send(("error", f"{type(exc).__name__}: {exc}"))


async def measure(
    url: str,
    folders: list[Path],
    cfg: TransportConfig,
    strict: bool = True,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Every transport's syncs, idle and under load, in rotating order.

    First each transport loads the same weights and answers one greedy
    prompt: different tokens raise (``strict``), or are recorded. A large
    random model's logits are near ties, and vLLM's LoRA kernels on a GPU
    do not add in a fixed order, so the 8B model's answers can part after
    a few tokens even between two loads of one file by path.
    """
    others = cfg.other_names
    transports = cfg.transports
    tensors = [device_tensors(f) for f in folders]
    config = json.loads((folders[0] / "adapter_config.json").read_text())
    # {load: {transport: [per-round syncs]}}
    times: dict[str, dict[str, list[list[SyncTimes]]]] = {
        load: {t: [] for t in transports} for load in cfg.loads
    }
    async with RemoteInferenceClient(url, api_key=api_key) as client:
        for i, name in enumerate([cfg.swapper, *others]):
            await client.load_lora_adapter(name, str(folders[i % 2]))
        with AdapterHandover(config) as handover:
            greedy = {}
            for transport in transports:  # warm every path once; the same weights, the same text
                await sync_once(client, cfg.swapper, transport, folders[0], handover, tensors[0])
                params = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
                out = await client.sample([1, 2, 3], sampling_params=params, lora_name=cfg.swapper)
                greedy[transport] = out.sequences[0].tokens
            same = len({tuple(tokens) for tokens in greedy.values()}) == 1
            if strict and not same:
                raise RuntimeError(f"the transports' weights answer differently: {greedy}")
            for round_ in range(cfg.rounds):
                turn = round_ % len(transports)
                order = transports[turn:] + transports[:turn]
                for load in cfg.loads:
                    stop = asyncio.Event()
                    here = {
                        "idle": [],
                        "under_load": cfg.samplers,
                        "under_load_apart": cfg.samplers[len(others) :],
                    }[load]
                    sampling = (
                        asyncio.create_task(tenants_sampling(client, here, cfg, stop))
                        if here
                        else None
                    )
                    apart = (
                        SamplingProcess(url, api_key, others, cfg)
                        if load == "under_load_apart"
                        else None
                    )
                    if load != "idle":
                        await asyncio.sleep(1.0)  # the others' streams reach the engine
                    for transport in order:
                        done: list[SyncTimes] = []
                        for k in range(cfg.swaps):
                            done.append(
                                await sync_once(
                                    client,
                                    cfg.swapper,
                                    transport,
                                    folders[k % 2],
                                    handover,
                                    tensors[k % 2],
                                )
                            )
                        times[load][transport].append(done)
                    stop.set()
                    if sampling is not None:
                        await sampling
                    if apart is not None and not await apart.stop():
                        raise RuntimeError("the others' sampling apart got no tokens")
        metrics = client.metrics()
    if metrics.handover_fallbacks:
        raise RuntimeError(f"{metrics.handover_fallbacks} hand-overs fell back to bytes")
    return {
        "greedy_same_tokens": same,
        "greedy_tokens": greedy,
        # Samples a sync aborted and the client resumed (the swapper's own, under load).
        "resumed_segments": metrics.resumed_segments,
        **{load: summarise(by_transport) for load, by_transport in times.items()},
    }


def summarise(by_transport: dict[str, list[list[SyncTimes]]]) -> dict[str, Any]:
    """Per transport: the sync's median per round (spread over rounds), its
    pooled tail, its ratio to the path's, and each part's pooled median."""
    medians = {
        t: [median([sync.total for sync in r]) for r in rounds]
        for t, rounds in by_transport.items()
    }
    out: dict[str, Any] = {}
    for transport, rounds in by_transport.items():
        pooled = [sync for r in rounds for sync in r]
        ratio = [m / p for m, p in zip(medians[transport], medians["path"])]
        out[transport] = {
            "sync_ms": Spread.of(medians[transport]).to_json(),
            "pooled": Tail.of([sync.total for sync in pooled]).to_json(),
            "over_path": Spread.of(ratio).to_json(),
            "parts_ms_p50": {
                part: round(median([getattr(sync, part) for sync in pooled]), 2)
                for part in SyncTimes.PARTS
            },
        }
    return out


def median(values: list[float]) -> float:
    """The upper median, as the rounds' medians have always been taken here."""
    return sorted(values)[len(values) // 2]


def table(result: dict[str, Any]) -> str:
    lines = [
        "| load | transport | sync ms, median (min-max over rounds) | p99 / max | over path "
        "| pause / copy in / weights / resume p50 |"
    ]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for load in (k for k in LOADS if k in result):
        for transport, fig in result[load].items():
            s, p, r = fig["sync_ms"], fig["pooled"], fig["over_path"]
            parts = " / ".join(f"{fig['parts_ms_p50'][part]:.1f}" for part in SyncTimes.PARTS)
            lines.append(
                f"| {load} | {transport} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | "
                f"{p['p99']:.1f} / {p['max']:.1f} | {r['median']:.2f}x | {parts} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.8b", help="perf model size on CUDA (0.8b, 8b)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=TransportConfig.rounds)
    parser.add_argument("--swaps", type=int, default=TransportConfig.swaps)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/transport_swap.json")
    parser.add_argument("--commit", default=current_commit())
    args = parser.parse_args()
    cfg = TransportConfig(rounds=args.rounds, swaps=args.swaps)
    with server(args.size, args.rank, cfg.others + 1) as (url, folders, machine):
        result = asyncio.run(measure(url, folders, cfg))
    meta = {
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "model": args.size if "vLLM 0.26" in machine else "embedded",
        "rank": args.rank,
        "adapter_bytes": (folders[0] / "adapter_model.safetensors").stat().st_size,
        "config": cfg.__dict__,
    }
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**meta, "results": result}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
