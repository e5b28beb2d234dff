"""A tenant's streamed load in a process of its own.

The benchmark's swapper retries its aborted samples in bursts (all of its
streams at once after every swap), and that work runs on the event loop of
the process that drives it. Arrival times taken on the same loop would
count that client-side burst as a stall of the server. Each other tenant
therefore streams from its own process, as separate tenants would, and
sends its :class:`~benchmarks.streams.StreamLog` back when stopped.
``time.monotonic`` is one clock for every process of the machine, so the
arrivals line up with the windows of the driving process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
from dataclasses import dataclass
from multiprocessing.synchronize import Event

from benchmarks.common import collector_paused
from benchmarks.streams import StreamLog, keep_streaming

#: ``spawn``: a fork of a process that runs an event loop (and maybe Ray)
#: copies its threads' locks in whatever state they were.
_CONTEXT = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class StreamSpec:
    """What one tenant streams (see :func:`benchmarks.streams.keep_streaming`)."""

    url: str
    tenant: str
    prompt: list[int]
    streams: int
    max_tokens: int
    length_spread: float = 0.0


class StreamProcess:
    """Start with :meth:`start`; :meth:`wait_streaming`; :meth:`stop` returns the log."""

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

    def stop(self, timeout: float = 120.0) -> StreamLog:
        """Stop streaming (completions in flight finish) and return every arrival."""
        self._stop.set()
        if not self._results.poll(timeout):
            self._process.kill()
            raise RuntimeError(f"{self.spec.tenant}: stream process did not stop in {timeout} s")
        status, payload = self._results.recv()
        self._process.join(10)
        if status != "ok":
            raise RuntimeError(f"{self.spec.tenant}: stream process failed: {payload}")
        return StreamLog(self.spec.tenant, payload)

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
    spec: StreamSpec, streaming: Event, stop: Event, results: multiprocessing.connection.Connection
) -> None:
    log = StreamLog(spec.tenant)
    try:
        with collector_paused():  # its own collections would read as server stalls
            asyncio.run(_stream_until(spec, log, streaming, stop))
        results.send(("ok", log.streams))
    except BaseException as exc:  # reported to the driving process, which raises it
        results.send(("error", f"{type(exc).__name__}: {exc}"))


async def _stream_until(spec: StreamSpec, log: StreamLog, streaming: Event, stop: Event) -> None:
    stopped = asyncio.Event()
    load = asyncio.create_task(
        keep_streaming(
            spec.url,
            spec.tenant,
            spec.prompt,
            log,
            stopped,
            spec.streams,
            spec.max_tokens,
            length_spread=spec.length_spread,
        )
    )
    while not stop.is_set() and not load.done():
        if not streaming.is_set() and any(arrivals for arrivals in log.streams):
            streaming.set()
        await asyncio.sleep(0.02)
    stopped.set()
    await load  # raises the load's failure, if any
