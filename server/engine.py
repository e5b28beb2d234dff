"""Routes every generate call through the per-adapter gate.

vLLM's OpenAI routes, its token-in routes and our own all call
``engine_client.generate``. Wrapping that one method on the engine client
instance puts every request that names an adapter behind the gate, whatever
route it came from, without forking any of vLLM's serving code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from skyrl_lora.server.adapters import AdapterRecord, AdapterRegistry
from skyrl_lora.server.gate import AdapterGate, DrainResult
from skyrl_lora.server.observability import PAUSE_TO_ABORTED, log_event

#: Versions admitted while serving the current HTTP request; read by the
#: middleware that tags vLLM's own responses (see ``app.py``).
admitted_versions: ContextVar[list[int] | None] = ContextVar("admitted_versions", default=None)


class GatedEngine:
    """The gate, the registry and the raw engine client, wired together."""

    def __init__(self, engine_client: Any, gate: AdapterGate, registry: AdapterRegistry) -> None:
        self.engine_client = engine_client
        self.gate = gate
        self.registry = registry
        self.raw_generate = engine_client.generate

    def install(self) -> None:
        """Make ``engine_client.generate`` gate adapter requests."""
        self.engine_client.generate = self.generate

    @asynccontextmanager
    async def admitted(self, lora_name: str, request_id: str) -> AsyncIterator[AdapterRecord]:
        """Hold the adapter's gate for one request; yields the version to run on.

        The registry lookup happens after admission: a request that waited
        through a reload must run on the new version, and one whose adapter
        was unloaded meanwhile must fail cleanly. The pause keeps the record
        current until the admission is released.
        """
        self.registry.get(lora_name)
        admission = await self.gate.admit(lora_name, request_id)
        try:
            record = self.registry.get(lora_name)
            tags = admitted_versions.get()
            if tags is not None:
                tags.append(record.version)
            yield record
        finally:
            self.gate.release(admission)

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *args: Any,
        lora_request: Any = None,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """Drop-in for ``AsyncLLM.generate`` that passes adapter requests through the gate."""
        if lora_request is None:
            async for output in self.raw_generate(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                yield output
            return
        async with self.admitted(lora_request.lora_name, request_id) as record:
            async for output in self.raw_generate(
                prompt,
                sampling_params,
                request_id,
                *args,
                lora_request=record.lora_request,
                **kwargs,
            ):
                yield output

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            await self.engine_client.abort(list(request_ids))

    async def pause(self, lora_name: str) -> tuple[bool, DrainResult]:
        self.registry.get(lora_name)
        was_paused, drain = await self.gate.pause(lora_name, self.abort_requests)
        _record_drain("pause", lora_name, drain, was_paused=was_paused)
        return was_paused, drain

    def resume(self, lora_name: str) -> bool:
        self.registry.get(lora_name)
        was_paused = self.gate.resume(lora_name)
        log_event("resume", lora_name=lora_name, was_paused=was_paused)
        return was_paused

    async def abort(self, lora_name: str) -> DrainResult:
        self.registry.get(lora_name)
        drain = await self.gate.abort(lora_name, self.abort_requests)
        _record_drain("abort", lora_name, drain)
        return drain

    async def load(self, lora_name: str, lora_path: str, version: int | None = None) -> int:
        """Load or reload; a reload performs the pause itself if the caller did not."""
        async with self.registry.lock(lora_name):
            if lora_name not in self.registry.names():
                return (await self.registry.load(lora_name, lora_path, version)).version
            paused_here = not self.gate.is_paused(lora_name)
            if paused_here:
                await self.pause(lora_name)
            try:
                return (await self.registry.load(lora_name, lora_path, version)).version
            finally:
                if paused_here:
                    self.resume(lora_name)

    async def unload(self, lora_name: str) -> None:
        """Pause, drop the adapter, then open its gate again.

        Requests held on the gate wake up and fail with "adapter not found"
        rather than waiting for a resume that can no longer be addressed.
        """
        async with self.registry.lock(lora_name):
            await self.pause(lora_name)
            try:
                await self.registry.unload(lora_name)
            finally:
                self.gate.resume(lora_name)
            self.gate.forget(lora_name)


def _record_drain(event: str, lora_name: str, drain: DrainResult, **fields: Any) -> None:
    """Metric and event line for one pause or abort."""
    if drain.aborted:
        PAUSE_TO_ABORTED.observe(drain.seconds)
    log_event(
        event,
        lora_name=lora_name,
        aborted=drain.aborted,
        drain_ms=round(drain.seconds * 1000, 2),
        **fields,
    )
