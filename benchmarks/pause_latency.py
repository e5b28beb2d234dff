"""Pause latency: pause call to every in-flight request of the adapter returned.

``in_flight`` ``sample_with_retry`` calls keep tenant A busy (they resubmit
after each resume); each pause waits until vLLM runs all of them, then times
the pause call, which returns only once every aborted request has come back.
Repeated in ``rounds`` rounds of ``pauses`` pauses: each round gives p50,
p99 and max, seen by the client and as the server's own drain time. The
design this replaces slept a fixed 5 s before aborting.

One streamed probe on another adapter runs alongside: its inter-token gaps
that overlap a pause show what the pause (and the engine steps around it)
cost a tenant that is not paused. They are not a clean engine-step time:
each pause comes right after the 64 resubmitted requests were admitted, so
their re-prefill shares those steps.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
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
        flat["spread"] = {
            "client": {q: s.to_json() for q, s in self.client_spread.items()},
            "server": {q: s.to_json() for q, s in self.server_spread.items()},
            "probe_gap": {q: s.to_json() for q, s in self.probe_spread.items()},
        }
        flat["aborted_min"] = min(self.aborted)
        flat["rounds"], flat["pauses_per_round"] = self.rounds, self.pauses
        return flat


async def run(
    url: str, model: Any, prompt: list[int], rounds: int = 3, pauses: int = 50, in_flight: int = 64
) -> PauseLatency:
    client_tails: list[Tail] = []
    server_tails: list[Tail] = []
    probe_tails: list[Tail] = []
    aborted: list[int] = []
    probe = StreamLog("lat-probe")
    async with RemoteInferenceClient(url) as client:
        await client.load_lora_adapter("lat-a", str(model.adapters["meow"]))
        await client.load_lora_adapter(probe.tenant, str(model.adapters["woof"]))
        params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        stop = asyncio.Event()

        async def stream() -> None:  # one sample after another, so all stay in flight
            while not stop.is_set():
                await client.sample_with_retry(prompt, sampling_params=params, lora_name="lat-a")

        load = [asyncio.create_task(stream()) for _ in range(in_flight)]
        load.append(
            asyncio.create_task(keep_streaming(url, probe.tenant, prompt, probe, stop, 1, 400))
        )
        try:
            for _ in range(rounds):
                began = time.monotonic()
                pause_windows: list[tuple[float, float]] = []
                client_ms: list[float] = []
                server_ms: list[float] = []
                for _ in range(pauses):
                    await wait_engine_requests(client, "lat-a", in_flight)
                    started = time.monotonic()
                    (ack,) = await client.pause_generation(lora_name="lat-a")
                    pause_windows.append((started, time.monotonic()))
                    client_ms.append((pause_windows[-1][1] - started) * 1000)
                    server_ms.append(ack.drain_seconds * 1000)
                    aborted.append(ack.aborted)  # a stream between two samples may miss one
                    await client.resume_generation(lora_name="lat-a")
                client_tails.append(Tail.of(client_ms))
                server_tails.append(Tail.of(server_ms))
                gaps, _ = split_gaps(probe.gaps(began, time.monotonic()), pause_windows)
                check_count("probe gaps", len(gaps), 1, "probe token gaps over pauses")
                probe_tails.append(Tail.of(gaps))
        finally:
            stop.set()
            await client.resume_generation(lora_name="lat-a")
            await asyncio.gather(*load)
    return PauseLatency(rounds, pauses, in_flight, client_tails, server_tails, probe_tails, aborted)
