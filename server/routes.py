"""The ``/skyrl/v1`` routes added to vLLM's OpenAI server."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from skyrl_lora.errors import PermissionDeniedError, ServerError
from skyrl_lora.server import compat
from skyrl_lora.server.auth import request_key
from skyrl_lora.server.engine import GatedEngine
from skyrl_lora.server.sample import Sampler
from skyrl_lora.types import (
    AbortResponse,
    AdapterInfo,
    AdapterList,
    AdapterRef,
    ErrorBody,
    ErrorDetail,
    LoadAdapterRequest,
    PauseRequest,
    PauseResponse,
    SampleRequest,
    SampleResponse,
    ServerInfo,
)

PREFIX = "/skyrl/v1"

_ERRORS = {
    400: {"model": ErrorBody, "description": "invalid request"},
    401: {"model": ErrorBody, "description": "missing or unknown API key"},
    403: {"model": ErrorBody, "description": "API key not allowed this adapter or operation"},
    404: {"model": ErrorBody, "description": "unknown adapter"},
}


def error_response(exc: ServerError) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(type=exc.error_type, message=exc.message))
    return JSONResponse(body.model_dump(), status_code=exc.status)


def build_router(engine: GatedEngine, sampler: Sampler, info: ServerInfo) -> APIRouter:
    router = APIRouter(prefix=PREFIX, tags=["skyrl"], responses=_ERRORS)  # type: ignore[arg-type]

    def adapter_info(name: str, engine_counts: dict[str, int] | None = None) -> AdapterInfo:
        record = engine.registry.get(name)
        if engine_counts is None:
            engine_counts = compat.engine_requests_by_lora(engine.engine_client)
        return AdapterInfo(
            lora_name=name,
            version=record.version,
            lora_path=record.source_path,
            paused=engine.gate.is_paused(name),
            in_flight=engine.gate.in_flight(name),
            held=engine.gate.held(name),
            engine_requests=engine_counts.get(name, 0),
        )

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
    async def pause(body: PauseRequest) -> PauseResponse:
        """Pause one adapter (hold new, abort in-flight), or the whole engine in keep mode."""
        if body.lora_name is None:
            was_paused = await compat.engine_is_paused(engine.engine_client)
            await compat.pause_engine_keep(engine.engine_client)
            return PauseResponse(lora_name=None, paused=True, was_paused=was_paused)
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
        """Resume one adapter, or the whole engine when no name is given."""
        if body.lora_name is None:
            was_paused = await compat.engine_is_paused(engine.engine_client)
            await engine.engine_client.resume_generation()
            return PauseResponse(lora_name=None, paused=False, was_paused=was_paused)
        was_paused = engine.resume(body.lora_name)
        return PauseResponse(lora_name=body.lora_name, paused=False, was_paused=was_paused)

    @router.get("/adapters")
    async def list_adapters(request: Request) -> AdapterList:
        """Adapters this caller may use (all of them without API keys)."""
        key = request_key(request.scope)
        counts = compat.engine_requests_by_lora(engine.engine_client)
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
        key = request_key(request.scope)
        if key is not None and not key.admin and body.lora_name not in engine.registry.names():
            raise PermissionDeniedError(
                f"loading the new adapter name {body.lora_name!r} needs an admin key"
            )
        if key is not None and not key.admin and body.version is not None:
            raise PermissionDeniedError("loading as an exact version needs an admin key")
        await engine.load(body.lora_name, body.lora_path, body.version)
        return adapter_info(body.lora_name)

    @router.post("/adapters/unload")
    async def unload_adapter(body: AdapterRef) -> AdapterRef:
        await engine.unload(body.lora_name)
        return body

    @router.get("/server_info")
    async def server_info() -> ServerInfo:
        return info

    return router
