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
engine, which freezes every tenant for the length of the swap. With
``mode="per_adapter_on_policy"`` the tenant pauses its own adapter earlier,
as its learner starts a step, and resumes after the sync: the samples in
flight are aborted before the weights that make them are trained away, and
go on under the new version, so no token comes from a version while its
successor is being trained. Only a per-adapter pause makes that cheap: the
engine keeps the other tenants' requests, where a global pause for every
learner's step would stop it most of the time.

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

from examples.rl.learner import Group, HandOver, LearnerProcess, StepResult
from skyrl_lora.client import PauseResult, RemoteInferenceClient
from skyrl_lora.errors import VersionGoneError
from skyrl_lora.types import SwapPolicy

PauseMode = Literal[
    "per_adapter", "per_adapter_staged", "per_adapter_on_policy", "finish_old", "global"
]
#: Modes that pause this tenant's adapter alone, by an explicit pause call.
ADAPTER_PAUSES = ("per_adapter", "per_adapter_on_policy")
#: "push" sends the weights over HTTP (trainer and servers share no disk);
#: "load" has the server read the trainer's folder (it must be under one of
#: the server's ``--adapter-root`` folders when it has any); "handover" has the
#: learner's process hand its tensors to the server by handle (same host,
#: ``serve --allow-handover``): no file, no bytes on the wire.
Transfer = Literal["push", "load", "handover"]


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
    #: Pin each group to the version current when it started (``lora_version``),
    #: leasing the outgoing version across the next sync: a group aborted by a
    #: pause resumes on its own version, so no sample mixes versions. A group
    #: still running two syncs later finds its version gone and is dropped.
    pin_rollouts: bool = False
    lease_ttl_s: float = 300.0


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
    #: a hand-over's times in the learner process (None for other transfers)
    handover: HandOver | None = None
    #: ``per_adapter_on_policy``: how long the adapter was already paused when
    #: the sync began (its learner's step and the save); ``start`` is then the
    #: sync's own start, and ``pause_s`` the pause call made at the step's start
    held_s: float = 0.0

    @property
    def sync_s(self) -> float:
        """The sync's own time: the pause call, the send and the resume,
        wherever the pause came (not the learner's step it was held across)."""
        return self.end - self.start + (self.pause_s if self.held_s else 0.0)


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
    gone: int = 0  # pinned groups dropped because their version was no longer held
    # per step, seconds: waiting for the batch, the learner call (of which
    # ``StepResult.train_s`` is the learner's own), saving the adapter
    wait_s: list[float] = field(default_factory=list)
    learner_s: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    #: each learner call's (start, end), on the clock of :class:`Swap`: when
    #: the learner's forward and backward passes may share the GPU with the engine
    train_windows: list[tuple[float, float]] = field(default_factory=list)
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

    vLLM's sampling is left unseeded, each group its own draws. A seeded
    sample would be safe too: ``sample_with_retry`` resubmits an aborted
    one with a seed derived from the original and the tokens so far
    (:func:`skyrl_lora.stitching.resumed_seed`), so a resumed segment never
    replays the first one's random stream.
    """
    rng = random.Random(seed)
    return lambda: [rng.randrange(word_ids.start, word_ids.stop) for _ in range(words)]


async def send_adapter(
    client: RemoteInferenceClient,
    name: str,
    learner: LearnerProcess,
    folder: Path,
    transfer: Transfer,
    version: int,
    policy: SwapPolicy = "abort_resume",
) -> tuple[int, HandOver | None]:
    """Push or load the trainer's folder (or hand its weights over) as
    ``name``'s version ``version``; the version, and a hand-over's times.

    The trainer names its versions (one per step), so the number it trains
    against is the number every replica serves: a group load lands on all
    replicas at that version or on none, and a non-increasing number is a 409.
    """
    if transfer == "handover":
        handed = await learner.hand_over(client.urls[0], name, version, policy)
        return handed.version, handed
    if transfer == "push":
        result = await client.push_lora_adapter(name, folder, swap_policy=policy, version=version)
    else:
        result = await client.load_lora_adapter(
            name, str(folder), swap_policy=policy, version=version
        )
    return result.version, None


async def sync_adapter(
    client: RemoteInferenceClient,
    name: str,
    learner: LearnerProcess,
    folder: Path,
    mode: PauseMode,
    transfer: Transfer,
    version: int,
    paused: Paused | None = None,
) -> Swap:
    """Pause (this adapter or the engine), send the trainer's weights, resume.

    ``paused``: the adapter was paused already, at the learner step's start
    (``per_adapter_on_policy``), so the sync only sends and resumes.

    ``finish_old`` pauses nothing: the push itself keeps the old version
    for the requests in flight (or falls back to abort-resume where no
    LoRA slot is free for both). ``per_adapter_staged`` leaves the pause to
    the server's ``abort_resume`` swap: the new version is staged while the
    old one still serves, and the adapter is paused (its requests aborted
    and resumed) only around the install, instead of for the whole sync.
    """
    started = time.monotonic()
    if mode in ("finish_old", "per_adapter_staged"):
        policy: SwapPolicy = "finish_old" if mode == "finish_old" else "abort_resume"
        version, handed = await send_adapter(
            client, name, learner, folder, transfer, version, policy
        )
        end = time.monotonic()
        return Swap(started, end, version, 0, 0.0, push_s=end - started, handover=handed)
    lora = name if mode in ADAPTER_PAUSES else None
    early = paused is not None
    if paused is None:
        paused = await pause_now(client, lora)
    pushing = time.monotonic()
    handed = None
    try:
        version, handed = await send_adapter(client, name, learner, folder, transfer, version)
    finally:
        resuming = time.monotonic()
        await client.resume_generation(lora_name=lora)
    end = time.monotonic()
    return Swap(
        started,
        end,
        version,
        paused.result.aborted,
        paused.result.drain_seconds,
        pause_s=paused.call_s,
        push_s=resuming - pushing,
        resume_s=end - resuming,
        handover=handed,
        held_s=started - paused.at if early else 0.0,
    )


@dataclass(frozen=True)
class Paused:
    """A pause call: its answer, how long the call took, and when it was made
    (``time.monotonic()``)."""

    result: PauseResult
    call_s: float
    at: float


async def pause_now(client: RemoteInferenceClient, lora_name: str | None) -> Paused:
    """Pause one adapter (the whole engine with None), timing the call."""
    at = time.monotonic()
    result = await client.pause_generation(lora_name=lora_name)
    return Paused(result, time.monotonic() - at, at)


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
    trainer numbers the versions from there, one per step.
    """
    log = TenantLog(name)
    saves = cfg.transfer != "handover"  # a hand-over needs no file
    if saves:
        await learner.save(folder)
    served = {a.lora_name: a.version for a in (await client.list_adapters()).adapters}
    version, _ = await send_adapter(
        client, name, learner, folder, cfg.transfer, served.get(name, 0) + 1
    )
    current = [version]  # the version new groups start on (read by the samplers)
    leases: list[Any] = []  # the lease on the previous version, when pinning
    queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=cfg.groups_per_step)
    lengths = lengths or (lambda: cfg.max_tokens)

    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def sampler() -> None:
        try:
            while True:
                prompt = prompts()
                params = {"max_tokens": lengths(), "temperature": 1.0, "ignore_eos": True}
                try:
                    out = await client.sample_with_retry(
                        prompt,
                        num_samples=cfg.group_size,
                        sampling_params=params,
                        lora_name=name,
                        lora_version=current[0] if cfg.pin_rollouts else None,
                    )
                except VersionGoneError:
                    log.gone += 1
                    continue
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
            batched = time.monotonic()
            early = await pause_now(client, name) if mode == "per_adapter_on_policy" else None
            training = time.monotonic()
            result = await learner.step(batch, version)
            saving = time.monotonic()
            log.steps.append(result)
            log.versions.append(version)
            log.step_times.append(saving - clock_start)
            if saves:
                await learner.save(folder)
            log.wait_s.append(batched - waiting)
            log.learner_s.append(saving - training)
            log.train_windows.append((training, saving))
            log.save_s.append(time.monotonic() - saving)
            held = (
                await client.lease_version(name, version, ttl_s=cfg.lease_ttl_s)
                if cfg.pin_rollouts
                else []
            )
            swap = await sync_adapter(
                client, name, learner, folder, mode, cfg.transfer, version + 1, early
            )
            log.swaps.append(swap)
            version = current[0] = swap.version
            if leases:  # groups on the version before the previous one have had a whole step
                await client.release_leases(leases)
            leases = list(held)
            on_step(log)
            if cfg.target_reward is not None and result.mean_reward >= cfg.target_reward:
                break
            if cfg.max_wall_s is not None and time.monotonic() - clock_start >= cfg.max_wall_s:
                break
    finally:
        log.end_s = time.monotonic() - clock_start
        if leases:
            with contextlib.suppress(Exception):  # they expire by themselves anyway
                await client.release_leases(leases)
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
