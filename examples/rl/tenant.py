"""One tenant's asynchronous RL loop: samplers that never stop, a trainer that syncs.

Sampling workers keep ``sample_with_retry`` calls in flight for the whole
run and hand finished groups to the trainer through a small queue; the
trainer takes a batch, updates (in a process of its own, so the event loop
keeps serving the samplers), saves its adapter with PEFT and pushes (or has the
server load) it under a pause. With ``mode="per_adapter"`` only this tenant's requests are paused
(and aborted, then resumed by the client on the new version); with
``mode="finish_old"`` nothing is paused: the push's ``finish_old`` policy
lets requests in flight finish on the old version while new ones get the
new one; with ``mode="global"`` it is vLLM's keep-mode pause of the whole
engine, which freezes every tenant for the length of the swap.

Each step's wall time is split into waiting for samples, training (the
learner's own time, and the round trip to its process), saving the adapter
and the sync (pause, push, resume), so a report can say where the time goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from examples.rl.learner import Group, LearnerProcess, StepResult
from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.types import SwapPolicy

PauseMode = Literal["per_adapter", "finish_old", "global"]
#: "push" sends the weights over HTTP (trainer and servers share no disk);
#: "load" has the server read the trainer's folder (it must be under one of
#: the server's ``--adapter-root`` folders when it has any).
Transfer = Literal["push", "load"]


@dataclass(frozen=True)
class LoopConfig:
    """Shape of one tenant's run. ``in_flight``: concurrent sample calls, each
    one group of ``group_size`` samples of one prompt. ``target_reward``: stop
    after the first step whose mean reward reaches it (``steps`` is then the
    most a run takes), for runs that ask "how soon", not "how far"."""

    steps: int = 20
    groups_per_step: int = 4
    group_size: int = 16
    max_tokens: int = 12
    #: when set, each group's ``max_tokens`` is drawn from [min_tokens, max_tokens]
    min_tokens: int | None = None
    prompt_words: int = 6
    in_flight: int = 4
    seed: int = 0
    transfer: Transfer = "push"
    target_reward: float | None = None
    #: stop after the first step that ends this many seconds after the mode's start
    max_wall_s: float | None = None


@dataclass(frozen=True)
class Swap:
    """One weight sync: pause call to resume answered, what it aborted and
    how long the server took to drain them (0 for the global pause)."""

    start: float
    end: float
    version: int
    aborted: int
    drain_s: float
    pause_s: float = 0.0
    push_s: float = 0.0
    resume_s: float = 0.0


@dataclass
class TenantLog:
    """Everything the report needs about one tenant in one mode."""

    name: str
    steps: list[StepResult] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # since the mode's start
    versions: list[int] = field(default_factory=list)  # trainer version at each step
    swaps: list[Swap] = field(default_factory=list)
    samples: int = 0
    resumed: int = 0  # samples with segments > 1 (aborted and resumed)
    spanning: int = 0  # samples whose tokens come from 2+ adapter versions
    tokens: int = 0
    # per step, seconds: waiting for the batch, the learner call (of which
    # ``StepResult.train_s`` is the learner's own), saving the adapter
    wait_s: list[float] = field(default_factory=list)
    learner_s: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    end_s: float = 0.0  # when the tenant stopped, since the mode's start


def random_lengths(cfg: LoopConfig, seed: int) -> Callable[[], int]:
    """Each group's ``max_tokens``: fixed, or drawn from a seeded generator
    (both modes draw the same lengths in the same order)."""
    if cfg.min_tokens is None:
        return lambda: cfg.max_tokens
    rng = random.Random(seed + 7919)
    low = cfg.min_tokens
    return lambda: rng.randint(low, cfg.max_tokens)


def random_prompts(word_ids: range, words: int, seed: int) -> Callable[[], list[int]]:
    """Prompts of random words from a seeded generator: both modes draw the same.

    vLLM's sampling is left unseeded: ``sample_with_retry`` resubmits an
    aborted sample with the same ``seed``, so a seeded sample would replay
    its random stream after every abort and its tokens would no longer be
    independent draws from the policy.
    """
    rng = random.Random(seed)
    return lambda: [rng.randrange(word_ids.start, word_ids.stop) for _ in range(words)]


async def send_adapter(
    client: RemoteInferenceClient,
    name: str,
    folder: Path,
    transfer: Transfer,
    policy: SwapPolicy = "abort_resume",
) -> int:
    """Push or load the trainer's folder as ``name``'s next version; its number."""
    if transfer == "push":
        infos = await client.push_lora_adapter(name, folder, swap_policy=policy)
    else:
        infos = await client.load_lora_adapter(name, str(folder), swap_policy=policy)
    return _one_version(name, {i.version for i in infos})


async def sync_adapter(
    client: RemoteInferenceClient, name: str, folder: Path, mode: PauseMode, transfer: Transfer
) -> Swap:
    """Pause (this adapter or the engine), send the trainer's weights, resume.

    ``finish_old`` pauses nothing: the push itself keeps the old version
    for the requests in flight (or falls back to abort-resume where no
    LoRA slot is free for both).
    """
    started = time.monotonic()
    if mode == "finish_old":
        version = await send_adapter(client, name, folder, transfer, "finish_old")
        end = time.monotonic()
        return Swap(started, end, version, 0, 0.0, push_s=end - started)
    lora = name if mode == "per_adapter" else None
    paused = await client.pause_generation(lora_name=lora)
    pushing = time.monotonic()
    try:
        version = await send_adapter(client, name, folder, transfer)
    finally:
        resuming = time.monotonic()
        await client.resume_generation(lora_name=lora)
    end = time.monotonic()
    aborted = sum(p.aborted for p in paused)
    drain = max(p.drain_seconds for p in paused)
    return Swap(
        started,
        end,
        version,
        aborted,
        drain,
        pause_s=pushing - started,
        push_s=resuming - pushing,
        resume_s=end - resuming,
    )


def _one_version(name: str, versions: set[int]) -> int:
    """Staleness needs one version number per load: replicas must agree."""
    if len(versions) != 1:
        raise RuntimeError(f"{name}: replicas disagree on the version: {sorted(versions)}")
    return versions.pop()


async def run_tenant(
    client: RemoteInferenceClient,
    name: str,
    learner: LearnerProcess,
    folder: Path,
    prompts: Callable[[], list[int]],
    cfg: LoopConfig,
    mode: PauseMode,
    clock_start: float,
    on_step: Callable[[TenantLog], None] = lambda log: None,
    lengths: Callable[[], int] | None = None,
) -> TenantLog:
    """Train ``learner`` for ``cfg.steps`` steps against adapter ``name``.

    The adapter starts as the learner's fresh weights (sent from
    ``folder``; a name already served gets them as its next version). The
    server's answer is the trainer's first version, every sync's the next.
    """
    log = TenantLog(name)
    await learner.save(folder)
    # A first load may not be wrapped in a pause: pausing a name the server
    # does not know yet is a 404. (A reload of a known name pauses it itself.)
    version = await send_adapter(client, name, folder, cfg.transfer)
    queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=cfg.groups_per_step)
    lengths = lengths or (lambda: cfg.max_tokens)

    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def sampler() -> None:
        try:
            while True:
                prompt = prompts()
                params = {"max_tokens": lengths(), "temperature": 1.0, "ignore_eos": True}
                out = await client.sample_with_retry(
                    prompt, num_samples=cfg.group_size, sampling_params=params, lora_name=name
                )
                tokens = sum(len(s.tokens) for s in out.sequences)
                log.samples += len(out.sequences)
                log.resumed += sum(s.segments > 1 for s in out.sequences)
                log.spanning += sum(len(s.versions) > 1 for s in out.sequences)
                log.tokens += tokens
                await queue.put(Group(tuple(prompt), tuple(out.sequences)))
        except Exception as error:
            if not failed.done():
                failed.set_exception(error)

    workers = [asyncio.create_task(sampler()) for _ in range(cfg.in_flight)]
    try:
        for _ in range(cfg.steps):
            waiting = time.monotonic()
            batch = [await _next_group(queue, failed) for _ in range(cfg.groups_per_step)]
            training = time.monotonic()
            result = await learner.step(batch, version)
            saving = time.monotonic()
            log.steps.append(result)
            log.versions.append(version)
            log.step_times.append(saving - clock_start)
            await learner.save(folder)
            log.wait_s.append(training - waiting)
            log.learner_s.append(saving - training)
            log.save_s.append(time.monotonic() - saving)
            swap = await sync_adapter(client, name, folder, mode, cfg.transfer)
            log.swaps.append(swap)
            version = swap.version
            on_step(log)
            if cfg.target_reward is not None and result.mean_reward >= cfg.target_reward:
                break
            if cfg.max_wall_s is not None and time.monotonic() - clock_start >= cfg.max_wall_s:
                break
    finally:
        log.end_s = time.monotonic() - clock_start
        for w in workers:
            w.cancel()
        for w in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await w
        if failed.done():
            failed.exception()  # retrieved: no "never retrieved" warning
    return log


async def _next_group(queue: asyncio.Queue[Group], failed: asyncio.Future[None]) -> Group:
    """The next finished group; a sampler that died stops the run instead of
    leaving the trainer waiting forever."""
    getter: asyncio.Future[Group] = asyncio.ensure_future(queue.get())
    waiting: set[asyncio.Future[Any]] = {getter, failed}
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    raise RuntimeError("a sampling worker failed") from failed.exception()
