"""Pause latency: pause call to every in-flight request of the adapter returned.

``in_flight`` ``sample_with_retry`` calls keep tenant A busy (they resubmit
after each resume); each pause waits until vLLM runs all of them, then times
the pause call, which returns only once every aborted request has come back.
Repeated in ``rounds`` rounds of ``pauses`` pauses: each round gives p50,
p99 and max, seen by the client and as the server's own drain time. The
design this replaces slept a fixed 5 s before aborting.

One streamed probe on another adapter runs alongside, in a process of its
own as another tenant's client would be: in the load's process, its tokens
waited for that process to handle 64 aborted answers (its event loop held
for up to 0.44 s after a pause on the 2-core CPU machine). Its inter-token gaps
that overlap a pause (from the pause call to the resume's answer) show what
the pause costs a tenant that is not paused, against its longest gap
outside pauses: the excess is the pause's own cost. Each pause comes right
after the resubmitted requests were admitted, so their re-prefill (paced
by the gate, :class:`~skyrl_lora.server.engine.gate.ResumePacing`) shares
the steps on both sides.

``python -m benchmarks.pause_latency --ab`` serves the embedded model twice,
with the gate's pacing of a late backlog and without it (``--resume-backlog-s
0 --resume-step-wait-max-ms 50``: pacing for 0.25 s after a resume only), and
measures them in alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import wait_engine_requests
from benchmarks.stats import Spread, Tail, check_count, split_gaps, tails_spread
from benchmarks.streams import StreamLog, keep_streaming
from skyrl_lora.client import RemoteInferenceClient


@dataclass
class PauseLatency:
    rounds: int
    pauses: int
    in_flight: int
    client: list[Tail]
    server: list[Tail]
    probe: list[Tail]  # the probe tenant's inter-token gaps that overlap a pause
    aborted: list[int]
    #: Per round, the probe's longest gap outside every pause.
    probe_outside_max: list[float] = field(default_factory=list)

    @property
    def probe_excess(self) -> Spread:
        """Per round, the longest gap across a pause less the longest outside."""
        return Spread.of(t.max - o for t, o in zip(self.probe, self.probe_outside_max))

    @property
    def probe_outside(self) -> Spread:
        return Spread.of(self.probe_outside_max)

    @property
    def client_spread(self) -> dict[str, Spread]:
        return tails_spread(self.client)

    @property
    def server_spread(self) -> dict[str, Spread]:
        return tails_spread(self.server)

    @property
    def probe_spread(self) -> dict[str, Spread]:
        return tails_spread(self.probe)

    @property
    def summary(self) -> dict[str, Any]:
        """Medians over rounds under flat keys (the GPU json's), spreads beside them."""
        flat: dict[str, Any] = {}
        for prefix, spread in (
            ("", self.client_spread),
            ("server_", self.server_spread),
            ("probe_gap_", self.probe_spread),
        ):
            for q, s in spread.items():
                flat[f"{prefix}{q}_ms"] = s.median
        flat["probe_gap_outside_max_ms"] = self.probe_outside.median
        flat["probe_gap_excess_ms"] = self.probe_excess.median
        flat["spread"] = {
            "client": {q: s.to_json() for q, s in self.client_spread.items()},
            "server": {q: s.to_json() for q, s in self.server_spread.items()},
            "probe_gap": {q: s.to_json() for q, s in self.probe_spread.items()},
            "probe_gap_outside_max": self.probe_outside.to_json(),
            "probe_gap_excess": self.probe_excess.to_json(),
        }
        flat["aborted_min"] = min(self.aborted)
        flat["rounds"], flat["pauses_per_round"] = self.rounds, self.pauses
        return flat


@dataclass
class _Round:
    """One round's raw figures: the probe's gaps are split once its log is back."""

    began: float
    ended: float
    windows: list[tuple[float, float]]  # pause call to the resume's answer
    client_ms: list[float]
    server_ms: list[float]
    aborted: list[int]


def _probe_main(url: str, tenant: str, prompt: list[int], conn: Connection) -> None:
    """The probe tenant's streams, in a process of their own, until told to stop."""

    async def stream() -> None:
        log = StreamLog(tenant)
        stop = asyncio.Event()
        task = asyncio.create_task(keep_streaming(url, tenant, prompt, log, stop, 1, 400))
        conn.send("streaming")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        stop.set()
        task.cancel()  # the completion in flight need not finish
        await asyncio.gather(task, return_exceptions=True)
        conn.send(log.streams)

    asyncio.run(stream())


class _Load:
    """Tenant A's ``in_flight`` looping samples and the probe's process, on one server."""

    def __init__(self, url: str, model: Any, prompt: list[int], in_flight: int) -> None:
        self.url, self.model, self.prompt, self.in_flight = url, model, prompt, in_flight
        self.probe = StreamLog("lat-probe")
        self.rounds: list[_Round] = []

    async def __aenter__(self) -> _Load:
        self.client = RemoteInferenceClient(self.url)
        await self.client.__aenter__()
        names = {a.lora_name for a in (await self.client.list_adapters()).adapters}
        for name, adapter in (("lat-a", "meow"), (self.probe.tenant, "woof")):
            if name not in names:
                await self.client.load_lora_adapter(name, str(self.model.adapters[adapter]))
        params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        self.stop = asyncio.Event()

        async def stream() -> None:  # one sample after another, so all stay in flight
            while not self.stop.is_set():
                await self.client.sample_with_retry(
                    self.prompt, sampling_params=params, lora_name="lat-a"
                )

        self.load = [asyncio.create_task(stream()) for _ in range(self.in_flight)]
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_probe_main, args=(self.url, self.probe.tenant, self.prompt, child)
        )
        self.process.start()
        await asyncio.get_running_loop().run_in_executor(None, self.conn.recv)
        return self

    async def round(self, pauses: int) -> None:
        client, began = self.client, time.monotonic()
        windows: list[tuple[float, float]] = []
        client_ms: list[float] = []
        server_ms: list[float] = []
        aborted: list[int] = []
        for _ in range(pauses):
            await wait_engine_requests(client, "lat-a", self.in_flight)
            started = time.monotonic()
            (ack,) = await client.pause_generation(lora_name="lat-a")
            client_ms.append((time.monotonic() - started) * 1000)
            server_ms.append(ack.drain_seconds * 1000)
            aborted.append(ack.aborted)  # a stream between two samples may miss one
            await client.resume_generation(lora_name="lat-a")
            windows.append((started, time.monotonic()))
        self.rounds.append(_Round(began, time.monotonic(), windows, client_ms, server_ms, aborted))

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        loop = asyncio.get_running_loop()
        self.conn.send("stop")
        self.probe.streams += await loop.run_in_executor(None, self.conn.recv)
        await loop.run_in_executor(None, self.process.join)
        await self.client.resume_generation(lora_name="lat-a")
        for task in self.load:  # their requests end as their connections close
            task.cancel()
        await asyncio.gather(*self.load, return_exceptions=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # gone before another load starts
            (state,) = [
                a for a in (await self.client.list_adapters()).adapters if a.lora_name == "lat-a"
            ]
            if not state.engine_requests:
                break
            await asyncio.sleep(0.05)
        await self.client.__aexit__(None, None, None)

    def figures(self) -> PauseLatency:
        client_tails, server_tails, probe_tails, outside_max, aborted = [], [], [], [], []
        for r in self.rounds:
            across, outside = split_gaps(self.probe.gaps(r.began, r.ended), r.windows)
            check_count("probe gaps", len(across), 1, "probe token gaps over pauses")
            check_count("probe gaps outside", len(outside), 1, "probe token gaps outside pauses")
            client_tails.append(Tail.of(r.client_ms))
            server_tails.append(Tail.of(r.server_ms))
            probe_tails.append(Tail.of(across))
            outside_max.append(max(outside))
            aborted += r.aborted
        pauses = len(self.rounds[0].windows)
        return PauseLatency(
            len(self.rounds),
            pauses,
            self.in_flight,
            client_tails,
            server_tails,
            probe_tails,
            aborted,
            outside_max,
        )


async def run(
    url: str, model: Any, prompt: list[int], rounds: int = 3, pauses: int = 50, in_flight: int = 64
) -> PauseLatency:
    async with _Load(url, model, prompt, in_flight) as load:
        for _ in range(rounds):
            await load.round(pauses)
    return load.figures()


#: The gate as it paced a resume before it waited for the late backlog.
WINDOW_ONLY = ("--resume-backlog-s", "0", "--resume-step-wait-max-ms", "50")


async def ab(
    urls: dict[str, str], model: Any, prompt: list[int], rounds: int, pauses: int, in_flight: int
) -> dict[str, PauseLatency]:
    """Each server's rounds in turn (one load at a time: the cores are shared)."""
    loads = {name: _Load(url, model, prompt, in_flight) for name, url in urls.items()}
    for _ in range(rounds):
        for load in loads.values():
            async with load:
                await load.round(pauses)
    return {name: load.figures() for name, load in loads.items()}


def _report(name: str, p: PauseLatency) -> str:
    t, o, e = p.probe_spread["max"], p.probe_outside, p.probe_excess
    return (
        f"{name}: probe's longest gap across a pause {t.median:.1f} ms ({t.min:.1f}-{t.max:.1f}),"
        f" outside pauses {o.median:.1f} ({o.min:.1f}-{o.max:.1f}),"
        f" excess {e.median:.1f} ({e.min:.1f}-{e.max:.1f}); pause p99"
        f" {p.client_spread['p99'].median:.1f} ms; {p.rounds} rounds x {p.pauses} pauses"
    )


def main() -> None:
    from benchmarks.common import collector_paused, greeting_prompt
    from skyrl_lora.server.cluster.local import embedded_server

    parser = argparse.ArgumentParser(prog="python -m benchmarks.pause_latency")
    parser.add_argument("--ab", action="store_true", help="against the window-only pacing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pauses", type=int, default=30)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    extra = ["--max-loras", "8"]
    with embedded_server(extra=extra) as (url, model):
        prompt = greeting_prompt(model)
        if not args.ab:
            with collector_paused():
                res = {"paced": asyncio.run(run(url, model, prompt, args.rounds, args.pauses))}
        else:
            with embedded_server(extra=[*extra, *WINDOW_ONLY]) as (old_url, _):
                urls = {"backlog paced": url, "window only": old_url}
                with collector_paused():
                    res = asyncio.run(
                        ab(urls, model, prompt, args.rounds, args.pauses, args.in_flight)
                    )
    for name, figures in res.items():
        print(_report(name, figures))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({n: f.summary for n, f in res.items()}, out, indent=2)


if __name__ == "__main__":
    main()
