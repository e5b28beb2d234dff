"""Client configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientConfig:
    """Timeouts and limits of a :class:`~skyrl_lora.client.RemoteInferenceClient`.

    ``sample_timeout`` is ``None`` by default because a sample may legitimately
    wait at a paused adapter's gate for as long as a weight swap takes; set it
    to bound how long a caller can be kept waiting. Control calls (pause,
    load, ...) should finish quickly and get ``control_timeout``.
    """

    connect_timeout: float = 10.0
    sample_timeout: float | None = None
    control_timeout: float = 120.0
    max_connections: int = 0  # 0: no limit (aiohttp's default is 100)
    max_resubmits: int = 1000
    #: "least_outstanding" or "adapter_affinity" (see ``skyrl_lora.client.routing``).
    routing: str = "least_outstanding"
    #: Seconds before a replica marked unhealthy is probed again.
    recheck_after: float = 1.0
