"""One answer for a control call that went to every replica.

A trainer that pauses its adapter on four replicas wants one answer: how many
requests were aborted in all, and how long the slowest drain took. Each
result is still the list of the replicas' own answers (in the client's
server order), so ``(paused,) = await client.pause_generation(...)`` keeps
working with one server and the per-replica detail is always there.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from skyrl_lora.types import AbortResponse, AdapterInfo, PauseResponse

T = TypeVar("T")


class FanOutResult(list[T], Generic[T]):
    """The replicas' answers, in server order (it is a ``list``)."""

    @property
    def replicas(self) -> list[T]:
        return list(self)


class _Drains(FanOutResult[T]):
    """Totals of answers that aborted requests and waited for them to return."""

    @property
    def aborted(self) -> int:
        """Requests aborted on all replicas together."""
        return sum(r.aborted for r in self)  # type: ignore[attr-defined]

    @property
    def drain_seconds(self) -> float:
        """The slowest replica's drain: when the last aborted request had returned."""
        return max((r.drain_seconds for r in self), default=0.0)  # type: ignore[attr-defined]


class PauseResult(_Drains[PauseResponse]):
    @property
    def lora_name(self) -> str | None:
        return self[0].lora_name if self else None

    @property
    def paused(self) -> bool:
        """Whether every replica now holds the adapter (or the engine) paused."""
        return all(r.paused for r in self)

    @property
    def was_paused(self) -> bool:
        """Whether any replica had it paused already."""
        return any(r.was_paused for r in self)


class AbortResult(_Drains[AbortResponse]):
    pass


class LoadResult(FanOutResult[AdapterInfo]):
    @property
    def version(self) -> int:
        """The version now served; the newest if replicas disagree (see :attr:`consistent`)."""
        return max(r.version for r in self)

    @property
    def consistent(self) -> bool:
        """Whether every replica serves the same version."""
        return len({r.version for r in self}) <= 1
