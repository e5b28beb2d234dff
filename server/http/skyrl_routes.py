"""SkyRL's server surface, so SkyRL's own ``RemoteInferenceClient`` drives this server.

SkyRL's trainer (``skyrl`` 0.3.0) talks to each vLLM server it runs through
a fixed set of routes: token-in ``/inference/v1/generate`` (and
``/skyrl/v1/generate``), the global ``/pause`` in its three modes and
``/resume``, ``/sleep`` and ``/wake_up``, ``/reset_prefix_cache``,
``/get_world_size``, and LoRA loads by path. Here each is served on top of
what the server already has: generation goes through the ``/skyrl/v1/sample``
sampler and the Tinker runner, so an adapter's own pause (a reload while
requests run) reads to SkyRL as a wait, never as a cut-short answer; the
global pause is the one ``/skyrl/v1/pause`` holds; loads are versioned,
gated and confined like ``/skyrl/v1/adapters/load``.

The pause modes keep SkyRL's meaning. ``keep`` freezes what runs and it
resumes where it left off; ``abort`` returns what runs with
``finish_reason: abort`` and its tokens so far; ``wait`` returns once what
runs has finished, holding new requests. Full-weight sync (NCCL or CUDA
IPC into the base model) does not fit a server whose base model many
tenants share, and answers 422 saying so.

These routes are not in the OpenAPI schema (they take vLLM's loose shapes);
with ``--api-keys`` every one of them is admin-only (``auth`` default-denies
what its tenant list does not name).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skyrl_lora.errors import AdapterNotFoundError, BadRequestError, ServerError
from skyrl_lora.types import SamplingParams, ServerInfo

from .. import compat
from ..engine.gated import GatedEngine
from ..engine.global_pause import GlobalPause
from ..tinker.backend import EngineBackend, SampleFn
from ..tinker.protobuf import EncodedSample
from ..tinker.runner import SampleJob, SampleRunner

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "keep", "wait")
#: The holder of the global pause a ``/sleep`` takes where the engine cannot sleep.
SLEEP_HOLDER = "skyrl-sleep"
FULL_WEIGHT_SYNC = (
    "full-weight sync is not supported: skyrl-lora serves one base model shared by many "
    "tenants' LoRA adapters and never changes its weights; sync an adapter instead "
    "(RemoteInferenceClient.load_lora_adapter, or POST /skyrl/v1/adapters/push)"
)
#: SkyRL's full-weight sync routes; each answers :data:`FULL_WEIGHT_SYNC`.
FULL_WEIGHT_ROUTES = (
    "/init_weight_transfer_engine",
    "/update_weights",
    "/start_weight_update",
    "/finish_weight_update",
)
#: vLLM sampling parameters that change no token: accepted and left alone
#: (answers carry token ids only; there is no text to format).
_OUTPUT_ONLY = (
    "output_kind",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


class UnsupportedError(ServerError):
    """A request this server understands but does not serve."""

    status = 422
    error_type = "not_supported"


class VllmSamplingParams(BaseModel):
    """The vLLM ``SamplingParams`` fields SkyRL sends; any other is refused by name."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1, le=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # SkyRL's generator sends these at the values below; others are not served.
    min_tokens: int = Field(default=0, ge=0, le=1)
    min_p: float = Field(default=0.0, ge=0.0, le=0.0)
    repetition_penalty: float = Field(default=1.0, ge=1.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    output_kind: int | None = None
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


class GenerateBody(BaseModel):
    """vLLM's token-in ``GenerateRequest``, as SkyRL sends it."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=1)
    model: str | None = None
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    #: Salts vLLM's prefix cache per weight version; accepted and not needed
    #: here: a version's requests never share cached blocks with another's.
    cache_salt: str | None = None
    request_id: str | None = None
    stream: bool = False
    features: Any = None


class LoadLoraBody(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = True


class UnloadLoraBody(BaseModel):
    lora_name: str = Field(min_length=1)


def _field_error(exc: ValidationError, where: str) -> BadRequestError:
    """The first validation error, named by its field (``sampling_params.top_p: ...``)."""
    error = exc.errors()[0]
    path = ".".join(str(p) for p in (where, *error["loc"]) if p != "")
    return BadRequestError(f"{path}: {error['msg']}")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise BadRequestError(f"the body is not JSON: {exc}") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _field_error(exc, "") from None


@dataclass
class AbortEpoch:
    """Counts abort-mode pauses: a sample begun before one is not resumed after it."""

    value: int = 0

    def since(self) -> Callable[[], bool]:
        start = self.value
        return lambda: self.value != start


def _job(
    body: GenerateBody, lora_name: str | None, max_model_len: int, aborted: AbortEpoch
) -> SampleJob:
    """A validated generate as a runner job, or a 400 that names the field."""
    sp = body.sampling_params
    if body.stream:
        raise BadRequestError("stream: streamed answers are not supported; send stream=false")
    if body.features is not None:
        raise BadRequestError("features: multi-modal inputs are not supported (token ids only)")
    if min(body.token_ids) < 0:
        raise BadRequestError(f"token_ids: token id {min(body.token_ids)} is negative")
    prompt_len = len(body.token_ids)
    if prompt_len >= max_model_len:
        raise BadRequestError(
            f"token_ids: the prompt has {prompt_len} tokens; the model allows fewer than "
            f"{max_model_len}"
        )
    stop_strings = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    try:
        params = SamplingParams(
            max_tokens=sp.max_tokens or max_model_len - prompt_len,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=-1 if sp.top_k in (None, 0) else sp.top_k,
            seed=sp.seed,
            ignore_eos=sp.ignore_eos,
        )
    except ValidationError as exc:
        raise _field_error(exc, "sampling_params") from None
    # Strings and token ids together: ``SamplingParams.stop`` holds both kinds
    # (its properties split them), but its validator takes one kind at a time.
    stop: list[Any] = [*stop_strings, *(sp.stop_token_ids or [])]
    params = params.model_copy(update={"stop": stop or None})
    return SampleJob(
        prompt=list(body.token_ids),
        lora_name=lora_name,
        version=None,
        num_samples=sp.n,
        params=params,
        prompt_logprobs=sp.prompt_logprobs is not None,
        topk_prompt_logprobs=sp.prompt_logprobs or 0,
        keep_aborted=aborted.since(),
    )


def _choices(sample: EncodedSample, with_logprobs: bool) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "token_ids": list(seq.tokens),
            "finish_reason": seq.stop_reason,
            "logprobs": (
                {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": lp}
                        for t, lp in zip(seq.tokens, seq.logprobs)
                    ]
                }
                if with_logprobs
                else None
            ),
            "routed_experts": None,
        }
        for i, seq in enumerate(sample.sequences)
    ]


def _prompt_logprobs(prompt: list[int], sample: EncodedSample) -> list[Any] | None:
    """vLLM's shape: per prompt token ``{token id: {"logprob": ...}}``, the
    top-k alternatives beside the token itself; None for the first token."""
    if sample.prompt_logprobs is None:
        return None
    topk = sample.topk_prompt_logprobs or [None] * len(prompt)
    steps: list[Any] = []
    for token, logprob, alternatives in zip(prompt, sample.prompt_logprobs, topk):
        if logprob is None:
            steps.append(None)
            continue
        step: dict[str, dict[str, Any]] = {
            str(t): {"logprob": lp, "rank": rank}
            for rank, (t, lp) in enumerate(alternatives or [], 1)
        }
        step.setdefault(str(token), {"logprob": logprob, "rank": None})
        steps.append(step)
    return steps


def _query_bool(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise BadRequestError(f"{name}: expected true or false, got {raw!r}")
    return raw.lower() in ("true", "1")


def build_skyrl_router(
    engine: GatedEngine,
    sample: SampleFn,
    info: ServerInfo,
    global_pause: GlobalPause,
) -> APIRouter:
    router = APIRouter(tags=["skyrl-compat"], include_in_schema=False)
    runner = SampleRunner(EngineBackend(sample, engine), info.max_model_len)
    aborted = AbortEpoch()
    engine_client = engine.engine_client

    def lora_name_of(model: str | None) -> str | None:
        if model is None or model == info.model:
            return None
        if model not in engine.registry.names():
            raise AdapterNotFoundError(
                f"model: {model!r} is neither the base model {info.model!r} nor a loaded adapter"
            )
        return model

    async def generate(request: Request) -> JSONResponse:
        body: GenerateBody = await _parse(request, GenerateBody)
        job = _job(body, lora_name_of(body.model), info.max_model_len, aborted)
        result = await runner.run(job)
        with_logprobs = body.sampling_params.logprobs is not None
        return JSONResponse(
            {
                "request_id": body.request_id or f"skyrl-generate-{uuid.uuid4().hex}",
                "choices": _choices(result, with_logprobs),
                "prompt_logprobs": _prompt_logprobs(job.prompt, result),
            }
        )

    router.add_api_route("/inference/v1/generate", generate, methods=["POST"])
    router.add_api_route("/skyrl/v1/generate", generate, methods=["POST"])

    @router.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        """The global pause: ``keep`` freezes, ``abort`` ends what runs, ``wait`` lets it finish."""
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        clear_cache = _query_bool(request, "clear_cache", False)
        holder = request.query_params.get("holder")
        if mode == "wait" and not global_pause.holders:
            await compat.pause_engine_draining(engine_client)
        was_paused = await global_pause.pause(holder)
        aborted_requests = 0
        if mode == "abort":
            aborted.value += 1
            aborted_requests = await compat.abort_all_requests(engine_client)
        if clear_cache:
            await compat.reset_prefix_cache(engine_client, reset_running_requests=False)
        return JSONResponse(
            {
                "status": "paused",
                "mode": mode,
                "was_paused": was_paused,
                "holders": global_pause.holders,
                "aborted": aborted_requests,
            }
        )

    @router.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        """Release the global pause (every hold, or the ``holder`` query's)."""
        still_paused = await global_pause.resume(request.query_params.get("holder"))
        return JSONResponse({"status": "paused" if still_paused else "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await compat.engine_is_paused(engine_client)})

    @router.post("/sleep")
    async def sleep(request: Request) -> JSONResponse:
        """Release the engine's memory where it was started with ``--enable-sleep-mode``;
        elsewhere hold the global pause instead (vLLM's level 0) and say so."""
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            raise BadRequestError("level: expected 0, 1 or 2") from None
        if level not in (0, 1, 2):
            raise BadRequestError(f"level: expected 0, 1 or 2, got {level}")
        if level > 0 and compat.sleep_mode_enabled(engine_client):
            await compat.sleep_engine(engine_client, level)
            return JSONResponse({"status": "sleeping", "level": level, "released_memory": True})
        await global_pause.pause(SLEEP_HOLDER)
        logger.warning(
            "/sleep?level=%d without --enable-sleep-mode: generation paused, no memory released",
            level,
        )
        return JSONResponse(
            {
                "status": "sleeping",
                "level": 0,
                "released_memory": False,
                "detail": "the engine runs without --enable-sleep-mode: generation is paused "
                "until /wake_up, and its memory is not released",
            }
        )

    @router.post("/wake_up")
    async def wake_up(request: Request) -> JSONResponse:
        tags = request.query_params.getlist("tags") or None
        if compat.sleep_mode_enabled(engine_client):
            await compat.wake_engine(engine_client, tags)
        still_paused = await global_pause.resume(SLEEP_HOLDER)
        return JSONResponse({"status": "awake", "tags": tags, "paused": still_paused})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        try:
            raw = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            raise BadRequestError(f"the body is not JSON: {exc}") from None
        running = raw.get("reset_running_requests", False) if isinstance(raw, dict) else None
        if not isinstance(running, bool):
            raise BadRequestError("reset_running_requests: expected true or false")
        done = await compat.reset_prefix_cache(engine_client, running)
        return JSONResponse({"status": "ok", "reset": done})

    @router.get("/get_world_size")
    async def get_world_size() -> JSONResponse:
        return JSONResponse({"world_size": compat.world_size(engine_client)})

    @router.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        return JSONResponse(
            {"world_size": compat.world_size(engine_client), **info.model_dump(mode="json")}
        )

    @router.post("/skyrl/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        """Load, or reload as its next version, an adapter from a folder.

        Requests running on it are paused, moved to the new version and
        resumed server-side (SkyRL's in-place reload); other adapters run on.
        """
        body: LoadLoraBody = await _parse(request, LoadLoraBody)
        await engine.load(body.lora_name, body.lora_path)
        adapter = engine.adapter_info(body.lora_name)
        return JSONResponse(
            {"status": "ok", "lora_name": body.lora_name, "version": adapter.version}
        )

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body: UnloadLoraBody = await _parse(request, UnloadLoraBody)
        await engine.unload(body.lora_name)
        return JSONResponse({"status": "ok", "lora_name": body.lora_name})

    async def full_weight_sync() -> JSONResponse:
        raise UnsupportedError(FULL_WEIGHT_SYNC)

    for path in FULL_WEIGHT_ROUTES:
        router.add_api_route(path, full_weight_sync, methods=["POST"])
    return router


def mount_skyrl_surface(
    app: FastAPI, engine: GatedEngine, sample: SampleFn, info: ServerInfo, pause: GlobalPause
) -> None:
    """Serve SkyRL's routes ahead of vLLM's own at the same paths (its disabled
    ``/inference/v1/generate``, its dev-mode ``/pause``, ``/sleep``, ...), and
    answer ``/collective_rpc`` (SkyRL's weight chunks) where vLLM has none."""
    before = len(app.router.routes)
    app.include_router(build_skyrl_router(engine, sample, info, pause))
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[:0] = ours
    if not any(getattr(r, "path", None) == "/collective_rpc" for r in app.router.routes):

        async def collective_rpc() -> JSONResponse:
            raise UnsupportedError(FULL_WEIGHT_SYNC)

        app.add_api_route(
            "/collective_rpc", collective_rpc, methods=["POST"], include_in_schema=False
        )
