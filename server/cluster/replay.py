"""What a replica serves, and how a fresh replica is brought to the same state.

A server group rebuilds a replica that died from the adapters the other
replicas serve: every name at its newest version, loaded as exactly that
version (so a version number means the same weights on every replica), and
paused where it is paused. :func:`restore` runs inside the new replica's
process before it takes traffic.

An adapter's weights come from an :class:`AdapterSource`. Loads by path give
a :class:`PathSource` (a folder every replica can read, as the original load
needed too). Pushed weights (no shared disk) give a :class:`PushedSource`:
the files as bytes, from a Ray ``ObjectRef`` the group keeps once it has seen
the version, or until then from the replica that serves it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from skyrl_lora.errors import ConflictError

from ..adapters.snapshot_writer import wait_for_weights
from ..engine.gated import GatedEngine
from ..http.push import FILES, load_pushed, write_pushed_files
from ..http.push_stream import STREAMED_PREFIX

#: How a pushed version's ``source_path`` reads in the registry.
PUSHED_PREFIX = "push:sha256="


class AdapterSource(Protocol):
    """Where a replica gets an adapter version's files from."""

    async def install(self, engine: GatedEngine, lora_name: str, version: int) -> None:
        """Load the files into ``engine`` as exactly ``version`` of ``lora_name``."""
        ...


@dataclass(frozen=True)
class PathSource:
    """Weights in a folder every replica can read (a shared or identical filesystem)."""

    path: str

    async def install(self, engine: GatedEngine, lora_name: str, version: int) -> None:
        await engine.load(lora_name, self.path, version)


@dataclass(frozen=True)
class PushedSource:
    """Weights that were pushed as bytes: ``files`` is a Ray ``ObjectRef`` of
    ``{file name: bytes}``; without one, they are fetched from ``origin``, the
    actor of a replica that serves this version (see
    :meth:`~skyrl_lora.server.cluster.actor.ServerActor.adapter_files`)."""

    sha256: str
    files: Any = None
    origin: Any = None

    def files_ref(self, lora_name: str, version: int) -> Any:
        if self.files is not None:
            return self.files
        return self.origin.adapter_files.remote(lora_name, version)

    async def install(self, engine: GatedEngine, lora_name: str, version: int) -> None:
        files = await self.files_ref(lora_name, version)
        pushed = await asyncio.to_thread(
            write_pushed_files,
            engine.registry.upload_dir(),
            lora_name,
            files,
            self.sha256,
            "abort_resume",
            version,
        )
        await load_pushed(engine, pushed)


def source_of(source_path: str, origin: Any = None) -> AdapterSource:
    """The source a registry record's ``source_path`` stands for."""
    if source_path.startswith(PUSHED_PREFIX):
        return PushedSource(source_path.removeprefix(PUSHED_PREFIX), origin=origin)
    if source_path.startswith(STREAMED_PREFIX):  # its digest is no plain sha256 to check by
        return PushedSource("", origin=origin)
    return PathSource(source_path)


def snapshot_files(engine: GatedEngine, lora_name: str, version: int) -> dict[str, bytes]:
    """The files of one loaded version, from the server's own immutable snapshot."""
    snapshot = Path(engine.registry.record(lora_name, version).lora_request.lora_path)
    wait_for_weights(snapshot)  # a hand-over's file is written after its swap
    return {name: (snapshot / name).read_bytes() for name in FILES}


@dataclass(frozen=True)
class AdapterState:
    """One adapter as one replica serves it."""

    lora_name: str
    version: int
    source: AdapterSource
    paused: bool


@dataclass(frozen=True)
class RestoreReport:
    loaded: tuple[str, ...] = ()
    unloaded: tuple[str, ...] = ()
    paused: tuple[str, ...] = ()
    resumed: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.unloaded or self.paused or self.resumed)


def served_state(engine: GatedEngine, origin: Any = None) -> list[AdapterState]:
    """What this replica serves now (``origin``: its actor, to fetch pushed files from).

    A version a group swap has not committed yet is left out (the one it
    replaced is reported): the supervisor must neither record it nor catch
    other replicas up to it, since the group may still roll it back.
    """
    states = []
    for name in engine.registry.names():
        record = engine.committed(name)
        if record is None:  # a first load not committed yet
            continue
        source = source_of(record.source_path, origin)
        states.append(AdapterState(name, record.version, source, engine.gate.is_paused(name)))
    return states


def newest(replicas: Iterable[Sequence[AdapterState]]) -> dict[str, AdapterState]:
    """Per name, the state of the replica that serves its newest version.

    A replica that missed a reload (it was down, or a fan-out failed on it)
    is behind; the newest version is what every replica should converge to.
    """
    merged: dict[str, AdapterState] = {}
    for states in replicas:
        for state in states:
            seen = merged.get(state.lora_name)
            if seen is None or state.version > seen.version:
                merged[state.lora_name] = state
    return merged


def merge(
    record: Mapping[str, AdapterState], seen: Mapping[str, AdapterState]
) -> dict[str, AdapterState]:
    """``record`` updated with what live replicas serve now (``seen``, from
    :func:`newest`): names they all unloaded drop out, and a name never steps
    back to an older version than the record had."""
    merged = dict(seen)
    for name, state in record.items():
        if name in merged and merged[name].version < state.version:
            merged[name] = state
    return merged


async def restore(
    engine: GatedEngine, target: Sequence[AdapterState], *, prune: bool, pause: bool = True
) -> RestoreReport:
    """Bring ``engine`` to ``target``: load each name it lacks or serves at an
    older version as exactly the target version, then pause or resume it to
    match. ``prune`` also unloads names the target does not have (a fresh
    replica's start-up adapters that were unloaded since); a live replica is
    not pruned, since a name may be on its way to the others.

    ``pause=False`` (catching up a replica that already serves) only resumes:
    a pause read from the others may be stale by the time it lands, and a
    stale pause would hold that adapter's requests until the next resume,
    which may never come; a missed pause costs nothing of correctness, since
    every reload pauses the adapter itself.

    A version ahead of the target is left alone: versions never go back.
    """
    wanted = {s.lora_name: s for s in target}
    loaded, unloaded, paused, resumed = [], [], [], []
    if prune:
        for name in engine.registry.names():
            if name not in wanted:
                await engine.unload(name)
                unloaded.append(name)
    for state in target:
        name = state.lora_name
        have = engine.registry.version(name) if name in engine.registry.names() else 0
        if have < state.version:
            try:
                await state.source.install(engine, name, state.version)
            except ConflictError:  # a load from a client got there first
                continue
            loaded.append(name)
        elif have > state.version:
            continue
        if pause and state.paused and not engine.gate.is_paused(name):
            await engine.pause(name)
            paused.append(name)
        elif not state.paused and engine.gate.is_paused(name):
            engine.resume(name)
            resumed.append(name)
    return RestoreReport(tuple(loaded), tuple(unloaded), tuple(paused), tuple(resumed))
