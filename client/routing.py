"""Which replica serves a request, and which replicas are healthy.

Policies are small objects with one method, ``choose``; the client asks the
:class:`ReplicaSet` for a replica and the set applies the policy to the
healthy ones. A replica that fails at the transport level is marked
unhealthy and skipped; after ``recheck_after`` seconds the next pick probes
its ``/health`` in the background and brings it back once it answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from skyrl_lora.errors import ServerUnavailableError


@dataclass
class Replica:
    url: str
    outstanding: int = 0
    healthy: bool = True
    unhealthy_since: float = 0.0
    probing: bool = False


class RoutingPolicy(Protocol):
    def choose(self, replicas: Sequence[Replica], lora_name: str | None) -> Replica: ...


class LeastOutstanding:
    """Send each request to the replica with the fewest requests in flight."""

    def choose(self, replicas: Sequence[Replica], lora_name: str | None) -> Replica:
        return min(replicas, key=lambda r: r.outstanding)


class AdapterAffinity:
    """Keep each adapter on one replica (rendezvous hashing), for warm LoRA slots
    and prefix cache; spill to the least loaded replica when the home replica
    has more than ``spill_factor`` times its share of requests in flight.

    Rendezvous hashing moves only the adapters of a replica that drops out.
    """

    def __init__(self, spill_factor: float = 2.0, min_spill: int = 8) -> None:
        self.spill_factor = spill_factor
        self.min_spill = min_spill

    def choose(self, replicas: Sequence[Replica], lora_name: str | None) -> Replica:
        least = min(replicas, key=lambda r: r.outstanding)
        if lora_name is None:
            return least
        home = max(replicas, key=lambda r: _score(lora_name, r.url))
        mean = sum(r.outstanding for r in replicas) / len(replicas)
        if home.outstanding >= max(self.min_spill, self.spill_factor * mean):
            return least
        return home


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "least_outstanding": LeastOutstanding,
    "adapter_affinity": AdapterAffinity,
}


class ReplicaSet:
    def __init__(
        self,
        urls: Sequence[str],
        policy: RoutingPolicy,
        probe: Callable[[str], Awaitable[bool]],
        recheck_after: float = 1.0,
    ) -> None:
        self.replicas = {url: Replica(url) for url in urls}
        self.policy = policy
        self._probe = probe
        self._recheck_after = recheck_after
        self._probes: set[asyncio.Task[None]] = set()  # keep references until done

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def pick(self, lora_name: str | None, prefer: str | None = None) -> Replica:
        """A healthy replica: ``prefer`` if it is healthy (a retried segment goes
        back to the replica that holds its prefix), else the policy's choice."""
        self._maybe_recheck()
        if prefer is not None and self.replicas[prefer].healthy:
            return self.replicas[prefer]
        candidates = self.healthy()
        if not candidates:
            raise ServerUnavailableError(
                f"no healthy replica among {len(self.replicas)}: " + ", ".join(self.replicas)
            )
        return self.policy.choose(candidates, lora_name)

    def mark_unhealthy(self, url: str) -> None:
        replica = self.replicas[url]
        if replica.healthy:
            replica.healthy = False
            replica.unhealthy_since = time.monotonic()

    def _maybe_recheck(self) -> None:
        now = time.monotonic()
        for replica in self.replicas.values():
            due = now - replica.unhealthy_since >= self._recheck_after
            if not replica.healthy and not replica.probing and due:
                replica.probing = True
                task = asyncio.get_running_loop().create_task(self._recheck(replica))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _recheck(self, replica: Replica) -> None:
        try:
            if await self._probe(replica.url):
                replica.healthy = True
            else:
                replica.unhealthy_since = time.monotonic()
        finally:
            replica.probing = False
