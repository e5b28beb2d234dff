"""Adapter registry: names, versions and the engine's LoRA slots.

Each load of a name gets a new version (1, 2, 3, ...; versions never repeat,
even across an unload) and a fresh snapshot of the adapter's files. The
snapshot is what the engine loads, for two reasons:

* vLLM keys prefix-cache blocks on the adapter's (name, path). Reloading
  changed weights from the same path would silently reuse KV computed with
  the old weights; a per-version snapshot path keeps them apart.
* vLLM may evict an adapter from its CPU cache and later reload it from its
  path. If the trainer has overwritten that path meanwhile, the old version
  would turn into the new one behind our back; the snapshot stays immutable.

A reload swaps the engine's ``LoRARequest`` for the name under the adapter's
pause (see :mod:`skyrl_lora.server.gate`), so no request spans two versions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from skyrl_lora.errors import AdapterNotFoundError, BadRequestError, ConflictError
from skyrl_lora.server.observability import log_event

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


class LoRAEngine(Protocol):
    """The part of vLLM's engine client the registry uses."""

    async def add_lora(self, lora_request: Any) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...


@dataclass(frozen=True)
class AdapterRecord:
    lora_name: str
    version: int
    source_path: str
    lora_request: Any  # vllm.lora.request.LoRARequest


class AdapterRegistry:
    """Maps adapter names to their current version and engine ``LoRARequest``.

    ``published`` is vLLM's own ``name -> LoRARequest`` table (the serving
    models' ``lora_requests``); keeping it in step makes vLLM's OpenAI routes
    resolve the same adapters as ours.
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
        self._last_version: dict[str, int] = defaultdict(int)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        used_ids = [r.lora_int_id for r in published.values()]
        self._ids = itertools.count(max(used_ids, default=0) + 1)

    # -- queries -----------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._records)

    def get(self, lora_name: str) -> AdapterRecord:
        record = self._records.get(lora_name)
        if record is None:
            raise AdapterNotFoundError(f"LoRA adapter {lora_name!r} is not loaded")
        return record

    def version(self, lora_name: str) -> int:
        return self.get(lora_name).version

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

    async def load(
        self, lora_name: str, source_path: str, version: int | None = None
    ) -> AdapterRecord:
        """Load ``source_path`` as the next version of ``lora_name`` (or as
        exactly ``version``, which must be greater than the last one).

        The caller holds :meth:`lock` and, for a reload, the adapter's pause.
        On failure the previous version (if any) stays in service.
        """
        last = self._last_version[lora_name]
        if version is not None and version <= last:
            raise ConflictError(
                f"adapter {lora_name!r} was already at version {last}; "
                f"cannot load version {version}"
            )
        source = validate_adapter_dir(source_path, self._roots)
        version = last + 1 if version is None else version
        snapshot = await asyncio.to_thread(self._snapshot, source, lora_name, version)
        request = self._make_request(
            lora_name=lora_name, lora_int_id=next(self._ids), lora_path=str(snapshot)
        )
        try:
            await self._engine.add_lora(request)
        except Exception as exc:
            shutil.rmtree(snapshot, ignore_errors=True)
            log_event("adapter_load_failed", lora_name=lora_name, path=source_path, error=str(exc))
            raise BadRequestError(
                f"loading LoRA adapter {lora_name!r} from {source_path!r} failed: {exc}"
            ) from exc
        previous = self._records.get(lora_name)
        self._last_version[lora_name] = version
        record = AdapterRecord(lora_name, version, str(source), request)
        self._records[lora_name] = record
        self._published[lora_name] = request
        if previous is not None:
            await self._retire(previous)
        log_event("adapter_load", lora_name=lora_name, version=version, path=str(source))
        return record

    async def unload(self, lora_name: str) -> AdapterRecord:
        record = self.get(lora_name)
        del self._records[lora_name]
        self._published.pop(lora_name, None)
        await self._retire(record)
        log_event("adapter_unload", lora_name=lora_name, version=record.version)
        return record

    async def _retire(self, record: AdapterRecord) -> None:
        try:
            await self._engine.remove_lora(record.lora_request.lora_int_id)
        except Exception:  # the slot is reclaimed by LRU eviction anyway
            logger.warning("removing LoRA %s failed", record.lora_name, exc_info=True)
        snapshot = Path(record.lora_request.lora_path)
        if snapshot.is_relative_to(self._snapshot_root):
            await asyncio.to_thread(shutil.rmtree, snapshot, True)

    def _snapshot(self, source: Path, lora_name: str, version: int) -> Path:
        target = self._snapshot_root / _safe_dirname(lora_name) / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target)
        return target


def validate_adapter_dir(path: str, roots: Sequence[Path] | None = None) -> Path:
    """Fail early, with a message a trainer can act on, on a path that cannot load.

    With ``roots``, the folder and every file in it must resolve (symlinks
    followed, ``..`` collapsed) to somewhere under one of them: a tenant must
    not be able to make the server read files outside the adapter store.
    """
    source = Path(path)
    if not source.is_dir():
        raise BadRequestError(f"adapter path {path!r} is not a directory")
    resolved = source.resolve()
    if roots is not None:
        escaped = [p for p in [resolved, *resolved.rglob("*")] if not _inside(p.resolve(), roots)]
        if escaped:
            raise BadRequestError(
                f"adapter path {path!r} leads outside the allowed adapter roots "
                f"({', '.join(map(str, roots))}): {escaped[0]}"
            )
    if not (resolved / ADAPTER_CONFIG).is_file():
        raise BadRequestError(f"adapter path {path!r} has no {ADAPTER_CONFIG}")
    return resolved


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _safe_dirname(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"
