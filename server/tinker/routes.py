"""The Tinker API's ``/api/v1`` routes: enough of it for the SDK to sample.

The SDK's handshake (client config, session, sampling session), ``asample``
and ``retrieve_future`` are served; heartbeats, telemetry and session
finishes are accepted and dropped; training routes answer "not supported".
Every answer uses Tinker's shapes, errors included (``{error, category}``),
because the SDK parses nothing else. Keys: the app passes ``key_of`` (the
key the auth middleware authenticated); a tenant key reaches only sessions,
samplers and futures it created, and samplers of adapters it may use.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from skyrl_lora.errors import ServerError
from skyrl_lora.types import SamplingParams, ServerInfo

from ..engine.gated import GatedEngine
from .backend import EngineBackend, SampleFn
from .futures import FutureLimits, FutureStore
from .protobuf import encode_sample_response
from .runner import SampleJob, SampleRunner
from .sessions import SCHEME, CallerKey, SamplerTarget, SessionStore, owner_of, parse_model_path
from .wire import (
    AsampleRequest,
    CreateSamplingSessionRequest,
    FutureRequest,
    TinkerError,
    error_json,
)

PREFIX = "/api/v1"
PROTOBUF = "application/x-protobuf"
NOT_SUPPORTED = (
    "not supported: sampling-only server (skyrl-lora serves sampling; train elsewhere and "
    "send the adapter with POST /skyrl/v1/adapters/push)"
)
#: Routes the SDK's training side calls: each answers :data:`NOT_SUPPORTED`.
TRAINING_PATHS = (
    "/create_model",
    "/forward_backward",
    "/forward",
    "/optim_step",
    "/save_weights",
    "/save_weights_for_sampler",
    "/save_weights_external",
    "/load_weights",
    "/create_custom_loss",
    "/copy_weights",
    "/unload_model",
    "/get_info",
    "/weights_info",
)
#: Every route here, by (method, path): the auth middleware lets tenant keys
#: call these (each route checks the key's scope itself) and nothing else.
ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/client/config"),
    ("POST", "/client/dynamic_config"),
    ("POST", "/create_session"),
    ("POST", "/session_heartbeat"),
    ("POST", "/sessions/{session_id}/finish"),
    ("POST", "/telemetry"),
    ("GET", "/healthz"),
    ("GET", "/get_server_capabilities"),
    ("POST", "/create_sampling_session"),
    ("GET", "/samplers/{sampler_id}"),
    ("POST", "/asample"),
    ("POST", "/retrieve_future"),
    ("POST", "/cancel_future"),
    *(("POST", path) for path in TRAINING_PATHS),
)
_PATTERNS = [
    (method, re.compile("^" + PREFIX + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$"))
    for method, path in ROUTES
]

KeyOf = Callable[[Request], CallerKey | None]
Handler = Callable[..., Awaitable[Response]]


def is_tinker_route(method: str, path: str) -> bool:
    return any(m == method and p.match(path) for m, p in _PATTERNS)


def _tinker_errors(handler: Handler) -> Handler:
    """Answer :class:`TinkerError` (and our own ``ServerError``) in Tinker's shape."""

    @functools.wraps(handler)
    async def wrapped(*args: Any, **kwargs: Any) -> Response:
        try:
            return await handler(*args, **kwargs)
        except TinkerError as exc:
            return error_json(exc.message, exc.category, exc.status)
        except ServerError as exc:
            return error_json(exc.message, "user" if exc.status < 500 else "server", exc.status)

    return wrapped


async def _body(request: Request, model: type[Any]) -> Any:
    try:
        raw = await request.body()
        return model.model_validate(json.loads(raw or b"{}"))
    except (ValueError, ValidationError) as exc:
        raise TinkerError(f"invalid request body: {exc}") from None


@dataclass(frozen=True)
class TinkerSurface:
    """The mounted router, and ``stop`` for a stopping server (see ``FutureStore.stop``)."""

    router: APIRouter
    stop: Callable[[], int]


def build_tinker_router(
    runner: SampleRunner,
    info: ServerInfo,
    key_of: KeyOf,
    adapter_names: Callable[[], list[str]],
    limits: FutureLimits | None = None,
) -> TinkerSurface:
    router = APIRouter(prefix=PREFIX, tags=["tinker"], include_in_schema=False)
    sessions = SessionStore()
    futures = FutureStore(limits or FutureLimits())

    def route(method: str, path: str) -> Callable[[Handler], Handler]:
        assert (method, path) in ROUTES, path
        return lambda handler: router.api_route(path, methods=[method])(_tinker_errors(handler))

    @route("POST", "/client/config")
    async def client_config(request: Request) -> Response:
        return JSONResponse(
            {
                "pjwt_auth_enabled": False,  # plain API keys, no JWT exchange
                "sample_use_retrieve_futures": False,  # one retrieve_future per sample
                "sample_join_sampling_session": False,
                "custom_loss_server_side": False,
            }
        )

    @route("POST", "/client/dynamic_config")
    async def dynamic_config(request: Request) -> Response:
        return JSONResponse({"refresh_interval_sec": 300, "sample_cancel_enabled": True})

    @route("POST", "/create_session")
    async def create_session(request: Request) -> Response:
        session_id = sessions.create_session(key_of(request))
        return JSONResponse({"type": "create_session", "session_id": session_id})

    @route("POST", "/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        return JSONResponse({"type": "session_heartbeat"})

    @route("POST", "/sessions/{session_id}/finish")
    async def finish(request: Request, session_id: str) -> Response:
        return JSONResponse({})

    @route("POST", "/telemetry")
    async def telemetry(request: Request) -> Response:
        return JSONResponse({"status": "accepted"})

    @route("GET", "/healthz")
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @route("GET", "/get_server_capabilities")
    async def capabilities(request: Request) -> Response:
        model = {
            "model_name": info.model,
            "max_context_length": info.max_model_len,
            "trainable": False,
            "sampleable": True,
        }
        return JSONResponse({"supported_models": [model]})

    @route("POST", "/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        body = await _body(request, CreateSamplingSessionRequest)
        key = key_of(request)
        sessions.check_session(body.session_id, key)
        lora_name, version = _resolve(body.model_path, body.base_model, info.model)
        _check_may_use(key, lora_name)
        if lora_name is not None:
            if lora_name not in adapter_names():
                raise TinkerError(f"adapter {lora_name!r} is not loaded on this server", status=404)
            runner.check_version(lora_name, version)
        target = sessions.add_sampler(key, info.model, body.model_path, lora_name, version)
        return JSONResponse(
            {"type": "create_sampling_session", "sampling_session_id": target.sampler_id}
        )

    @route("GET", "/samplers/{sampler_id}")
    async def get_sampler(request: Request, sampler_id: str) -> Response:
        target = sessions.sampler(sampler_id, key_of(request))
        return JSONResponse(
            {
                "sampler_id": target.sampler_id,
                "base_model": target.base_model,
                "model_path": target.model_path,
            }
        )

    @route("POST", "/asample")
    async def asample(request: Request) -> Response:
        body = await _body(request, AsampleRequest)
        key = key_of(request)
        target = _target(body, key)
        _check_may_use(key, target.lora_name)
        job = _job(body, target, info.max_model_len)

        async def work() -> bytes:
            return encode_sample_response(await runner.run(job))

        future = futures.submit(owner_of(key), work, lambda: runner.queue_state(target.lora_name))
        ids = [f"{future.request_id}-{i}" for i in range(job.num_samples)]
        return JSONResponse({"request_id": future.request_id, "sample_sequence_ids": ids})

    @route("POST", "/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _body(request, FutureRequest)
        future = _future(request, body.request_id)
        await futures.wait(future)
        if not future.done.is_set():
            return JSONResponse(
                {
                    "type": "try_again",
                    "request_id": future.request_id,
                    "queue_state": future.queue_state(),
                }
            )
        futures.mark_retrieved(future)
        if future.failure is not None:
            return error_json(future.failure.message, future.failure.category)
        assert future.result is not None
        return Response(content=future.result, media_type=PROTOBUF)

    @route("POST", "/cancel_future")
    async def cancel_future(request: Request) -> Response:
        body = await _body(request, FutureRequest)
        futures.cancel(_future(request, body.request_id))
        return JSONResponse({})

    for path in TRAINING_PATHS:

        @route("POST", path)
        async def training(request: Request) -> Response:
            raise TinkerError(NOT_SUPPORTED)

    def _future(request: Request, request_id: str) -> Any:
        key = key_of(request)
        return futures.get(request_id, owner_of(key), admin=key is not None and key.admin)

    def _target(body: AsampleRequest, key: CallerKey | None) -> SamplerTarget:
        if body.sampling_session_id is not None:
            return sessions.sampler(body.sampling_session_id, key)
        lora_name, version = _resolve(body.model_path, body.base_model, info.model)
        return SamplerTarget("", info.model, body.model_path, lora_name, version, owner_of(key))

    return TinkerSurface(router, futures.stop)


def _resolve(
    model_path: str | None, base_model: str | None, served: str
) -> tuple[str | None, int | None]:
    """The adapter (and pinned version) a sampler names; (None, None) for the base model."""
    if model_path:
        if not model_path.startswith(SCHEME):
            raise TinkerError(f"model_path must start with {SCHEME!r}, got {model_path!r}")
        return parse_model_path(model_path)
    if base_model is None:
        raise TinkerError("name a base_model or a model_path")
    if base_model != served:
        raise TinkerError(
            f"this server serves base model {served!r}, not {base_model!r}", status=404
        )
    return None, None


def _check_may_use(key: CallerKey | None, lora_name: str | None) -> None:
    if key is not None and not key.may_use(lora_name):
        what = "the base model" if lora_name is None else f"adapter {lora_name!r}"
        raise TinkerError(f"this API key may not use {what}", status=403)


def _job(body: AsampleRequest, target: SamplerTarget, max_model_len: int) -> SampleJob:
    """Validate an ``asample`` into a job, or raise a user error (400) now."""
    tokens: list[int] = []
    for chunk in body.prompt.chunks:
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise TinkerError(
                f"prompt chunks of type {chunk.type!r} are not supported here: send token ids"
            )
        tokens.extend(chunk.tokens)
    if not tokens:
        raise TinkerError("the prompt is empty")
    if min(tokens) < 0:
        raise TinkerError(f"token id {min(tokens)} is negative")
    if len(tokens) >= max_model_len:
        raise TinkerError(
            f"the prompt has {len(tokens)} tokens; this model's context is {max_model_len} "
            "tokens, so prompts must be shorter"
        )
    unsupported = [
        name
        for name, asked in (
            ("topk_sample_logprobs", body.topk_sample_logprobs > 0),
            ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0),
        )
        if asked
    ]
    if unsupported:
        raise TinkerError(f"{', '.join(unsupported)}: not supported by this server")
    if body.topk_prompt_logprobs < 0:
        raise TinkerError("topk_prompt_logprobs must be 0 or more")
    wants_prompt = bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (wants_prompt and 1 <= last_n <= len(tokens) - 1):
        raise TinkerError(
            "prompt_logprobs_last_n needs prompt logprobs and must be between 1 and "
            f"len(prompt) - 1 = {len(tokens) - 1}"
        )
    sp = body.sampling_params
    stop: Any = sp.stop
    try:
        params = SamplingParams(
            max_tokens=max_model_len - len(tokens) if sp.max_tokens is None else sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            stop=None if stop == [] else stop,
            ignore_eos=stop == [],  # Tinker: [] disables every stop token, EOS included
        )
        if not 1 <= body.num_samples <= 256:
            raise ValueError(f"num_samples must be between 1 and 256, got {body.num_samples}")
    except (ValueError, ValidationError) as exc:
        raise TinkerError(f"invalid sampling params: {_first_error(exc)}") from None
    return SampleJob(
        prompt=tokens,
        lora_name=target.lora_name,
        version=target.version,
        num_samples=body.num_samples,
        params=params,
        prompt_logprobs=wants_prompt,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        prompt_logprobs_last_n=last_n,
    )


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        return f"{where}: {error['msg']}" if where else str(error["msg"])
    return str(exc)


def tinker_surface(
    sample: SampleFn, engine: GatedEngine, info: ServerInfo, key_of: KeyOf
) -> TinkerSurface:
    """The whole surface over the gated engine and the ``/skyrl/v1/sample`` sampler."""
    backend = EngineBackend(sample, engine)
    runner = SampleRunner(backend, info.max_model_len)
    return build_tinker_router(runner, info, key_of, backend.adapter_names)
