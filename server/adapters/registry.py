"""Adapter registry: names, versions and the engine's LoRA slots.

Each load of a name gets a new version (1, 2, 3, ...; versions never repeat,
even across an unload), or the one its caller names (a trainer's step; it
must be greater than the current one, see :func:`check_version`), and its
own snapshot of the adapter's files. The
snapshot is what the engine loads, for three reasons:

* vLLM keys prefix-cache blocks on the adapter's (name, path). Reloading
  changed weights from the same path would silently reuse KV computed with
  the old weights; a per-version snapshot path keeps them apart.
* vLLM may evict an adapter from its CPU cache and later reload it from its
  path. If the trainer has overwritten that path meanwhile, the old version
  would turn into the new one behind our back; the snapshot stays immutable.
* The snapshot is taken first, without following links out of the folder,
  and only the snapshot is validated and loaded: a tenant who can write to
  its adapter folder cannot swap a file between our check and vLLM's read.
  Where the engine takes the weights file open (its workers share this
  host), that file is opened here by the same rules and handed over; the
  engine reads it once and writes the snapshot's copy from the bytes it
  staged, after the swap, so what serves is still what the snapshot holds.

Every version is registered in the engine under its own name
(``<name>@v<version>``): vLLM deduplicates the adapters of one batch by name,
so two versions of one adapter (the ``finish_old`` swap policy keeps the old
one running for the requests that started on it) need two engine names.
vLLM's OpenAI routes keep resolving the public name (``published``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import shutil
import stat
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from skyrl_lora.errors import (
    AdapterNotFoundError,
    BadRequestError,
    ConflictError,
    VersionGoneError,
)

from ..telemetry.observability import SNAPSHOTS, log_event
from .snapshot_writer import PENDING_FILE, copy_to_end, wait_for_weights, write_weights_from

logger = logging.getLogger(__name__)

#: Between an adapter's name and its version in the version's engine name.
VERSION_MARK = "@v"


def engine_name(lora_name: str, version: int) -> str:
    """The name version ``version`` of ``lora_name`` is registered under in the engine."""
    return f"{lora_name}{VERSION_MARK}{version}"


def adapter_of(name: str) -> str:
    """The adapter an engine name (:func:`engine_name`) is a version of."""
    adapter, mark, version = name.rpartition(VERSION_MARK)
    return adapter if mark and version.isdigit() else name


ADAPTER_CONFIG = "adapter_config.json"
#: The weights files whose sha256 tells a repeated version from a new one.
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoRAEngine(Protocol):
    """The part of vLLM's engine client the registry uses.

    An engine with a true ``takes_files`` attribute is also given, in
    ``stage``'s ``weights_fd``, the weights file the registry opened instead
    of copying, and writes the snapshot's copy itself (:mod:`.snapshot_writer`).
    """

    async def stage(
        self, lora_request: Any, replaces: int | None = None, weights_fd: int | None = None
    ) -> None:
        """Build the adapter ahead of ``add_lora``, off the step loop (or do nothing).

        ``replaces``: the engine id of a version none of whose requests can run
        before this one is installed; the engine may drop it at once.
        ``weights_fd``: given only to an engine that ``takes_files``.
        """

    async def discard(self, lora_id: int) -> None:
        """Forget a staging that will not be installed."""

    async def add_lora(self, lora_request: Any) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...


@dataclass(frozen=True)
class AdapterRecord:
    """One loaded version; ``lora_request`` is what the engine runs it as."""

    lora_name: str
    version: int
    source_path: str
    lora_request: Any  # vllm.lora.request.LoRARequest


@dataclass(frozen=True)
class PreparedVersion:
    """A version snapshotted and staged, not yet installed (see :meth:`AdapterRegistry.prepare`)."""

    lora_name: str
    version: int
    source_path: str
    lora_request: Any  # vllm.lora.request.LoRARequest

    @property
    def snapshot(self) -> Path:
        return Path(self.lora_request.lora_path)


class AdapterRegistry:
    """Maps adapter names to their current version and engine ``LoRARequest``.

    ``published`` is vLLM's own ``name -> LoRARequest`` table (the serving
    models' ``lora_requests``); keeping it in step makes vLLM's OpenAI routes
    resolve the same adapters as ours. Versions replaced by a ``finish_old``
    load stay registered as *draining* until the engine layer retires them.
    """

    def __init__(
        self,
        engine: LoRAEngine,
        published: dict[str, Any],
        lora_request_factory: Any,
        snapshot_root: Path | None = None,
        allowed_roots: Sequence[Path] | None = None,
    ) -> None:
        self._engine = engine
        self._published = published
        self._make_request = lora_request_factory
        self._snapshot_root = snapshot_root or Path(tempfile.mkdtemp(prefix="skyrl-lora-adapters-"))
        self._roots = [Path(r).resolve() for r in allowed_roots] if allowed_roots else None
        self._records: dict[str, AdapterRecord] = {}
        self._draining: dict[str, dict[int, AdapterRecord]] = defaultdict(dict)
        self._public_names: dict[str, str] = {}  # engine name -> public name
        self._retired: set[int] = set()  # lora_int_ids
        self._digests: dict[int, str | None] = {}  # lora_int_id -> weights sha256
        self._last_version: dict[str, int] = defaultdict(int)
        self._rolled_back: dict[tuple[str, int], int] = defaultdict(int)  # (name, version)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        used_ids = [r.lora_int_id for r in published.values()]
        self._ids = itertools.count(max(used_ids, default=0) + 1)

    # -- queries -----------------------------------------------------------
    @property
    def snapshot_root(self) -> Path:
        return self._snapshot_root

    def names(self) -> list[str]:
        return sorted(self._records)

    def get(self, lora_name: str) -> AdapterRecord:
        record = self._records.get(lora_name)
        if record is None:
            raise AdapterNotFoundError(f"LoRA adapter {lora_name!r} is not loaded")
        return record

    def record(self, lora_name: str, version: int) -> AdapterRecord:
        """The current or a draining version of ``lora_name``."""
        current = self.get(lora_name)
        if current.version == version:
            return current
        try:
            return self._draining[lora_name][version]
        except KeyError:
            raise AdapterNotFoundError(
                f"version {version} of LoRA adapter {lora_name!r} is no longer loaded"
            ) from None

    def servable(self, lora_name: str, version: int) -> AdapterRecord:
        """The record a sample pinned to ``version`` runs on: the current one or
        a replaced one not being retired (HTTP 410 otherwise; which replaced
        versions stay is the engine layer's business: in-flight requests and
        leases)."""
        current = self.get(lora_name)
        if current.version == version:
            return current
        record = self._draining.get(lora_name, {}).get(version)
        if record is None or record.lora_request.lora_int_id in self._retired:
            raise VersionGoneError(
                f"version {version} of LoRA adapter {lora_name!r} is no longer held (the "
                f"current version is {current.version}); lease a version "
                "(POST /skyrl/v1/adapters/lease) to keep it for pinned samples"
            )
        return record

    def version(self, lora_name: str) -> int:
        return self.get(lora_name).version

    def draining(self, lora_name: str) -> list[AdapterRecord]:
        return [self._draining[lora_name][v] for v in sorted(self._draining.get(lora_name, {}))]

    def engine_slots_used(self) -> int:
        """Adapter versions registered in the engine (current and draining)."""
        return len(self._records) + sum(len(d) for d in self._draining.values())

    def by_public_name(self, engine_counts: dict[str, int]) -> dict[str, int]:
        """Fold per-engine-name counts (one per version) into per-adapter counts."""
        folded: dict[str, int] = defaultdict(int)
        for engine_name, count in engine_counts.items():
            folded[self._public_names.get(engine_name, engine_name)] += count
        return dict(folded)

    def lock(self, lora_name: str) -> asyncio.Lock:
        """Serialises loads of one name (two reloads must not interleave)."""
        return self._locks[lora_name]

    # -- lifecycle ---------------------------------------------------------
    def adopt_static(self) -> None:
        """Take over adapters vLLM loaded at start-up (``--lora-modules``) as version 1."""
        for name, request in self._published.items():
            self._last_version[name] += 1
            self._records[name] = AdapterRecord(
                name, self._last_version[name], request.lora_path, request
            )
            self._public_names[request.lora_name] = name

    async def load(
        self, lora_name: str, source_path: str, version: int | None = None
    ) -> tuple[AdapterRecord, AdapterRecord | None]:
        """Load ``source_path`` as the next version of ``lora_name`` (or as
        exactly ``version``, which must be greater than the last one).

        Returns the new record and the one it replaced, which is kept as
        draining: the caller retires it (at once under a pause, or once its
        last request ends). The caller holds :meth:`lock`. On failure the
        previous version (if any) stays in service and nothing is left on disk.
        """
        prepared = await self.prepare(lora_name, source_path, version)
        if isinstance(prepared, AdapterRecord):  # the current version, repeated
            return prepared, None
        return await self.install(prepared)

    async def prepare(
        self,
        lora_name: str,
        source_path: str,
        version: int | None = None,
        replaces: int | None = None,
    ) -> PreparedVersion | AdapterRecord:
        """Snapshot ``source_path`` and stage it, without touching what serves now.

        All the slow work of a load (copying, reading, parsing, packing)
        happens here, so a reload can run it while the current version still
        serves and pause the adapter only for :meth:`install`. The caller
        holds :meth:`lock` until it installs or :meth:`abandon` s the result.
        Only when the adapter is paused and drained does the caller name the
        current version's engine id as ``replaces`` (see
        :meth:`LoRAEngine.stage`): the registry keeps its record and snapshot
        until it is retired, so a failed load still leaves it to serve.

        Naming the current version with the same weights returns its record
        instead (nothing is staged or reloaded); with other weights, 409.
        """
        if self.repeats(lora_name, version):
            folder = self.upload_dir()
            try:
                snapshot = await asyncio.to_thread(
                    snapshot_adapter_dir, source_path, folder / "adapter", self._roots
                )
                return await self._same_as_current(lora_name, snapshot)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        version = self._next_version(lora_name, version)
        target = self._snapshot_dir(lora_name, version)
        started = time.perf_counter()
        # Where the engine can take the weights file open, it reads it once
        # and writes the snapshot's copy from what it read, after the swap.
        held: dict[str, int] | None = {} if self.takes_files else None
        await asyncio.to_thread(snapshot_adapter_dir, source_path, target, self._roots, held)
        weights_fd = None if held is None else held.get(WEIGHTS_FILES[0])
        SNAPSHOTS.labels(weights="copied" if weights_fd is None else "held").inc()
        log_event(
            "adapter_snapshot",
            lora_name=lora_name,
            version=version,
            ms=round((time.perf_counter() - started) * 1000, 2),
            weights_held=weights_fd is not None,
        )
        try:
            return await self._stage(lora_name, version, target, source_path, replaces, weights_fd)
        finally:
            for fd in (held or {}).values():
                os.close(fd)

    async def prepare_owned(
        self,
        lora_name: str,
        folder: Path,
        source: str,
        version: int | None = None,
        replaces: int | None = None,
        weights_fd: int | None = None,
    ) -> PreparedVersion | AdapterRecord:
        """Like :meth:`prepare` for a folder the server wrote itself (an upload).

        The folder is moved into place (never copied) and removed on failure
        (and after a repeat of the current version). ``weights_fd``: the
        weights, open, where they are not in the folder (a streamed push's
        receive area, maybe still arriving): an engine that :attr:`takes_files`
        reads them from it and writes the snapshot's copy after the swap;
        for any other, the copy is made here, once the file is whole. The
        caller keeps the file until the version is installed or abandoned.
        """
        if self.repeats(lora_name, version):
            try:
                if weights_fd is not None:  # compared by the folder's file
                    name = WEIGHTS_FILES[0]
                    await asyncio.to_thread(write_weights_from, weights_fd, folder, name)
                return await self._same_as_current(lora_name, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        try:
            version = self._next_version(lora_name, version)
            target = self._snapshot_dir(lora_name, version)
            await asyncio.to_thread(_move_into_place, folder, target)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if weights_fd is not None and self.takes_files:
            (target / PENDING_FILE).touch()
        elif weights_fd is not None:
            try:
                await asyncio.to_thread(write_weights_from, weights_fd, target, WEIGHTS_FILES[0])
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            weights_fd = None
        return await self._stage(lora_name, version, target, source, replaces, weights_fd)

    @property
    def takes_files(self) -> bool:
        """Whether the engine reads a weights file handed to it open (see
        :class:`LoRAEngine`), and writes the snapshot's copy itself."""
        return bool(getattr(self._engine, "takes_files", False))

    def upload_dir(self) -> Path:
        """A fresh folder beside the snapshots (same file system, so moves are renames)."""
        uploads = self._snapshot_root / ".uploads"
        uploads.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=uploads))

    async def _stage(
        self,
        lora_name: str,
        version: int,
        snapshot: Path,
        source: str,
        replaces: int | None,
        weights_fd: int | None = None,
    ) -> PreparedVersion:
        request = self._make_request(
            lora_name=engine_name(lora_name, version),
            lora_int_id=next(self._ids),
            lora_path=str(snapshot),
        )
        prepared = PreparedVersion(lora_name, version, source, request)
        async with self._abandoned_on_failure(prepared):
            await self._engine.stage(request, replaces, weights_fd)
        return prepared

    def repeats(self, lora_name: str, version: int | None) -> bool:
        """Whether a load naming ``version`` names the current one (compared by weights)."""
        current = self._records.get(lora_name)
        return version is not None and current is not None and current.version == version

    async def _same_as_current(self, lora_name: str, folder: Path) -> AdapterRecord:
        """The current record if ``folder`` holds its weights, else 409."""
        current = self.get(lora_name)
        mine = await asyncio.to_thread(weights_sha256, folder)
        theirs = await self._digest(current)
        if mine is None or mine != theirs:
            raise ConflictError(
                f"adapter {lora_name!r} is already at version {current.version} with other "
                f"weights; a new version must be greater than {current.version} (repeating "
                "the current version is allowed only with the same weights)"
            )
        log_event("adapter_load_repeat", lora_name=lora_name, version=current.version)
        return current

    async def _digest(self, record: AdapterRecord) -> str | None:
        """sha256 of a loaded version's weights, from its immutable snapshot (cached)."""
        key = record.lora_request.lora_int_id
        if key not in self._digests:
            snapshot = Path(record.lora_request.lora_path)
            await asyncio.to_thread(wait_for_weights, snapshot)  # written after its swap
            self._digests[key] = await asyncio.to_thread(weights_sha256, snapshot)
        return self._digests[key]

    async def install(
        self, prepared: PreparedVersion
    ) -> tuple[AdapterRecord, AdapterRecord | None]:
        """Make a prepared version the current one (a short install in the engine).

        Returns the new record and the one it replaced (now draining).
        """
        lora_name, version, request = prepared.lora_name, prepared.version, prepared.lora_request
        async with self._abandoned_on_failure(prepared):
            await self._engine.add_lora(request)
        previous = self._records.get(lora_name)
        self._last_version[lora_name] = version
        record = AdapterRecord(lora_name, version, prepared.source_path, request)
        self._records[lora_name] = record
        self._public_names[request.lora_name] = lora_name
        self._published[lora_name] = self._make_request(
            lora_name=lora_name, lora_int_id=request.lora_int_id, lora_path=request.lora_path
        )
        if previous is not None:
            self._draining[lora_name][previous.version] = previous
        log_event("adapter_load", lora_name=lora_name, version=version, path=prepared.source_path)
        return record, previous

    def revert(
        self, lora_name: str, previous: AdapterRecord | None, last_before: int
    ) -> AdapterRecord:
        """Undo the install of the current version (a group rolls back a swap
        that failed on another replica): ``previous`` (kept, not retired) is
        current again, or the name is gone when there was none, and the name's
        newest version is ``last_before`` again, so the group may load the
        version it rolled back once more. Returns the undone record: the caller
        retires it before any other load of the name (its snapshot folder is
        the one that version number would use again).
        """
        undone = self.get(lora_name)
        if previous is None:
            del self._records[lora_name]
            self._published.pop(lora_name, None)
        else:
            self._draining.get(lora_name, {}).pop(previous.version, None)
            self._records[lora_name] = previous
            request = previous.lora_request
            self._published[lora_name] = self._make_request(
                lora_name=lora_name, lora_int_id=request.lora_int_id, lora_path=request.lora_path
            )
        self._last_version[lora_name] = last_before
        self._rolled_back[(lora_name, undone.version)] += 1
        log_event(
            "adapter_rollback",
            lora_name=lora_name,
            version=undone.version,
            to=None if previous is None else previous.version,
        )
        return undone

    def last_version(self, lora_name: str) -> int:
        """The newest version ``lora_name`` ever had here (0 if none)."""
        return self._last_version.get(lora_name, 0)

    async def abandon(self, prepared: PreparedVersion) -> None:
        """Drop a prepared version that will not be installed: its staging and snapshot."""
        try:
            await self._engine.discard(prepared.lora_request.lora_int_id)
        finally:
            shutil.rmtree(prepared.snapshot, ignore_errors=True)

    @asynccontextmanager
    async def _abandoned_on_failure(self, prepared: PreparedVersion) -> AsyncIterator[None]:
        """On any failure drop ``prepared``; an engine error becomes a logged 400."""
        try:
            yield
        except BaseException as exc:
            await self.abandon(prepared)
            if not isinstance(exc, Exception):
                raise
            log_event(
                "adapter_load_failed",
                lora_name=prepared.lora_name,
                path=prepared.source_path,
                error=str(exc),
            )
            raise BadRequestError(
                f"loading LoRA adapter {prepared.lora_name!r} from {prepared.source_path!r} "
                f"failed: {exc}"
            ) from exc

    async def unload(self, lora_name: str) -> AdapterRecord:
        """Drop the name and retire every version of it (the caller paused it)."""
        record = self.get(lora_name)
        del self._records[lora_name]
        self._published.pop(lora_name, None)
        for old in self.draining(lora_name):
            await self.retire(old)
        await self.retire(record)
        log_event("adapter_unload", lora_name=lora_name, version=record.version)
        return record

    def begin_retire(self, record: AdapterRecord) -> bool:
        """Mark a version as being retired (no pinned sample is admitted to it
        from now on); False if it already was. :meth:`retire` does the rest."""
        if record.lora_request.lora_int_id in self._retired:
            return False
        self._retired.add(record.lora_request.lora_int_id)
        self._digests.pop(record.lora_request.lora_int_id, None)
        return True

    async def retire(self, record: AdapterRecord, begun: bool = False) -> None:
        """Free a replaced version's engine slot and delete its snapshot (once).

        ``begun``: the caller already called :meth:`begin_retire`.
        """
        if not self.begin_retire(record) and not begun:
            return
        try:
            await self._engine.remove_lora(record.lora_request.lora_int_id)
        except Exception:  # the slot is reclaimed by LRU eviction anyway
            logger.warning("removing LoRA %s failed", record.lora_name, exc_info=True)
        snapshot = Path(record.lora_request.lora_path)
        if snapshot.is_relative_to(self._snapshot_root):
            await asyncio.to_thread(shutil.rmtree, snapshot, True)
        # Listed as draining until its slot and snapshot are really gone.
        self._draining.get(record.lora_name, {}).pop(record.version, None)
        self._public_names.pop(record.lora_request.lora_name, None)
        log_event("adapter_retired", lora_name=record.lora_name, version=record.version)

    def _next_version(self, lora_name: str, version: int | None) -> int:
        return check_version(lora_name, self._last_version[lora_name], version)

    def _snapshot_dir(self, lora_name: str, version: int) -> Path:
        """A version's snapshot folder; a version loaded again after a rollback
        gets a new one: vLLM keys prefix-cache blocks on (engine name, path),
        and the rolled back weights' blocks must not match the new ones."""
        again = self._rolled_back.get((lora_name, version), 0)
        return (
            self._snapshot_root
            / _safe_dirname(lora_name)
            / (f"v{version}" + (f".r{again}" if again else ""))
        )


def check_version(lora_name: str, last: int, requested: int | None) -> int:
    """The version a load gets: ``requested`` if it is above ``last`` (the
    name's newest version ever), the next one if none is named; 409 otherwise."""
    if requested is None:
        return last + 1
    if requested < 1:
        raise BadRequestError(f"version must be a positive integer, got {requested}")
    if requested <= last:
        raise ConflictError(
            f"adapter {lora_name!r} is at version {last}; version {requested} is not "
            f"greater than {last} (versions only go up; a repeat of the current version "
            "must carry the same weights)"
        )
    return requested


def weights_sha256(folder: Path) -> str | None:
    """sha256 of an adapter folder's weights file (None when it has none)."""
    for name in WEIGHTS_FILES:
        path = folder / name
        if path.is_file():
            digest = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            return digest.hexdigest()
    return None


def snapshot_adapter_dir(
    path: str,
    target: Path,
    roots: Sequence[Path] | None = None,
    held: dict[str, int] | None = None,
) -> Path:
    """Copy an adapter folder to ``target`` without following links out of it.

    The folder is resolved once and checked against ``roots``; its entries
    are then opened relative to their parent directory with ``O_NOFOLLOW``,
    so swapping a file or a sub-folder for a link after the check reads
    nothing outside. A link inside the folder (a Hugging Face cache snapshot
    links to its blobs) is followed only after its resolved target passed the
    same check. The copy, not the source, is what gets validated and loaded.
    On failure nothing is left at ``target``.

    With ``held``, the weights file (``adapter_model.safetensors``) is opened
    the same way but not copied: its descriptor goes into ``held`` (the
    caller closes it) and :data:`.snapshot_writer.PENDING_FILE` stands in
    its place until the engine writes the bytes it loaded.
    """
    source = Path(path)
    try:
        is_dir = source.is_dir()
    except OSError as exc:  # is_dir() raises for a name too long, not only False
        raise BadRequestError(f"adapter path {path!r} cannot be read: {exc.strerror}") from exc
    if not is_dir:
        raise BadRequestError(f"adapter path {path!r} is not a directory")
    resolved = _checked(source, path, roots)
    if target.exists():
        shutil.rmtree(target)
    try:
        _copy_tree(resolved, target, path, roots, held)
        if not (target / ADAPTER_CONFIG).is_file():
            raise BadRequestError(f"adapter path {path!r} has no {ADAPTER_CONFIG}")
    except OSError as exc:  # an entry changed under us (a link where a file was, ...)
        _give_up(target, held)
        raise BadRequestError(f"adapter path {path!r} could not be copied: {exc}") from exc
    except BaseException:
        _give_up(target, held)
        raise
    return target


def _give_up(target: Path, held: dict[str, int] | None) -> None:
    """Leave nothing of a failed snapshot: its folder, the files it held open."""
    shutil.rmtree(target, ignore_errors=True)
    for fd in (held or {}).values():
        os.close(fd)
    if held:
        held.clear()


def _move_into_place(folder: Path, target: Path) -> None:
    if not (folder / ADAPTER_CONFIG).is_file():
        raise BadRequestError(f"the adapter has no {ADAPTER_CONFIG}")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    folder.rename(target)


def _checked(path: Path, shown: str, roots: Sequence[Path] | None) -> Path:
    resolved = path.resolve()
    if roots is not None and not _inside(resolved, roots):
        raise BadRequestError(
            f"adapter path {shown!r} leads outside the allowed adapter roots "
            f"({', '.join(map(str, roots))}): {resolved}"
        )
    return resolved


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _copy_tree(
    source: Path,
    target: Path,
    shown: str,
    roots: Sequence[Path] | None,
    held: dict[str, int] | None = None,
) -> None:
    """Copy ``source`` into ``target``; ``held``: keep the weights file open instead."""
    target.mkdir(parents=True)
    dir_fd = os.open(source, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    try:
        for name in os.listdir(dir_fd):
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                real = _checked(source / name, shown, roots)
                if real.is_dir():
                    _copy_tree(real, target / name, shown, roots)
                    continue
                fd = os.open(real, os.O_RDONLY | _NOFOLLOW)
            elif stat.S_ISDIR(info.st_mode):
                _copy_tree(source / name, target / name, shown, roots)
                continue
            else:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
            if held is not None and name == WEIGHTS_FILES[0]:
                _hold_file(fd, target / name, shown, held)
            else:
                _copy_file(fd, target / name, shown)
    finally:
        os.close(dir_fd)


def _copy_file(fd: int, target: Path, shown: str) -> None:
    with os.fdopen(fd, "rb") as src:
        _check_regular(src.fileno(), target, shown)
        with open(target, "wb") as dst:
            copy_to_end(src.fileno(), dst.fileno())


def _hold_file(fd: int, target: Path, shown: str, held: dict[str, int]) -> None:
    """Keep the weights file open for the engine, which reads it and writes
    ``target`` from what it read (:mod:`.snapshot_writer`)."""
    try:
        _check_regular(fd, target, shown)
        (target.parent / PENDING_FILE).touch()
    except BaseException:
        os.close(fd)
        raise
    held[target.name] = fd


def _check_regular(fd: int, target: Path, shown: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise BadRequestError(f"adapter path {shown!r} holds {target.name!r}, not a file")


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _safe_dirname(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"
