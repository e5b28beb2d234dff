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
    #: After this client resumes an adapter, its retries held by the client's
    #: gate go out one per ``resume_spacing_s``, the rest at
    #: ``resume_window_s``: about the server's own pacing of a resumed
    #: adapter (``ResumePacing``: up to 256 prefill tokens per engine step
    #: for 0.25 s), so they arrive spread out rather than all in one turn of
    #: the server's event loop. On an H100 that loop, which
    #: streams every tenant's tokens, stalled 13-20 ms right after each
    #: resume, when 16 such retries all arrived at once.
    #: ``resume_spacing_s=0`` sends them at once.
    resume_spacing_s: float = 0.005
    resume_window_s: float = 0.25
    #: A load or push over several servers is atomic (see
    #: ``RemoteInferenceClient.load_lora_adapter``): each server keeps its
    #: previous version until this client commits or rolls back, or for this
    #: many seconds if the client dies in between (then it commits by itself).
    commit_timeout_s: float = 600.0
    #: Send a push's weights over a server's push stream where it has one
    #: (``serve`` opens it unless ``--no-push-stream``; its port is
    #: ``ServerInfo.push_stream_port``), not in the HTTP body: about 2.5x the
    #: bytes per second (see ``skyrl_lora.server.http.push_stream``). False:
    #: always the HTTP body.
    push_stream: bool = True
    #: Connections a streamed push asks for (the server grants at most its
    #: ``max_lanes``): each lane's bytes are copied by the kernel on the core
    #: of the thread that sends or reads it.
    push_stream_lanes: int = 4
