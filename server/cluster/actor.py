"""Hosts one skyrl-lora server inside a Ray actor.

Ray places the actor (and, on GPU clusters, its GPUs) and owns its lifetime;
the actor runs vLLM's engine and our HTTP server on its own event loop and
reports the URL clients should use. Multi-server deployments start several
of these (see :mod:`skyrl_lora.server.cluster.group`, which also rebuilds one that
died: :meth:`ServerActor.state` is its health check, ``start(restore=...)``
replays the group's adapters before the server takes traffic).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skyrl_lora.errors import ServerUnavailableError
from skyrl_lora.types import AdapterInfo, SettleResponse, SwapPolicy

from ..engine.gated import GatedEngine
from ..http.app import RunningServer, parse_server_args, serve
from ..http.push import load_pushed, write_pushed_files
from ..telemetry.observability import log_to_stderr
from .replay import (
    AdapterState,
    RestoreReport,
    merge,
    newest,
    restore,
    served_state,
    snapshot_files,
)


class ServerActor:
    """The actor body; wrap it with ``ray.remote`` (see :func:`start_server_actor`)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        os.environ.update(env or {})
        log_to_stderr()  # the event lines (pause, load, ...) go to the actor's log
        self._argv = list(argv)
        self._stop = asyncio.Event()
        self._running: RunningServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._max_adapter_bytes: int | None = None

    async def start(
        self, restore_to: Sequence[AdapterState] | None = None, peers: Sequence[Any] = ()
    ) -> str:
        """Start the server and return its URL once it accepts requests.

        With ``restore_to`` (a replica rebuilt by its group: the group's
        record), the adapters are brought to that state, updated with what the
        ``peers`` (the other replicas' actors) serve at that moment, before the
        HTTP server accepts anything; and once more right after it does, for a
        reload that reached the peers while this one was not listening yet.
        """
        if self._running is not None:
            return self._running.url
        ready: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()

        def on_ready(running: RunningServer) -> None:
            ready.set_result(running)

        async def before_serving(engine: GatedEngine) -> None:
            if restore_to is not None:
                await restore(engine, await _with_peers(restore_to, peers), prune=True)

        args = parse_server_args(self._argv)
        self._max_adapter_bytes = args.max_adapter_bytes
        self._task = asyncio.create_task(
            serve(args, on_ready=on_ready, stop=self._stop, before_serving=before_serving)
        )
        started: list[asyncio.Future[Any]] = [self._task, ready]
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            try:
                await self._task  # re-raises the start-up error
            except Exception as exc:  # as one picklable line: vLLM's may not pickle
                raise RuntimeError(error_line(exc)) from None
            raise RuntimeError("server exited before it was ready")
        self._running = ready.result()
        if restore_to is not None and peers:
            await self._settle(peers)
        return self._running.url

    async def _settle(self, peers: Sequence[Any], limit_s: float = 5.0) -> None:
        """Follow the peers right after the server starts listening until their
        versions hold still: a reload that reached them while this replica
        was not listening yet is taken over here, before this replica's own
        version count can fall one behind theirs (the group catches up any
        later stragglers)."""
        assert self._running is not None
        deadline = asyncio.get_running_loop().time() + limit_s
        seen: list[tuple[str, int]] | None = None
        while asyncio.get_running_loop().time() < deadline:
            target = await _with_peers((), peers)
            await restore(self._running.engine, target, prune=False, pause=False)
            now = sorted((s.lora_name, s.version) for s in target)
            if now == seen:
                return
            seen = now
            await asyncio.sleep(0.5)

    async def url(self) -> str | None:
        return None if self._running is None else self._running.url

    def _engine(self) -> GatedEngine:
        if self._running is None or self._task is None or self._task.done():
            raise ServerUnavailableError("the server is not running")
        return self._running.engine

    async def state(self) -> list[AdapterState]:
        """Health check and adapter state in one call: raises when the HTTP server
        has exited or the engine is dead (crash, OOM, killed process)."""
        import ray

        engine = self._engine()
        try:
            await engine.engine_client.check_health()
        except Exception as exc:
            raise ServerUnavailableError(f"engine is dead: {exc!r}") from exc
        return served_state(engine, origin=ray.get_runtime_context().current_actor)

    async def adapter_files(self, lora_name: str, version: int) -> dict[str, bytes]:
        """The files of one loaded version (pushed weights, for rebuilding a replica)."""
        return await asyncio.to_thread(snapshot_files, self._engine(), lora_name, version)

    async def reconcile(self, target: Sequence[AdapterState]) -> RestoreReport:
        """Catch a live replica up with its group (it missed a reload or a resume;
        a missed pause is left alone, see :func:`restore`)."""
        return await restore(self._engine(), target, prune=False, pause=False)

    async def routes(self) -> list[tuple[str, list[str]]]:
        """Every HTTP route of the running app as (path, methods), for audits."""
        app = self._running.uvicorn_server.config.app if self._running else None
        return [
            (route.path, sorted(getattr(route, "methods", None) or ["GET"]))
            for route in getattr(app, "routes", [])
            if hasattr(route, "path")
        ]

    async def push_adapter(
        self,
        lora_name: str,
        files: Mapping[str, bytes],
        swap_policy: SwapPolicy = "abort_resume",
        version: int | None = None,
        keep_previous_s: float | None = None,
    ) -> AdapterInfo:
        """Load adapter files handed over by Ray (no shared disk, no HTTP).

        ``files`` maps ``adapter_config.json`` and ``adapter_model.safetensors``
        to their bytes; passed as one ``ray.put`` ref, Ray fetches it once per
        node. Checked and loaded exactly like an HTTP push, ``--max-adapter-bytes``
        included. ``keep_previous_s``: a step of the group's atomic swap (see
        :meth:`commit` and :meth:`rollback`).
        """
        engine = self._engine()
        pushed = await asyncio.to_thread(
            write_pushed_files,
            engine.registry.upload_dir(),
            lora_name,
            files,
            None,
            swap_policy,
            version,
            keep_previous_s,
            self._max_adapter_bytes,
        )
        applied = await load_pushed(engine, pushed)
        return engine.adapter_info(lora_name, applied=applied)

    async def commit(self, lora_name: str, version: int) -> SettleResponse:
        """Commit the group's swap of ``lora_name`` to ``version`` here."""
        return self._engine().commit(lora_name, version)

    async def rollback(self, lora_name: str, version: int) -> SettleResponse:
        """Undo the group's swap of ``lora_name`` to ``version`` here (a no-op
        where it never landed)."""
        return await self._engine().rollback(lora_name, version)

    async def kill_engine(self) -> list[int]:
        """Failure drill: SIGKILL the engine's worker processes (not this actor).

        vLLM runs the engine core in child processes; the HTTP server lives on
        with a dead engine until the group notices and replaces it.
        """
        import psutil

        killed = []
        for child in psutil.Process().children(recursive=True):
            try:
                if "resource_tracker" in " ".join(child.cmdline()):
                    continue
                os.kill(child.pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):  # already gone
                continue
            killed.append(child.pid)
        return killed

    async def shutdown(self) -> None:
        """Stop accepting requests, stop the engine, and return once both are down."""
        self._stop.set()
        if self._task is not None:
            await self._task
        self._running = None


async def _with_peers(record: Sequence[AdapterState], peers: Sequence[Any]) -> list[AdapterState]:
    """``record`` updated with what the live peers serve now (dead ones are skipped)."""
    answers = await asyncio.gather(*(p.state.remote() for p in peers), return_exceptions=True)
    seen = newest(a for a in answers if isinstance(a, list))
    return list(merge({s.lora_name: s for s in record}, seen).values())


@dataclass(frozen=True)
class ActorOptions:
    """Ray resources of one server actor; ``num_gpus`` is 0 on CPU machines."""

    num_cpus: float = 1
    num_gpus: float = 0
    env: Mapping[str, str] = field(default_factory=dict)


def error_line(exc: BaseException) -> str:
    """An error in one line: the replica's own exception where Ray wraps it
    (its ``cause``), its type and message without traceback or help links."""
    cause = getattr(exc, "cause", None)
    error = cause if isinstance(cause, BaseException) else exc
    kept = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip() and not line.strip().startswith("For further information")
    ]
    return f"{type(error).__name__}: {' | '.join(kept)}"[:400]


def launch_server_actor(
    argv: Sequence[str], options: ActorOptions = ActorOptions()
) -> tuple[Any, Any]:
    """Create a server actor in the current Ray cluster and ask it to start,
    without waiting: returns (handle, the start's ``ObjectRef``, which
    ``ray.get`` turns into the URL once the server accepts requests). A
    caller that needs several servers starts them side by side."""
    import ray

    remote_cls: Any = ray.remote(ServerActor)
    handle = remote_cls.options(
        num_cpus=options.num_cpus,
        num_gpus=options.num_gpus,
        max_concurrency=16,
        runtime_env={"env_vars": dict(options.env)} if options.env else None,
    ).remote(list(argv), dict(options.env))
    return handle, handle.start.remote()


def start_server_actor(
    argv: Sequence[str], options: ActorOptions = ActorOptions()
) -> tuple[Any, str]:
    """Create a server actor in the current Ray cluster; returns (handle, url)."""
    import ray

    handle, started = launch_server_actor(argv, options)
    return handle, ray.get(started)
