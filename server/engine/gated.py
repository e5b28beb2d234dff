"""Routes every generate call through the per-adapter gate.

vLLM's OpenAI routes, its token-in routes and our own all call
``engine_client.generate``. Wrapping that one method on the engine client
instance puts every request that names an adapter behind the gate, whatever
route it came from, without forking any of vLLM's serving code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from skyrl_lora.errors import (
    AdapterNotFoundError,
    BadRequestError,
    InternalServerError,
    LeaseNotFoundError,
)
from skyrl_lora.types import AdapterInfo, DrainingVersion, SettleResponse, SwapPolicy

from .. import compat
from ..adapters.leases import Lease, LeaseTable
from ..adapters.registry import AdapterRecord, AdapterRegistry, PreparedVersion
from ..telemetry.observability import PAUSE_TO_ABORTED, log_event
from .gate import AdapterGate, DrainResult

#: Snapshots and stages the next version of an adapter (see ``AdapterRegistry.prepare``);
#: its argument is the ``replaces`` id the registry passes on to the engine. It
#: returns the current record instead when the call repeats the current version.
Preparer = Callable[[int | None], Awaitable[PreparedVersion | AdapterRecord]]

#: Versions admitted while serving the current HTTP request; read by the
#: middleware that tags vLLM's own responses (see ``app.py``).
admitted_versions: ContextVar[list[int] | None] = ContextVar("admitted_versions", default=None)


@dataclass
class PendingSwap:
    """A version installed as one step of a group's atomic swap, not committed yet.

    ``previous`` (None for a first load) is kept loaded, never retired, so a
    rollback can make it current again; ``last_before`` is the name's newest
    version before the load, which a rollback restores.
    """

    version: int
    previous: AdapterRecord | None
    last_before: int
    timer: asyncio.TimerHandle


class GatedEngine:
    """The gate, the registry and the raw engine client, wired together."""

    def __init__(
        self,
        engine_client: Any,
        gate: AdapterGate,
        registry: AdapterRegistry,
        max_loras: int,
        leases: LeaseTable | None = None,
    ) -> None:
        self.engine_client = engine_client
        self.gate = gate
        self.registry = registry
        self.max_loras = max_loras
        self.leases = leases or LeaseTable()
        self.raw_generate = engine_client.generate
        self._background: set[asyncio.Task[None]] = set()
        self._lease_timers: dict[str, asyncio.TimerHandle] = {}
        self._pending: dict[str, PendingSwap] = {}  # by adapter name

    def install(self) -> None:
        """Make ``engine_client.generate`` gate adapter requests."""
        self.engine_client.generate = self.generate

    @asynccontextmanager
    async def admitted(
        self,
        lora_name: str,
        request_id: str,
        version: int | None = None,
        prefill_tokens: int | None = None,
    ) -> AsyncIterator[AdapterRecord]:
        """Hold the adapter's gate for one request; yields the version to run on.

        The version is the one current at admission: a request that waited
        through a reload runs on the new version, one whose adapter was
        unloaded meanwhile fails cleanly, and one admitted before a
        ``finish_old`` load keeps its version to the end. When the last
        request of a replaced version ends, that version is retired. A
        request a pause or abort ended leaves after its answer's pace
        (:class:`~skyrl_lora.server.engine.gate.AnswerPacing`), once released.

        A request pinned to ``version`` runs on that version only: while it
        is current, draining, or leased; else it fails with HTTP 410, also
        when the version went away while it was held. A name that is not
        loaded is held while it is paused (a trainer paused it before its
        first load) and fails with 404 otherwise. ``prefill_tokens`` paces it
        after a resume (:class:`~skyrl_lora.server.engine.gate.ResumePacing`).
        """
        if version is not None:
            self.registry.servable(lora_name, version)
        elif not self.gate.is_paused(lora_name):
            self.registry.get(lora_name)
        try:
            admission = await self.gate.admit(lora_name, request_id, version, prefill_tokens)
        except AdapterNotFoundError:  # paused before a load that never came
            self.gate.forget(lora_name)
            raise
        try:
            if version is not None:
                record = self.registry.servable(lora_name, version)
            else:
                record = self.registry.record(lora_name, admission.version)
            tags = admitted_versions.get()
            if tags is not None:
                tags.append(record.version)
            yield record
        finally:
            self.gate.release(admission)
            self._retire_if_drained(lora_name, admission.version)
        if admission.answer_after_s:  # ended by a pause or abort: answer at its pace
            await asyncio.sleep(admission.answer_after_s)

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
        tokens = compat.prompt_token_count(prompt)
        if tokens is not None:
            tokens *= getattr(sampling_params, "n", 1) or 1
        async with self.admitted(lora_request.lora_name, request_id, None, tokens) as record:
            async for output in self.raw_generate(
                prompt,
                sampling_params,
                request_id,
                *args,
                lora_request=record.lora_request,
                **kwargs,
            ):
                yield output

    async def final_output(self, prompt: Any, params: Any, request_id: str, lora: Any) -> Any:
        """Run one already-admitted request to its last output.

        vLLM raises the caller's mistakes (a token outside the vocabulary, a
        prompt too long) as plain exceptions; they become a 400 with vLLM's
        message instead of a 500.
        """
        final = None
        try:
            async for output in self.raw_generate(prompt, params, request_id, lora_request=lora):
                final = output
        except compat.client_error_types() as exc:
            raise BadRequestError(str(exc)) from exc
        if final is None:
            raise InternalServerError("the engine returned no output")
        return final

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        await compat.abort_requests(self.engine_client, list(request_ids))

    async def pause(self, lora_name: str) -> tuple[bool, DrainResult]:
        """Pause an adapter, also one not loaded yet (its samples are held
        until it is loaded and resumed)."""
        was_paused, drain = await self.gate.pause(lora_name, self.abort_requests)
        _record_drain("pause", lora_name, drain, was_paused=was_paused)
        return was_paused, drain

    def resume(self, lora_name: str) -> bool:
        if not self.gate.is_paused(lora_name):
            self.registry.get(lora_name)
        was_paused = self.gate.resume(lora_name)
        if lora_name not in self.registry.names():
            self.gate.forget(lora_name)  # kept while requests are held: the last one forgets
        log_event("resume", lora_name=lora_name, was_paused=was_paused)
        return was_paused

    async def abort(self, lora_name: str) -> DrainResult:
        self.registry.get(lora_name)
        drain = await self.gate.abort(lora_name, self.abort_requests)
        _record_drain("abort", lora_name, drain)
        return drain

    async def load(
        self,
        lora_name: str,
        lora_path: str,
        version: int | None = None,
        policy: SwapPolicy = "abort_resume",
        keep_previous_s: float | None = None,
    ) -> SwapPolicy | None:
        """Load or reload from a folder; see :meth:`swap` for the policies."""
        return await self.swap(
            lora_name,
            policy,
            lambda replaces: self.registry.prepare(lora_name, lora_path, version, replaces),
            keep_previous_s,
        )

    async def swap(
        self,
        lora_name: str,
        policy: SwapPolicy,
        prepare: Preparer,
        keep_previous_s: float | None = None,
    ) -> SwapPolicy | None:
        """Install a new version of ``lora_name`` under ``policy``; returns the policy
        applied, or None when the call repeated the current version (nothing done).

        The new version is snapshotted and staged first, while the current
        one still serves: the slow part of a load (tens of ms on a GPU) never
        holds the adapter's requests. A failed load changes nothing. When the
        caller paused the adapter and nothing of it runs (a trainer's pause,
        reload, resume), the engine may drop the current version as staging
        starts (:meth:`_replaceable`), so the new one takes its engine slot.

        ``abort_resume``: then pause the adapter (unless the caller did),
        install, resume, and retire every older version in the background
        (listed as draining with nothing in flight until its slot and
        snapshot are gone). In-flight requests are aborted and resumed by the
        client on the new version.

        ``finish_old``: no pause. Requests admitted from now on run on the new
        version; those in flight finish on the old one, which is retired when
        the last of them ends. The extra version needs an engine LoRA slot of
        its own while both run: when every slot (``--max-loras``) is already
        taken by versions with requests running, vLLM would have to hold some
        tenant's requests back, possibly another tenant's, so the load falls
        back to ``abort_resume`` instead and says so in its answer.

        ``keep_previous_s``: one step of a group's atomic swap. The replaced
        version is kept (not retired, not even dropped from the engine at
        staging) until :meth:`commit`, :meth:`rollback`, the next load of the
        name, or ``keep_previous_s`` seconds, whichever comes first.
        """
        async with self.registry.lock(lora_name):
            last_before = self.registry.last_version(lora_name)
            previous = self.registry.get(lora_name) if lora_name in self.registry.names() else None
            replaces = None if keep_previous_s else self._replaceable(lora_name)
            prepared = await prepare(replaces)
            if isinstance(prepared, AdapterRecord):  # the current version, repeated
                return None
            if previous is None:
                await self.registry.install(prepared)
                self._installed(lora_name, prepared.version, None, last_before, keep_previous_s)
                return policy
            if policy == "finish_old" and not self._spare_slot_for(lora_name):
                log_event("swap_policy_fallback", lora_name=lora_name, policy="abort_resume")
                policy = "abort_resume"
            if policy == "finish_old":
                await self.registry.install(prepared)
                self._installed(lora_name, prepared.version, previous, last_before, keep_previous_s)
                self._retire_if_drained(lora_name, previous.version)
                return policy
            paused_here = not self.gate.is_paused(lora_name)
            try:
                if paused_here:
                    await self.pause(lora_name)
            except BaseException:
                await self.registry.abandon(prepared)
                raise
            try:
                await self.registry.install(prepared)
                self._installed(lora_name, prepared.version, previous, last_before, keep_previous_s)
            finally:
                if paused_here:
                    self.resume(lora_name)
            # Nothing of an older version runs (the adapter was paused): free
            # their slots and snapshots after answering, off the swap's path.
            for old in self.registry.draining(lora_name):
                self._retire_if_drained(lora_name, old.version)
            return policy

    # -- group swaps ---------------------------------------------------------
    def _installed(
        self,
        lora_name: str,
        version: int,
        previous: AdapterRecord | None,
        last_before: int,
        keep_previous_s: float | None,
    ) -> None:
        """After an install: a swap still pending for the name is committed (the
        group moved on), and this one is pending if its caller keeps the previous."""
        self._end_pending(lora_name)
        if keep_previous_s:
            timer = asyncio.get_running_loop().call_later(
                keep_previous_s, self._pending_expired, lora_name, version
            )
            self._pending[lora_name] = PendingSwap(version, previous, last_before, timer)

    def _end_pending(self, lora_name: str) -> PendingSwap | None:
        """Forget the name's pending swap (its previous version may retire now)."""
        pending = self._pending.pop(lora_name, None)
        if pending is not None:
            pending.timer.cancel()
            if pending.previous is not None:
                self._retire_if_drained(lora_name, pending.previous.version)
        return pending

    def _pending_expired(self, lora_name: str, version: int) -> None:
        pending = self._pending.get(lora_name)
        if pending is not None and pending.version == version:
            log_event("swap_commit_expired", lora_name=lora_name, version=version)
            self._end_pending(lora_name)

    def _kept(self, lora_name: str, version: int) -> bool:
        pending = self._pending.get(lora_name)
        return (
            pending is not None
            and pending.previous is not None
            and pending.previous.version == version
        )

    def committed(self, lora_name: str) -> AdapterRecord | None:
        """The version of a loaded name that is not pending a group's commit:
        the current one, or the one a pending swap keeps (None after a
        pending first load)."""
        pending = self._pending.get(lora_name)
        return self.registry.get(lora_name) if pending is None else pending.previous

    def commit(self, lora_name: str, version: int) -> SettleResponse:
        """Commit a pending swap to ``version``: its previous version is retired
        as after any load. A no-op (``changed`` False) when nothing of that
        version is pending: already committed, expired, or never kept."""
        pending = self._pending.get(lora_name)
        changed = pending is not None and pending.version == version
        if changed:
            self._end_pending(lora_name)
            log_event("swap_commit", lora_name=lora_name, version=version)
        return self._settled(lora_name, changed)

    async def rollback(self, lora_name: str, version: int) -> SettleResponse:
        """Undo a pending swap to ``version``: the version it replaced serves
        again (or the name is unloaded after a first load), ``version`` is
        retired and may be loaded again.

        The adapter is paused for the switch, so requests running on
        ``version`` are aborted and resumed by their clients on the previous
        one; samples pinned to ``version`` and its leases end (410). A no-op
        (``changed`` False) when nothing of that version is pending: the load
        never landed here, or was committed (a repeat of the current version
        is never pending: the replica had it before the group's call).
        """
        async with self.registry.lock(lora_name):
            pending = self._pending.get(lora_name)
            if pending is None or pending.version != version:
                return self._settled(lora_name, False)
            del self._pending[lora_name]
            pending.timer.cancel()
            paused_here = not self.gate.is_paused(lora_name)
            if paused_here:
                await self.pause(lora_name)
            try:
                for lease in self.leases.drop_version(lora_name, version):
                    timer = self._lease_timers.pop(lease.lease_id, None)
                    if timer is not None:
                        timer.cancel()
                undone = self.registry.revert(lora_name, pending.previous, pending.last_before)
                await self.registry.retire(undone)  # before any reload may reuse its number
            finally:
                if paused_here:
                    self.resume(lora_name)
            return self._settled(lora_name, True)

    def _settled(self, lora_name: str, changed: bool) -> SettleResponse:
        names = self.registry.names()
        version = self.registry.version(lora_name) if lora_name in names else None
        return SettleResponse(lora_name=lora_name, version=version, changed=changed)

    def engine_requests(self) -> dict[str, int]:
        """vLLM's own count of requests per adapter (all versions together)."""
        return self.registry.by_public_name(compat.engine_requests_by_lora(self.engine_client))

    def adapter_info(
        self,
        lora_name: str,
        engine_counts: dict[str, int] | None = None,
        applied: SwapPolicy | None = None,
    ) -> AdapterInfo:
        """What ``/skyrl/v1/adapters`` and a load's answer say of one adapter."""
        record = self.registry.get(lora_name)
        counts = self.engine_requests() if engine_counts is None else engine_counts
        return AdapterInfo(
            lora_name=lora_name,
            version=record.version,
            lora_path=record.source_path,
            paused=self.gate.is_paused(lora_name),
            in_flight=self.gate.in_flight(lora_name),
            held=self.gate.held(lora_name),
            engine_requests=counts.get(lora_name, 0),
            draining=[
                DrainingVersion(
                    version=r.version,
                    in_flight=self.gate.in_flight_of_version(lora_name, r.version),
                )
                for r in self.registry.draining(lora_name)
            ],
            leased=sorted(self.leases.versions(lora_name)),
            applied_swap_policy=applied,
        )

    def _replaceable(self, lora_name: str) -> int | None:
        """The current version's engine id if none of its requests can run before
        the next version is installed: the adapter is paused and drained.

        Requests arriving meanwhile wait at the gate and run on the new
        version; a resume before the install (or a failed load) admits them
        to the current one, which vLLM then reads again from its snapshot.
        """
        if lora_name not in self.registry.names():
            return None
        if not self.gate.is_paused(lora_name) or self.gate.in_flight(lora_name):
            return None
        current = self.registry.get(lora_name)
        if self.leases.is_leased(lora_name, current.version):
            return None  # pinned samples may still run on it after the swap
        return int(current.lora_request.lora_int_id)

    def _spare_slot_for(self, lora_name: str) -> bool:
        running_old = self.gate.in_flight(lora_name) > 0
        return not running_old or self.gate.busy_versions() + 1 <= self.max_loras

    def _retire_if_drained(self, lora_name: str, version: int) -> None:
        """Retire a replaced version once none of its requests is left and no
        lease keeps it. From this call on, no pinned sample is admitted to it."""
        if self.gate.in_flight_of_version(lora_name, version):
            return
        if self.leases.is_leased(lora_name, version) or self._kept(lora_name, version):
            return
        for record in self.registry.draining(lora_name):
            if record.version == version and self.registry.begin_retire(record):
                task = asyncio.create_task(self.registry.retire(record, begun=True))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    # -- leases --------------------------------------------------------------
    def lease(self, lora_name: str, version: int | None, ttl_s: float) -> Lease:
        """Keep ``version`` (default: the current one) of ``lora_name`` loaded for
        ``ttl_s`` seconds, for samples pinned to it (see :mod:`..adapters.leases`).

        The version must still be held (410 otherwise); the lease ends on its
        own after ``ttl_s``, and the version is retired then if it is no
        longer current and nothing runs on it.
        """
        current = self.registry.get(lora_name)
        record = self.registry.servable(lora_name, current.version if version is None else version)
        loop = asyncio.get_running_loop()
        lease = self.leases.grant(lora_name, record.version, ttl_s, loop.time())
        self._lease_timers[lease.lease_id] = loop.call_later(
            ttl_s, self._lease_ended, lease.lease_id, "expired"
        )
        log_event("lease", lora_name=lora_name, version=record.version, ttl_s=ttl_s)
        return lease

    def release_lease(self, lease_id: str) -> Lease:
        """End a lease before its time (404 for an unknown or ended one)."""
        self.leases.get(lease_id)
        lease = self._lease_ended(lease_id, "released")
        assert lease is not None
        return lease

    def lease_expires_in(self, lease: Lease) -> float:
        return lease.expires_in(asyncio.get_running_loop().time())

    def _lease_ended(self, lease_id: str, why: str) -> Lease | None:
        timer = self._lease_timers.pop(lease_id, None)
        if timer is not None:
            timer.cancel()
        try:
            lease = self.leases.release(lease_id)
        except LeaseNotFoundError:  # ended meanwhile (released, or its adapter unloaded)
            return None
        log_event(f"lease_{why}", lora_name=lease.lora_name, version=lease.version)
        self._retire_if_drained(lease.lora_name, lease.version)
        return lease

    async def unload(self, lora_name: str) -> None:
        """Pause, drop the adapter, then open its gate again.

        Requests held on the gate wake up and fail with "adapter not found"
        rather than waiting for a resume that can no longer be addressed.
        """
        self.registry.get(lora_name)  # 404 before any pause: pausing an unknown name is allowed
        async with self.registry.lock(lora_name):
            await self.pause(lora_name)
            pending = self._pending.pop(lora_name, None)
            if pending is not None:
                pending.timer.cancel()
            for lease in self.leases.drop_adapter(lora_name):
                timer = self._lease_timers.pop(lease.lease_id, None)
                if timer is not None:
                    timer.cancel()
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
