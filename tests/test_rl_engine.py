"""The RL example's loop, short: one tenant, a few GRPO steps, a real CPU vLLM server.

The trainer (PEFT on the CPU) learns to say "meow" from a fresh LoRA while
its samplers keep requests in flight and every step is synced under the
per-adapter pause. Checked: the reward rises, the trainer's versions are the
server's, every token's version is one the trainer pushed, and tokens the
current weights produced have an importance ratio of 1 (the trainer and the
server compute the same logprobs), so the off-policy correction is sound.
The learner process's hand-over, the GPU runs' transfer, is checked on the
same server by shared memory, with the times the RL report splits it by.

The runs share one learner process, reset to its fresh LoRA and optimizer
before each (``LearnerProcess.reset``, as the RL example runs its modes one
after another): a process of its own cost each test 6 s or more of
importing torch and PEFT and loading the model while the engine stood idle.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytestmark = pytest.mark.engine

#: The most steps a run takes: it stops at the first step whose mean reward
#: reaches TARGET. Takeoff is a random event (vLLM's sampling is unseeded, see
#: ``random_prompts``): the reward crossed 0.5 at steps 5, 7 and 8 in a probe of
#: three runs; in the 2 of 7 CI runs a fixed 14 steps failed it had not by step 14
#: (best 0.48, at step 13, in one; 0.064 at step 14 in the other), while every
#: other check held.
STEPS = 30
TARGET = 0.5
#: The server loads the trainer's folder (under the fixture's adapter root);
#: the push path is covered by the push tests.
TRANSFER = "load"


@pytest.fixture(scope="module")
async def learner(engine_server: Any) -> AsyncIterator[Any]:
    """The module's learner process: it learns to say animal words (any of 8:
    the base model says one in about 60 words, so every group of 16 samples
    carries some signal and the rise does not hang on the luck of a first rare
    word), at the reward run's rate (the short runs check versions, leases
    and pauses, not learning: they ran at the default rate). Reset before
    each use."""
    from examples.rl.learner import LearnerProcess
    from skyrl_lora.server.embedded.builder import ANIMALS

    targets = frozenset(engine_server.word_id(w) for w in ANIMALS)
    with LearnerProcess(engine_server.model.model_dir, targets, learner_config()) as started:
        await started.ready()
        yield started


def learner_config() -> Any:
    from examples.rl.learner import LearnerConfig
    from skyrl_lora.rl_accounting import OffPolicyConfig

    return LearnerConfig(lr=2e-2, off_policy=OffPolicyConfig(max_staleness=2))


async def reset_learner(learner: Any) -> Any:
    """``learner`` back at its fresh LoRA and optimizer, as a new process starts."""
    await learner.reset()
    return learner


async def test_rl_reward_rises_and_versions_are_consistent(
    engine_server: Any, learner: Any
) -> None:
    from examples.rl.tenant import LoopConfig, random_prompts, run_tenant
    from skyrl_lora.client import RemoteInferenceClient
    from skyrl_lora.server.embedded.builder import _word_ids

    config = learner_config()  # the module's learner's
    loop = LoopConfig(
        steps=STEPS, groups_per_step=4, group_size=16, transfer=TRANSFER, target_reward=TARGET
    )
    folder = engine_server.adapter_root / "rl-ci"
    await reset_learner(learner)
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as client:
        started = time.monotonic()
        log = await run_tenant(
            client,
            "rl-ci",
            learner,
            folder,
            random_prompts(_word_ids(), loop.prompt_words, seed=0),
            loop,
            "per_adapter",
            started,
        )
        adapters = (await client.list_adapters()).adapters
        resubmits = client.metrics().resubmits
    (served,) = [a for a in adapters if a.lora_name == "rl-ci"]
    elapsed = time.monotonic() - started
    rewards = [round(s.mean_reward, 3) for s in log.steps]

    # One load before the first step, one sync after each: consecutive versions,
    # and the server now serves the version pushed after the last step.
    steps = len(log.steps)
    first = log.versions[0]
    assert log.versions == list(range(first, first + steps))
    assert [s.version for s in log.swaps] == list(range(first + 1, first + steps + 1))
    assert served.version == first + steps
    # One learner call a step, in order, each before that step's sync: the
    # windows the report cuts the engine's rate by (examples.rl.colocation).
    assert len(log.train_windows) == steps
    for (start, end), swap in zip(log.train_windows, log.swaps):
        assert started < start < end <= swap.start

    fresh = 0
    for step, version in zip(log.steps, log.versions):
        for tokens in step.tokens:
            assert all(0 <= s <= version - first for s in tokens.staleness)
            for s, ratio, kept, weight in zip(
                tokens.staleness, tokens.ratios, tokens.kept, tokens.weights
            ):
                assert kept == (s <= 2)
                assert weight == (min(ratio, config.off_policy.ratio_clip) if kept else 0.0)
                if s == 0:
                    # The trainer's weights are the ones that made the token:
                    # its logprob must be the server's, up to fp32 kernel
                    # differences between torch (PEFT) and vLLM's CPU path,
                    # seen up to 1.4e-3 on a rare token in one CI run.
                    fresh += 1
                    assert math.log(ratio) == pytest.approx(0.0, abs=1e-2), rewards
    assert fresh > 0
    # Syncs aborted in-flight samples, which the client resubmitted on the next version.
    assert sum(s.aborted for s in log.swaps) > 0
    assert resubmits > 0
    # (Samples whose tokens span two requests, ``log.resumed``, need a sync to
    # land mid-generation: on a 2-core machine the learner's step can starve
    # the engine so that every aborted request still had no token; seen in 3
    # of 5 runs at f0d9b61, 4 requests aborted at each of 6 syncs, none
    # resumed with tokens. The stitching of such samples is tested alone.)

    assert rewards[0] <= 0.1, rewards
    # Reached within STEPS: a run that never learns runs all of them and ends below.
    assert log.steps[-1].mean_reward >= TARGET, rewards
    # About 1 s a step on the 2-core box, plus a fresh server's first requests.
    assert elapsed < 30 + 3 * steps, (elapsed, steps)


async def test_pinned_rollouts_never_mix_versions(engine_server: Any, learner: Any) -> None:
    """With ``pin_rollouts`` a group samples on the version it started on,
    leased across the next sync: aborted groups resume on their own version."""
    from examples.rl.tenant import LoopConfig

    # Samples of 32 tokens, not the default 12: a sync's abort must find
    # samples mid-generation for a resume to show (``log.resumed`` counts
    # samples of two segments or more). With 12, one CI run (9a76dc3) aborted
    # 24 samples and resumed none, most likely because every abort landed
    # before a sample's first token.
    loop = LoopConfig(
        steps=4,
        groups_per_step=4,
        group_size=16,
        max_tokens=32,
        transfer=TRANSFER,
        pin_rollouts=True,
    )
    log, served, _ = await _short_run(
        engine_server, learner, "rl-pinned", loop, "per_adapter", seed=1
    )
    assert len(log.steps) == 4
    assert sum(s.aborted for s in log.swaps) > 0 and log.resumed > 0
    assert log.spanning == 0, "a pinned sample mixed versions"
    assert served.leased == [], "the tenant's leases outlived its run"
    for step in log.steps:
        for tokens in step.tokens:
            assert len(set(tokens.staleness)) == 1  # one version per sample


async def test_an_on_policy_tenant_is_paused_across_its_learners_step(
    engine_server: Any, learner: Any
) -> None:
    """``per_adapter_on_policy`` pauses the tenant's adapter as its learner
    starts a step and resumes it after the sync: every learner call lies
    inside the pause, the pause aborts the samples in flight, and the client
    resumes them on the next version."""
    from examples.rl.tenant import LoopConfig

    # 32-token samples, as for the pinned run: a pause must find some mid-generation.
    loop = LoopConfig(steps=4, groups_per_step=4, group_size=16, max_tokens=32, transfer=TRANSFER)
    log, served, resubmits = await _short_run(
        engine_server, learner, "rl-on-policy", loop, "per_adapter_on_policy", seed=2
    )
    assert len(log.steps) == 4 and len(log.swaps) == 4
    first = log.versions[0]
    assert [s.version for s in log.swaps] == list(range(first + 1, first + 5))
    assert served.version == first + 4 and not served.paused
    for (start, end), swap in zip(log.train_windows, log.swaps):
        assert swap.held_s > 0
        assert swap.start - swap.held_s <= start < end <= swap.start
        assert swap.sync_s == pytest.approx(swap.end - swap.start + swap.pause_s)
    assert sum(s.aborted for s in log.swaps) > 0 and resubmits > 0


async def _short_run(
    engine_server: Any, learner: Any, name: str, loop: Any, mode: str, seed: int
) -> tuple[Any, Any, int]:
    """One tenant's short run against ``name`` with the module's learner,
    reset first: its log, the adapter as the server then lists it, the
    client's resubmits."""
    from examples.rl.tenant import random_prompts, run_tenant
    from skyrl_lora.client import RemoteInferenceClient
    from skyrl_lora.server.embedded.builder import _word_ids

    folder = engine_server.adapter_root / name
    await reset_learner(learner)
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as client:
        prompts = random_prompts(_word_ids(), loop.prompt_words, seed=seed)
        log = await run_tenant(client, name, learner, folder, prompts, loop, mode, time.monotonic())
        listed = (await client.list_adapters()).adapters
        (served,) = [a for a in listed if a.lora_name == name]
        return log, served, client.metrics().resubmits


async def _until(ready: Any, timeout_s: float = 30.0) -> None:
    """Return once ``ready()`` holds, or after ``timeout_s`` (the caller's asserts then fail)."""
    import asyncio

    for _ in range(int(timeout_s / 0.02)):
        if ready():
            return
        await asyncio.sleep(0.02)


async def test_engine_counters_read_the_real_engines_metrics(engine_server: Any) -> None:
    """The RL report's engine figures come from counters and gauges polled
    off ``/metrics``: their names must be the ones this vLLM exports, or
    every mode would read 0 tokens and the prefill and batch figures would
    say nothing. The window starts once the engine is idle: requests an
    earlier test left running (their tokens) once counted in it."""
    import asyncio

    import aiohttp

    from examples.rl.colocation import rate_by_training
    from examples.rl.engine_rate import (
        CACHED_COUNTER,
        COUNTER,
        COUNTERS,
        PROMPT_COUNTER,
        RUNNING_GAUGE,
        STEPS,
        STEPS_IN_GRAPH,
        WAITING_GAUGE,
        EngineTokenCounter,
        parse_counter,
    )
    from examples.rl.report import ModeRun, engine_prefill, engine_steps
    from skyrl_lora.client import RemoteInferenceClient
    from skyrl_lora.server.embedded.builder import _word_ids

    prompt = list(_word_ids())[:7]
    counter = EngineTokenCounter(engine_server.url, 0.02, engine_server.admin_key)
    stop = asyncio.Event()
    polling = asyncio.create_task(counter.run(stop))
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as client:
        generated, running = counter.readings[COUNTER], counter.readings[RUNNING_GAUGE]
        waiting = counter.readings[WAITING_GAUGE]

        def idle() -> bool:  # nothing left of an earlier test's requests
            return (
                len(generated) >= 3
                and running[-1] == waiting[-1] == 0
                and generated[-1] == generated[-3]
            )

        await _until(idle, timeout_s=60)
        asked = time.monotonic()
        await client.sample_with_retry(
            prompt, num_samples=1, sampling_params={"max_tokens": 9, "ignore_eos": True}
        )
        # Poll on until a reading has the request's tokens (a poll of the busy
        # CI machine can take longer than the request itself).
        generated = counter.readings[COUNTER]
        await _until(lambda: generated[-1] >= generated[0] + 9)
    stop.set()
    await polling
    # The counter is interpolated between readings; at readings it is exact.
    # The window runs from the last reading before the request to the last.
    start = max(t for t in counter.times if t < asked)
    end = counter.times[-1]

    assert counter.tokens_between(start, end) == 9
    async with aiohttp.ClientSession(headers=counter.headers) as session:
        async with session.get(counter.url) as response:
            text = await response.text()
    lines = text.splitlines()
    # every name polled is exported (a missing one would read as 0), and the
    # histogram's bucket selector picks a line
    metrics = [n.partition("{")[0] for n in COUNTERS]
    assert [n for n in metrics if not any(line.startswith(n) for line in lines)] == []
    assert parse_counter(text, STEPS_IN_GRAPH) > 0
    assert counter.between(PROMPT_COUNTER, start, end) == len(prompt)
    cached = counter.between(CACHED_COUNTER, start, end)
    assert 0 <= cached <= len(prompt)
    probe = ModeRun("probe", {}, counter, start, end)
    figures = engine_prefill(probe)
    assert figures["computed_per_generated"] == pytest.approx((len(prompt) - cached) / 9)
    # one token a step for the one request: at least 9 steps, none near 512 tokens
    assert counter.between(STEPS, start, end) >= 9
    assert counter.between(STEPS_IN_GRAPH, start, end) == counter.between(STEPS, start, end)
    steps = engine_steps(probe)
    assert steps["steps_per_s"] * (end - start) == pytest.approx(counter.between(STEPS, start, end))
    assert steps["over_graph_per_s"] == steps["over_graph_per_s_outside_syncs"] == 0
    assert steps["long_steps_per_s"] is None  # no server log given
    # Cut by a window that opens with the request: every token is in one piece
    # or the other, and the time is all there.
    cut = rate_by_training(counter, [(start, end)], [(asked, end)])
    assert sum(p["tok_s"] * p["seconds"] for p in cut.values()) == pytest.approx(9)
    assert cut["1"]["seconds"] == pytest.approx(end - asked)
    assert sum(p["share"] for p in cut.values()) == pytest.approx(1)


async def test_a_learner_hands_its_adapter_over_and_times_its_part(
    engine_server: Any, learner: Any
) -> None:
    """The GPU runs' transfer on the CPU engine: the learner process hands its
    adapter over by shared memory, twice (the second reuses its buffer and
    client), and says how long its weights' look-up, its copy into the buffer and
    the HTTP call took: the parts the RL report splits a sync's push into."""
    from skyrl_lora.client import RemoteInferenceClient

    key = engine_server.admin_key
    await reset_learner(learner)
    first = await learner.hand_over(engine_server.url, "rl-handed", 1, api_key=key)
    second = await learner.hand_over(engine_server.url, "rl-handed", 2, api_key=key)
    assert (first.version, second.version) == (1, 2)
    for handed in (first, second):
        assert handed.state_s > 0 and handed.update_s > 0 and 0 < handed.request_s < 60
    async with RemoteInferenceClient(engine_server.url, api_key=key) as client:
        served = {a.lora_name: a.version for a in (await client.list_adapters()).adapters}
        out = await client.sample(
            [1, 2, 3],
            sampling_params={"max_tokens": 4, "ignore_eos": True},
            lora_name="rl-handed",
        )
    assert served["rl-handed"] == 2
    # ignore_eos: the sampled (not greedy) reply may draw EOS first, as CI once did.
    assert len(out.sequences[0].tokens) == 4
    assert [(r.start, r.end, r.version) for r in out.sequences[0].versions] == [(0, 4, 2)]
