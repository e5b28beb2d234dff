"""A tenant's load, in a process of its own or on this event loop.

The benchmark's swapper retries its aborted samples in bursts (all of its
streams at once after every swap), and that work runs on the event loop of
the process that drives it. Arrival times taken on the same loop would count
that client-side burst as a stall of the server. Each other tenant therefore
runs from its own process, as separate tenants would, and sends its record
back when stopped (:class:`StreamProcess`), unless the machine's few cores
are better left to the server (:class:`InProcessTenant`). ``time.monotonic``
is one clock for every process of the machine, so the record lines up with
the driving process's windows.

A tenant's load is ``streams`` streamed completions (per-token arrival
times: the gaps) plus ``bulk`` token-in samples without streaming (tokens
counted over each sample's lifetime). Streaming every token costs the API
server one JSON chunk per token per stream; on a GPU that serialisation, not
the engine, becomes the bottleneck long before the engine is busy, so a load
of streams only would measure the API server's event loop. RL tenants sample
without streaming anyway.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import threading
from dataclasses import dataclass
from typing import Protocol

from benchmarks.common import TokenMeter, collector_paused, keep_sampling
from benchmarks.streams import StreamLog, keep_streaming
from skyrl_lora.client import RemoteInferenceClient

#: ``spawn``: a fork of a process that runs an event loop (and maybe Ray)
#: copies its threads' locks in whatever state they were.
_CONTEXT = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class StreamSpec:
    """One tenant's load: ``streams`` streamed and ``bulk`` non-streamed request loops."""

    url: str
    tenant: str
    prompt: list[int]
    streams: int
    max_tokens: int
    length_spread: float = 0.0
    bulk: int = 0


@dataclass
class TenantRecord:
    """What a tenant's process saw: stream arrivals, and its bulk samples' tokens."""

    streams: StreamLog
    bulk: TokenMeter

    def rate(self, start: float, end: float) -> float:
        """The tenant's tokens/s over [start, end), streamed and bulk together."""
        streamed = self.streams.tokens_in(start, end)
        return (streamed + self.bulk.tokens_in([self.streams.tenant], start, end)) / (end - start)


class _Flag(Protocol):
    """What :func:`_stream_until` needs of an event: a thread's or a process's."""

    def is_set(self) -> bool: ...
    def set(self) -> None: ...


class TenantLoad(Protocol):
    """One other tenant's load, in this process or its own."""

    def start(self) -> None: ...
    @property
    def streaming(self) -> bool: ...
    async def stop(self) -> TenantRecord: ...
    def kill(self) -> None: ...


class InProcessTenant:
    """The load as tasks of this event loop: on a machine with few cores a
    process per tenant takes CPU from the server being measured."""

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self._log = StreamLog(spec.tenant)
        self._meter = TokenMeter()
        self._streaming = threading.Event()
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(
            _stream_until(self.spec, self._log, self._meter, self._streaming, self._stop)
        )

    @property
    def streaming(self) -> bool:
        if self._task is not None and self._task.done() and not self._streaming.is_set():
            self._task.result()  # raises its failure
            raise RuntimeError(f"{self.spec.tenant}: load ended before it streamed")
        return self._streaming.is_set()

    async def stop(self) -> TenantRecord:
        self._stop.set()
        if self._task is not None:
            await self._task
        return TenantRecord(self._log, self._meter)

    def kill(self) -> None:
        if self._task is not None:
            self._task.cancel()


class StreamProcess:
    """The load in a process of its own (see the module's docstring)."""

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self._streaming = _CONTEXT.Event()
        self._stop = _CONTEXT.Event()
        self._results, child_end = _CONTEXT.Pipe(duplex=False)
        self._process = _CONTEXT.Process(
            target=_run,
            args=(spec, self._streaming, self._stop, child_end),
            name=f"stream-{spec.tenant}",
            daemon=True,
        )

    def start(self) -> None:
        self._process.start()

    @property
    def streaming(self) -> bool:
        """Whether the tenant has received tokens (raises if its process failed)."""
        if not self._streaming.is_set() and not self._process.is_alive():
            self._raise_failure()
        return self._streaming.is_set()

    async def stop(self, timeout: float = 120.0) -> TenantRecord:
        """Stop (requests in flight finish) and return what the tenant saw."""
        return await asyncio.to_thread(self._stop_and_collect, timeout)

    def _stop_and_collect(self, timeout: float) -> TenantRecord:
        self._stop.set()
        if not self._results.poll(timeout):
            self._process.kill()
            raise RuntimeError(f"{self.spec.tenant}: stream process did not stop in {timeout} s")
        status, payload = self._results.recv()
        self._process.join(10)
        if status != "ok":
            raise RuntimeError(f"{self.spec.tenant}: stream process failed: {payload}")
        streams, spans = payload
        return TenantRecord(StreamLog(self.spec.tenant, streams), TokenMeter(spans))

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()

    def _raise_failure(self) -> None:
        detail = ""
        if self._results.poll(0):
            try:
                _, detail = self._results.recv()
            except EOFError:  # died before it could say why (killed, interpreter crash)
                pass
        raise RuntimeError(
            f"{self.spec.tenant}: stream process ended (exit {self._process.exitcode}) {detail}"
        )


def _run(
    spec: StreamSpec, streaming: _Flag, stop: _Flag, results: multiprocessing.connection.Connection
) -> None:
    log = StreamLog(spec.tenant)
    meter = TokenMeter()
    try:
        with collector_paused():  # its own collections would read as server stalls
            asyncio.run(_stream_until(spec, log, meter, streaming, stop))
        results.send(("ok", (log.streams, meter.spans)))
    except BaseException as exc:  # reported to the driving process, which raises it
        results.send(("error", f"{type(exc).__name__}: {exc}"))


def _has_tokens(spec: StreamSpec, log: StreamLog, meter: TokenMeter) -> bool:
    """Whether every kind of request the tenant runs has produced tokens."""
    return any(arrivals for arrivals in log.streams) and bool(meter.spans or not spec.bulk)


async def _stream_until(
    spec: StreamSpec, log: StreamLog, meter: TokenMeter, streaming: _Flag, stop: _Flag
) -> None:
    stopped = asyncio.Event()
    async with RemoteInferenceClient(spec.url) as client:
        load = asyncio.gather(
            keep_streaming(
                spec.url,
                spec.tenant,
                spec.prompt,
                log,
                stopped,
                spec.streams,
                spec.max_tokens,
                length_spread=spec.length_spread,
            ),
            keep_sampling(
                client,
                spec.tenant,
                spec.prompt,
                meter,
                stopped,
                spec.bulk,
                spec.max_tokens,
                length_spread=spec.length_spread,
            ),
        )
        while not stop.is_set() and not load.done():
            if not streaming.is_set() and _has_tokens(spec, log, meter):
                streaming.set()
            await asyncio.sleep(0.02)
        stopped.set()
        await load  # raises the load's failure, if any
