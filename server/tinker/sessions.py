"""Tinker sessions and sampling sessions: what a sampler id stands for.

The SDK creates a session, then one sampling session per sampling client,
and names that sampling session in every ``asample``. A sampling session is
just a target: the base model, or an adapter (``tinker://<lora_name>``, its
newest version at each sample) or one version of it
(``tinker://<lora_name>/sampler_weights/<version>``). Both maps are bounded
(least recently used dropped first); a dropped sampler id answers a clear
error, and the SDK creates a new one with a new client.
"""

from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .wire import TinkerError

SCHEME = "tinker://"
_V = TypeVar("_V")
_PATH = re.compile(r"^tinker://(?P<name>[^/]+)(?:/sampler_weights/(?P<version>\d+))?/?$")


class CallerKey(Protocol):
    """The API key a request came with (``http.auth.ApiKey`` fits)."""

    @property
    def key(self) -> str: ...

    @property
    def admin(self) -> bool: ...

    def may_use(self, lora_name: str | None) -> bool: ...


def owner_of(key: CallerKey | None) -> str | None:
    """Who owns a session or future: the key itself (None when auth is off)."""
    return None if key is None else key.key


@dataclass(frozen=True)
class SamplerTarget:
    sampler_id: str
    base_model: str
    model_path: str | None
    lora_name: str | None  # None: the base model
    version: int | None  # a pinned version, or None for the newest
    owner: str | None


def parse_model_path(model_path: str) -> tuple[str, int | None]:
    """``tinker://<lora_name>[/sampler_weights/<version>]`` -> (name, version)."""
    match = _PATH.match(model_path)
    if match is None:
        raise TinkerError(
            f"model_path {model_path!r} is not one this server knows: use "
            "tinker://<lora_name> (newest version) or tinker://<lora_name>/sampler_weights/<version>"
        )
    version = match.group("version")
    return match.group("name"), None if version is None else int(version)


class SessionStore:
    """Sessions and sampling sessions, in memory, bounded."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._max = max_entries
        self._sessions: OrderedDict[str, str | None] = OrderedDict()
        self._samplers: OrderedDict[str, SamplerTarget] = OrderedDict()

    def create_session(self, key: CallerKey | None) -> str:
        session_id = f"skyrl-session-{uuid.uuid4().hex}"
        self._sessions[session_id] = owner_of(key)
        _trim(self._sessions, self._max)
        return session_id

    def check_session(self, session_id: str, key: CallerKey | None) -> None:
        if session_id not in self._sessions or not _owns(self._sessions[session_id], key):
            raise TinkerError(f"unknown session {session_id!r}", status=404)
        self._sessions.move_to_end(session_id)

    def add_sampler(
        self,
        key: CallerKey | None,
        base_model: str,
        model_path: str | None,
        lora_name: str | None,
        version: int | None,
    ) -> SamplerTarget:
        target = SamplerTarget(
            sampler_id=f"skyrl-sampler-{uuid.uuid4().hex}",
            base_model=base_model,
            model_path=model_path,
            lora_name=lora_name,
            version=version,
            owner=owner_of(key),
        )
        self._samplers[target.sampler_id] = target
        _trim(self._samplers, self._max)
        return target

    def sampler(self, sampler_id: str, key: CallerKey | None) -> SamplerTarget:
        target = self._samplers.get(sampler_id)
        if target is None or not _owns(target.owner, key):
            raise TinkerError(
                f"unknown sampling session {sampler_id!r} (expired or never created here): "
                "create a new sampling client",
                status=404,
            )
        self._samplers.move_to_end(sampler_id)
        return target


def _owns(owner: str | None, key: CallerKey | None) -> bool:
    return owner is None or (key is not None and (key.admin or key.key == owner))


def _trim(entries: OrderedDict[str, _V], limit: int) -> None:
    while len(entries) > limit:
        entries.popitem(last=False)
