"""The ``/skyrl/v1`` routes added to vLLM's OpenAI server."""

from __future__ import annotations

import json
import shutil
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from skyrl_lora.errors import (
    BadRequestError,
    ConflictError,
    PermissionDeniedError,
    PushStreamUnavailableError,
    ServerError,
)
from skyrl_lora.types import (
    AbortResponse,
    AdapterInfo,
    AdapterList,
    AdapterRef,
    ErrorBody,
    ErrorDetail,
    HandoverRequest,
    LeaseRequest,
    LeaseResponse,
    LoadAdapterRequest,
    PauseRequest,
    PauseResponse,
    PushStreamRequest,
    PushStreamTicket,
    SampleRequest,
    SampleResponse,
    ServerInfo,
    SettleResponse,
    SwapPolicy,
    VersionRef,
)

from .. import compat
from ..adapters.leases import Lease
from ..engine.gated import GatedEngine
from ..engine.global_pause import GlobalPause
from ..telemetry.observability import PUSHED_BYTES, log_event
from ..transfer.handover import NO_HANDOVERS, HandoverAccess, write_handover
from .auth import ApiKey, request_key
from .push import (
    CONFIG_FILE,
    PUSH_FORM_SCHEMA,
    WEIGHTS_FILE,
    PushedAdapter,
    load_pushed,
    payload_too_large,
    receive_push,
)
from .push_assembly import OpenedPush
from .push_shared import load_shared
from .push_stream_process import PushStream
from .sample import Sampler

PREFIX = "/skyrl/v1"

_ERRORS = {
    400: {"model": ErrorBody, "description": "invalid request"},
    401: {"model": ErrorBody, "description": "missing or unknown API key"},
    403: {"model": ErrorBody, "description": "API key not allowed this adapter or operation"},
    404: {"model": ErrorBody, "description": "unknown adapter"},
}

#: The answer of a weights route to an adapter above ``--max-adapter-bytes``.
_TOO_LARGE = {"model": ErrorBody, "description": "adapter above --max-adapter-bytes"}


def error_response(exc: ServerError) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(type=exc.error_type, message=exc.message))
    return JSONResponse(body.model_dump(), status_code=exc.status)


def _check_may_load(key: ApiKey | None, lora_name: str, names: list[str]) -> None:
    """Tenant keys may reload their own existing adapters (as an exact version
    too: a trainer names its steps); new names are for admins."""
    if key is None or key.admin:
        return
    if lora_name not in names:
        raise PermissionDeniedError(
            f"loading the new adapter name {lora_name!r} needs an admin key"
        )
    if not key.may_use(lora_name):
        raise PermissionDeniedError(f"this API key may not use adapter {lora_name!r}")


def _check_may_pause(key: ApiKey | None, lora_name: str, names: list[str]) -> None:
    """Pausing a name before its first load is for keys that may load it."""
    if key is not None and not key.admin and lora_name not in names:
        raise PermissionDeniedError(
            f"adapter {lora_name!r} is not loaded; pausing it before its first load "
            "needs a key that may load it (an admin key)"
        )


def engine_global_pause(engine: GatedEngine) -> GlobalPause:
    """The engine's keep-mode pause, held by name; one per server, shared by
    ``/skyrl/v1/pause`` and SkyRL's ``/pause`` (``skyrl_routes``)."""
    return GlobalPause(
        pause_engine=lambda: compat.pause_engine_keep(engine.engine_client),
        resume_engine=lambda: compat.resume_engine(engine.engine_client),
    )


def build_router(
    engine: GatedEngine,
    sampler: Sampler,
    info: ServerInfo,
    max_adapter_bytes: int,
    handovers: HandoverAccess = NO_HANDOVERS,
    push_stream: PushStream | None = None,
    global_pause: GlobalPause | None = None,
) -> APIRouter:
    router = APIRouter(prefix=PREFIX, tags=["skyrl"], responses=_ERRORS)  # type: ignore[arg-type]

    adapter_info = engine.adapter_info

    def answered(
        route: str, lora_name: str, applied: SwapPolicy | None, started: float
    ) -> AdapterInfo:
        """A weights call's answer, and its time in the route as a
        ``weights_answered`` event: with the ``adapter_staged`` event's
        ``stage_ms`` it splits a sync into the API's work before the
        staging, the staging, and the answer after it."""
        info = adapter_info(lora_name, applied=applied)
        ms = round((time.perf_counter() - started) * 1000, 2)
        log_event("weights_answered", route=route, lora_name=lora_name, version=info.version, ms=ms)
        return info

    global_pause = global_pause or engine_global_pause(engine)

    @router.post("/sample")
    async def sample(body: SampleRequest) -> SampleResponse:
        """Token-in/token-out sampling; held while the adapter is paused."""
        return await sampler.sample(body)

    @router.post("/abort_lora_requests")
    async def abort_lora_requests(body: AdapterRef) -> AbortResponse:
        """Abort every in-flight request of one adapter and wait until they returned."""
        drain = await engine.abort(body.lora_name)
        return AbortResponse(
            lora_name=body.lora_name, aborted=drain.aborted, drain_seconds=drain.seconds
        )

    @router.post("/pause")
    async def pause(body: PauseRequest, request: Request) -> PauseResponse:
        """Pause one adapter (hold new, abort in-flight), or the whole engine in keep mode."""
        if body.lora_name is None:
            was_paused = await global_pause.pause(body.holder)
            return PauseResponse(
                lora_name=None, paused=True, was_paused=was_paused, holders=global_pause.holders
            )
        _check_may_pause(request_key(request.scope), body.lora_name, engine.registry.names())
        was_paused, drain = await engine.pause(body.lora_name)
        return PauseResponse(
            lora_name=body.lora_name,
            paused=True,
            was_paused=was_paused,
            aborted=drain.aborted,
            drain_seconds=drain.seconds,
        )

    @router.post("/resume")
    async def resume(body: PauseRequest) -> PauseResponse:
        """Resume one adapter, or release the caller's hold of the global pause."""
        if body.lora_name is None:
            was_paused = await compat.engine_is_paused(engine.engine_client)
            still_paused = await global_pause.resume(body.holder)
            return PauseResponse(
                lora_name=None,
                paused=still_paused,
                was_paused=was_paused,
                holders=global_pause.holders,
            )
        was_paused = engine.resume(body.lora_name)
        return PauseResponse(lora_name=body.lora_name, paused=False, was_paused=was_paused)

    @router.get("/adapters")
    async def list_adapters(request: Request) -> AdapterList:
        """Adapters this caller may use (all of them without API keys)."""
        key = request_key(request.scope)
        counts = engine.engine_requests()
        names = [n for n in engine.registry.names() if key is None or key.may_use(n)]
        return AdapterList(
            adapters=[adapter_info(n, counts) for n in names],
            engine_paused=await compat.engine_is_paused(engine.engine_client),
        )

    @router.post("/adapters/load")
    async def load_adapter(body: LoadAdapterRequest, request: Request) -> AdapterInfo:
        """Load a new adapter, or reload one in place (pausing it if the caller did not).

        With API keys, only an admin key may bring in a name not loaded yet.
        """
        started = time.perf_counter()
        _check_may_load(request_key(request.scope), body.lora_name, engine.registry.names())
        applied = await engine.load(
            body.lora_name, body.lora_path, body.version, body.swap_policy, body.keep_previous_s
        )
        return answered("load", body.lora_name, applied, started)

    @router.post(
        "/adapters/push",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"multipart/form-data": {"schema": PUSH_FORM_SCHEMA}},
            }
        },
        responses={413: _TOO_LARGE},
    )
    async def push_adapter(request: Request) -> AdapterInfo:
        """Load adapter weights sent in the body (no shared disk), as the next version.

        Same rules as a load: a tenant key may push only its own existing names.
        """
        started = time.perf_counter()
        pushed = await receive_push(
            request.headers, request.stream(), engine.registry.upload_dir(), max_adapter_bytes
        )
        try:
            _check_may_load(request_key(request.scope), pushed.lora_name, engine.registry.names())
        except BaseException:
            shutil.rmtree(pushed.folder, ignore_errors=True)
            raise
        PUSHED_BYTES.labels(via="http").inc((pushed.folder / WEIGHTS_FILE).stat().st_size)
        applied = await load_pushed(engine, pushed)
        return answered("push", pushed.lora_name, applied, started)

    @router.post(
        "/adapters/push/stream",
        responses={
            409: {"model": ErrorBody, "description": "too many pushes open"},
            413: _TOO_LARGE,
            422: {"model": ErrorBody, "description": "this server has no push stream"},
        },
    )
    async def open_push_stream(body: PushStreamRequest, request: Request) -> PushStreamTicket:
        """Open a push whose weights follow over the push stream (``serve
        --push-stream-port``) instead of in the body; answers a one-time ticket.

        Same rules as a push, checked here: the stream trusts only the ticket.
        With ``share``, the push's receive area is lent to the servers on this
        host that load it by ``.../push/shared``.
        """
        if push_stream is None:
            raise PushStreamUnavailableError(
                "this server takes pushed weights in the HTTP body only "
                "(start it with --push-stream-port to stream them)"
            )
        if body.share is not None and info.push_share_host is None:
            raise PushStreamUnavailableError(
                "this server lends no receive areas (no /dev/shm): open the push without a share"
            )
        return await push_stream.open(_opened(body, request))

    @router.post(
        "/adapters/push/shared",
        responses={
            409: {"model": ErrorBody, "description": "the push that brought the bytes failed"},
            413: _TOO_LARGE,
            422: {"model": ErrorBody, "description": "no such share on this server's host"},
        },
    )
    async def push_shared(body: PushStreamRequest, request: Request) -> AdapterInfo:
        """Load a push that another server on this host receives over its push
        stream, opened with the same body and ``share``: from its receive
        area, as it lands, instead of a stream of this server's own.

        Same rules as a push; 422 where this server lends no areas itself or
        the share is not (or no longer) on its host: stream it the push.
        """
        started = time.perf_counter()
        if info.push_share_host is None:
            raise PushStreamUnavailableError(
                "this server takes no shared pushes (no push stream or no /dev/shm)"
            )
        if body.share is None:
            raise BadRequestError("a shared push names its share")
        loaded = await load_shared(engine, _opened(body, request), body.share)
        return answered("push_shared", body.lora_name, loaded.applied_swap_policy, started)

    def _opened(body: PushStreamRequest, request: Request) -> OpenedPush:
        """A streamed push's fields checked as a push's, its config written
        into a fresh upload folder (the caller's from then on)."""
        config = json.dumps(body.config).encode()
        if body.weights_bytes + len(config) > max_adapter_bytes:
            raise payload_too_large(max_adapter_bytes, body.weights_bytes + len(config))
        _check_may_load(request_key(request.scope), body.lora_name, engine.registry.names())
        fields: dict[str, str] = {"swap_policy": body.swap_policy}
        if body.version is not None:
            fields["version"] = str(body.version)
        if body.keep_previous_s is not None:
            fields["keep_previous_s"] = str(body.keep_previous_s)
        folder = engine.registry.upload_dir()
        (folder / CONFIG_FILE).write_bytes(config)
        return OpenedPush(
            body.lora_name,
            folder,
            body.weights_bytes,
            fields,
            body.lanes,
            body.share,
            body.share_peers,
        )

    @router.post(
        "/adapters/handover",
        responses={
            413: _TOO_LARGE,
            422: {"model": ErrorBody, "description": "this server cannot open that memory"},
        },
    )
    async def handover_adapter(body: HandoverRequest, request: Request) -> AdapterInfo:
        """Load adapter weights from a trainer's memory on this host (CUDA IPC or
        shared memory), copied before the answer, as the next version.

        Same rules as a push; 422 where hand-overs are off or the memory is out
        of this server's reach (the client then pushes the bytes).
        """
        started = time.perf_counter()
        handovers.check(body, max_adapter_bytes)
        names = engine.registry.names()
        _check_may_load(request_key(request.scope), body.lora_name, names)
        if body.lora_name in names and body.version == engine.registry.version(body.lora_name):
            raise ConflictError(
                f"adapter {body.lora_name!r} is already at version {body.version}; a hand-over "
                "always makes a new version (its weights carry no digest to tell a repeat by)"
            )
        folder = engine.registry.upload_dir()
        try:
            write_handover(folder, body)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        pushed = PushedAdapter(
            body.lora_name,
            folder,
            sha256="",
            swap_policy=body.swap_policy,
            version=body.version,
            keep_previous_s=body.keep_previous_s,
            source=f"handover:{body.buffer.kind}",
        )
        applied = await load_pushed(engine, pushed)
        return answered("handover", body.lora_name, applied, started)

    @router.post("/adapters/unload")
    async def unload_adapter(body: AdapterRef) -> AdapterRef:
        await engine.unload(body.lora_name)
        return body

    @router.post("/adapters/commit")
    async def commit_version(body: VersionRef) -> SettleResponse:
        """Commit a group's swap to ``version`` (loaded with ``keep_previous_s``):
        the version it replaced is retired now. A no-op when nothing is pending."""
        return engine.commit(body.lora_name, body.version)

    @router.post("/adapters/rollback")
    async def rollback_version(body: VersionRef) -> SettleResponse:
        """Undo a group's swap to ``version`` that failed on another replica: the
        kept previous version serves again (a first load is unloaded) and
        ``version`` may be loaded again. A no-op when nothing of it is pending."""
        return await engine.rollback(body.lora_name, body.version)

    @router.post(
        "/adapters/lease", responses={409: {"model": ErrorBody}, 410: {"model": ErrorBody}}
    )
    async def lease_version(body: LeaseRequest) -> LeaseResponse:
        """Keep a version loaded for samples pinned to it (``lora_version``) for ``ttl_s``.

        409 when the adapter would hold more than ``--max-versions-per-adapter``
        versions; 410 when the version is already gone.
        """
        lease = engine.lease(body.lora_name, body.version, body.ttl_s)
        return _lease_response(lease, engine.lease_expires_in(lease))

    @router.delete("/adapters/lease/{lease_id}")
    async def release_lease(lease_id: str, request: Request) -> LeaseResponse:
        """End a lease; its version is retired if nothing else keeps it."""
        key = request_key(request.scope)
        if key is not None and not key.may_use(engine.leases.get(lease_id).lora_name):
            raise PermissionDeniedError("this API key may not release leases of that adapter")
        return _lease_response(engine.release_lease(lease_id), 0.0)

    @router.get("/server_info")
    async def server_info() -> ServerInfo:
        return info

    return router


def _lease_response(lease: Lease, expires_in_s: float) -> LeaseResponse:
    return LeaseResponse(
        lease_id=lease.lease_id,
        lora_name=lease.lora_name,
        version=lease.version,
        expires_in_s=round(expires_in_s, 3),
    )
