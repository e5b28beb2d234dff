"""Hosts one skyrl-lora server inside a Ray actor.

Ray places the actor (and, on GPU clusters, its GPUs) and owns its lifetime;
the actor runs vLLM's engine and our HTTP server on its own event loop and
reports the URL clients should use. Multi-server deployments start several
of these; nothing here manages processes by hand.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skyrl_lora.server.app import RunningServer, parse_server_args, serve


class ServerActor:
    """The actor body; wrap it with ``ray.remote`` (see :func:`start_server_actor`)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        os.environ.update(env or {})
        self._argv = list(argv)
        self._stop = asyncio.Event()
        self._running: RunningServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start the server and return its URL once it accepts requests."""
        if self._running is not None:
            return self._running.url
        ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()

        def on_ready(running: RunningServer) -> None:
            ready.set_result(running)

        args = parse_server_args(self._argv)
        self._task = asyncio.create_task(serve(args, on_ready=on_ready, stop=self._stop))
        await asyncio.wait([self._task, ready], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            await self._task  # re-raises the start-up error
            raise RuntimeError("server exited before it was ready")
        self._running = ready.result()
        return self._running.url

    async def url(self) -> str | None:
        return None if self._running is None else self._running.url

    async def shutdown(self) -> None:
        """Stop accepting requests, stop the engine, and return once both are down."""
        self._stop.set()
        if self._task is not None:
            await self._task
        self._running = None


@dataclass(frozen=True)
class ActorOptions:
    """Ray resources of one server actor; ``num_gpus`` is 0 on CPU machines."""

    num_cpus: float = 1
    num_gpus: float = 0
    env: Mapping[str, str] = field(default_factory=dict)


def start_server_actor(
    argv: Sequence[str], options: ActorOptions = ActorOptions()
) -> tuple[Any, str]:
    """Create a server actor in the current Ray cluster; returns (handle, url)."""
    import ray

    remote_cls: Any = ray.remote(ServerActor)
    handle = remote_cls.options(
        num_cpus=options.num_cpus,
        num_gpus=options.num_gpus,
        max_concurrency=16,
        runtime_env={"env_vars": dict(options.env)} if options.env else None,
    ).remote(list(argv), dict(options.env))
    url = ray.get(handle.start.remote())
    return handle, url
