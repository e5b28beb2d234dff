"""Leases: which adapter versions a trainer asked to keep, and until when.

A rollout pinned to the version it started on (``lora_version`` on a sample)
needs that version loaded after the trainer has moved on. A lease keeps it:
while one is held the version is never retired, and a sample may name it.
Every lease has a time to live, so a trainer that crashes leaks nothing; the
engine layer retires a version once its last lease ended and no request runs
on it.

The table is pure bookkeeping (the clock is passed in), so it is tested on
its own; :class:`~skyrl_lora.server.engine.gated.GatedEngine` owns the
timers and the retiring.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from skyrl_lora.errors import ConflictError, LeaseNotFoundError

#: ``--max-versions-per-adapter`` default: the current version and up to three
#: leased older ones (TRL keeps ``max_staleness + 1`` versions; 3 covers the
#: staleness RL runs use without holding a growing pile of snapshots).
DEFAULT_MAX_VERSIONS_PER_ADAPTER = 4


@dataclass(frozen=True)
class Lease:
    lease_id: str
    lora_name: str
    version: int
    expires_at: float  # on the clock the table is given

    def expires_in(self, now: float) -> float:
        return max(0.0, self.expires_at - now)


class LeaseTable:
    """Leases by id, bounded per adapter.

    ``max_versions`` bounds the versions an adapter holds because of leases:
    the distinct leased versions plus one for the current version (which a
    later load may replace while the leases keep the old ones) never exceed
    it, so a lease that would make that count larger is refused (409). A
    second lease on an already leased version costs nothing.
    """

    def __init__(self, max_versions: int = DEFAULT_MAX_VERSIONS_PER_ADAPTER) -> None:
        if max_versions < 1:
            raise ValueError("max_versions must be at least 1 (the current version)")
        self.max_versions = max_versions
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, lora_name: str, version: int, ttl_s: float, now: float) -> Lease:
        """A new lease on ``version`` of ``lora_name`` for ``ttl_s`` seconds."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        leased = self.versions(lora_name)
        if version not in leased and len(leased) + 1 > self.max_versions - 1:
            raise ConflictError(
                f"adapter {lora_name!r} already has leases on versions "
                f"{', '.join(map(str, sorted(leased)))}: a lease on version {version} would "
                f"hold more than --max-versions-per-adapter={self.max_versions} versions "
                "with the current one; release a lease first"
            )
        lease = Lease(f"lease-{secrets.token_hex(12)}", lora_name, version, now + ttl_s)
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFoundError(
                f"no lease {lease_id!r}: it expired, was released, or never existed here"
            )
        return lease

    def release(self, lease_id: str) -> Lease:
        lease = self.get(lease_id)
        del self._leases[lease_id]
        return lease

    def expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose time is up."""
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone

    def drop_adapter(self, lora_name: str) -> list[Lease]:
        """Remove every lease on an adapter (it was unloaded)."""
        gone = [lease for lease in self._leases.values() if lease.lora_name == lora_name]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone

    def drop_version(self, lora_name: str, version: int) -> list[Lease]:
        """Remove every lease on one version (a group rolled it back)."""
        gone = [
            lease
            for lease in self._leases.values()
            if lease.lora_name == lora_name and lease.version == version
        ]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone

    def versions(self, lora_name: str) -> set[int]:
        """The versions of ``lora_name`` some lease keeps."""
        return {lease.version for lease in self._leases.values() if lease.lora_name == lora_name}

    def is_leased(self, lora_name: str, version: int) -> bool:
        return any(
            lease.lora_name == lora_name and lease.version == version
            for lease in self._leases.values()
        )
