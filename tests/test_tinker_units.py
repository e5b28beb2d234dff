"""The Tinker surface's pure parts: futures, sessions and the resume runner (no vLLM)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from skyrl_lora.server.tinker.backend import PromptScores
from skyrl_lora.server.tinker.futures import FutureLimits, FutureStore
from skyrl_lora.server.tinker.routes import is_tinker_route
from skyrl_lora.server.tinker.runner import PAUSED, SampleJob, SampleRunner
from skyrl_lora.server.tinker.sessions import SessionStore, parse_model_path
from skyrl_lora.server.tinker.wire import TinkerError
from skyrl_lora.types import SampledSequence, SampleRequest, SampleResponse, SamplingParams


@dataclass(frozen=True)
class Key:
    key: str
    adapters: frozenset[str] = frozenset()
    admin: bool = False

    def may_use(self, lora_name: str | None) -> bool:
        return self.admin or lora_name in self.adapters


# -- futures ---------------------------------------------------------------
async def test_a_future_runs_on_when_nobody_waits_and_is_fetched_later() -> None:
    store = FutureStore(FutureLimits(long_poll_s=0.05))
    gate = asyncio.Event()

    async def work() -> bytes:
        await gate.wait()
        return b"done"

    future = store.submit("k", work, lambda: "active")
    await store.wait(future)  # a poll that gives up (a client that went away)
    assert not future.done.is_set()
    gate.set()
    await asyncio.sleep(0.01)
    assert store.get(future.request_id, "k").result == b"done"


async def test_the_per_key_cap_counts_unfetched_futures_only() -> None:
    store = FutureStore(FutureLimits(max_per_key=2))

    async def work() -> bytes:
        return b""

    first = store.submit("k", work, lambda: "active")
    store.submit("k", work, lambda: "active")
    with pytest.raises(TinkerError) as full:
        store.submit("k", work, lambda: "active")
    assert full.value.status == 429
    store.submit("other", work, lambda: "active")  # another key is not affected
    store.mark_retrieved(first)
    store.submit("k", work, lambda: "active")


async def test_futures_expire_and_belong_to_their_key() -> None:
    store = FutureStore(FutureLimits(ttl_s=0.0, retrieved_ttl_s=0.0))

    async def work() -> bytes:
        return b"x"

    future = store.submit("k", work, lambda: "active")
    with pytest.raises(TinkerError) as other:
        store.get(future.request_id, "someone-else")
    assert other.value.status == 410
    assert store.get(future.request_id, "admin", admin=True) is future
    await asyncio.sleep(0.01)
    store._next_sweep = 0.0
    store.sweep()
    assert len(store) == 0
    with pytest.raises(TinkerError, match="resend"):
        store.get(future.request_id, "k")


async def test_failures_keep_their_category() -> None:
    store = FutureStore()

    async def user() -> bytes:
        raise TinkerError("bad prompt")

    async def server() -> bytes:
        raise RuntimeError("boom")

    a = store.submit(None, user, lambda: "active")
    b = store.submit(None, server, lambda: "active")
    await asyncio.gather(a.done.wait(), b.done.wait())
    assert a.failure is not None and (a.failure.category, a.failure.message) == (
        "user",
        "bad prompt",
    )
    assert b.failure is not None and b.failure.category == "server"


async def test_a_poll_returns_early_when_the_queue_state_changes() -> None:
    store = FutureStore(FutureLimits(long_poll_s=30.0))
    state = ["active"]

    async def work() -> bytes:
        await asyncio.sleep(60)
        return b""

    future = store.submit(None, work, lambda: state[0])
    asyncio.get_running_loop().call_later(0.1, lambda: state.__setitem__(0, PAUSED))
    await asyncio.wait_for(store.wait(future), 5)
    assert future.queue_state() == PAUSED
    store.cancel(future)


# -- sessions --------------------------------------------------------------
def test_model_paths() -> None:
    assert parse_model_path("tinker://meow") == ("meow", None)
    assert parse_model_path("tinker://meow/sampler_weights/3") == ("meow", 3)
    for bad in ("tinker://", "tinker://run/weights/ckpt-1", "tinker://a/sampler_weights/x"):
        with pytest.raises(TinkerError, match="tinker://<lora_name>"):
            parse_model_path(bad)


def test_sessions_and_samplers_belong_to_their_key() -> None:
    store = SessionStore(max_entries=2)
    alice, bob = Key("alice"), Key("bob")
    session = store.create_session(alice)
    store.check_session(session, alice)
    with pytest.raises(TinkerError):
        store.check_session(session, bob)
    target = store.add_sampler(alice, "base", "tinker://a", "a", None)
    assert store.sampler(target.sampler_id, alice) == target
    assert store.sampler(target.sampler_id, Key("root", admin=True)) == target
    with pytest.raises(TinkerError, match="unknown sampling session"):
        store.sampler(target.sampler_id, bob)
    store.add_sampler(alice, "base", None, None, None)
    store.add_sampler(alice, "base", None, None, None)  # bounded: the oldest goes
    with pytest.raises(TinkerError):
        store.sampler(target.sampler_id, alice)


def test_the_tinker_route_table() -> None:
    assert is_tinker_route("POST", "/api/v1/asample")
    assert is_tinker_route("GET", "/api/v1/samplers/skyrl-sampler-1")
    assert is_tinker_route("POST", "/api/v1/sessions/s1/finish")
    assert not is_tinker_route("GET", "/api/v1/asample")
    assert not is_tinker_route("POST", "/api/v1/sessions/s1/finish/more")
    assert not is_tinker_route("POST", "/skyrl/v1/sample")


# -- the runner ------------------------------------------------------------
class ScriptedBackend:
    """Answers each sample request from a script of token runs; ``abort_after``
    cuts the first answers short as a pause would."""

    def __init__(self, full: list[int], aborts: list[int], paused: bool = False) -> None:
        self.full = full
        self.aborts = list(aborts)  # tokens to give before each abort
        self.paused = paused
        self.requests: list[SampleRequest] = []

    async def sample(self, request: SampleRequest) -> SampleResponse:
        self.requests.append(request)
        done = len(request.prompt_token_ids) - 1  # the prompt is one token here
        budget = request.sampling_params.max_tokens
        outs = []
        for _ in range(request.num_samples):
            if self.aborts:
                take = self.aborts.pop(0)
                tokens = self.full[done : done + take]
                reason = "abort"
            else:
                tokens = self.full[done : done + budget]
                reason = "length"
            outs.append(
                SampledSequence(
                    tokens=tokens, logprobs=[-float(t) for t in tokens], stop_reason=reason
                )
            )
        prompt_lp = [None, -0.5] if request.prompt_logprobs else None
        return SampleResponse(sequences=outs, prompt_logprobs=prompt_lp, adapter_version=1)

    async def score_prompt(
        self, prompt: list[int], lora_name: str | None, version: int | None, k: int
    ) -> PromptScores:
        return PromptScores(
            [None] + [-1.0] * (len(prompt) - 1), [None] + [[(5, -0.1)]] * (len(prompt) - 1)
        )

    def is_paused(self, lora_name: str) -> bool:
        return self.paused

    def check_servable(self, lora_name: str, version: int) -> None:
        if version != 1:
            raise TinkerError(f"version {version} is no longer held", status=410)

    def adapter_names(self) -> list[str]:
        return ["a"]


async def test_aborted_segments_are_resumed_and_stitched() -> None:
    full = list(range(10, 30))
    backend = ScriptedBackend(full, aborts=[3, 0, 5])
    runner = SampleRunner(backend, max_model_len=100)
    job = SampleJob([1], "a", None, 1, SamplingParams(max_tokens=12))
    (seq,) = (await runner.run(job)).sequences
    assert list(seq.tokens) == full[:12]
    assert list(seq.logprobs) == [-float(t) for t in full[:12]]
    assert seq.stop_reason == "length"
    resumed = backend.requests[1:]
    assert [len(r.prompt_token_ids) for r in resumed] == [4, 4, 9]
    assert [r.sampling_params.max_tokens for r in resumed] == [9, 9, 4]
    assert [r.generated_prefix_len for r in resumed] == [3, 3, 8]


async def test_each_of_n_samples_resumes_on_its_own() -> None:
    backend = ScriptedBackend(list(range(10, 30)), aborts=[2, 4])
    runner = SampleRunner(backend, max_model_len=100)
    result = await runner.run(SampleJob([1], "a", None, 3, SamplingParams(max_tokens=6)))
    assert [list(s.tokens) for s in result.sequences] == [list(range(10, 16))] * 3
    assert all(r.num_samples == 1 for r in backend.requests[1:])


async def test_prompt_logprobs_last_n_and_topk() -> None:
    backend = ScriptedBackend([7, 8, 9], aborts=[])
    runner = SampleRunner(backend, max_model_len=100)
    job = SampleJob([1, 2, 3], None, None, 1, SamplingParams(max_tokens=1), True, 1, 1)
    result = await runner.run(job)
    assert result.prompt_logprobs == [None, None, -1.0]
    assert result.topk_prompt_logprobs == [None, None, [(5, -0.1)]]


def test_queue_state_follows_the_pause() -> None:
    backend = ScriptedBackend([], aborts=[], paused=True)
    runner = SampleRunner(backend, max_model_len=100)
    assert runner.queue_state("a") == PAUSED
    assert runner.queue_state(None) == "active"


async def test_a_pinned_sample_stays_on_its_version() -> None:
    backend = ScriptedBackend(list(range(10, 30)), aborts=[2])
    runner = SampleRunner(backend, max_model_len=100)
    await runner.run(SampleJob([1], "a", 1, 1, SamplingParams(max_tokens=4)))
    assert [r.lora_version for r in backend.requests] == [1, 1]
    runner.check_version("a", 1)
    with pytest.raises(TinkerError, match="no longer held"):
        runner.check_version("a", 2)


async def test_one_failed_sequence_stops_the_others() -> None:
    class Failing(ScriptedBackend):
        cancelled = False

        async def sample(self, request: SampleRequest) -> SampleResponse:
            if request.generated_prefix_len == 0:  # the first request: both aborted at once
                return await super().sample(request)
            if request.generated_prefix_len == 1:
                raise TinkerError("adapter unloaded")
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                Failing.cancelled = True
                raise
            raise AssertionError("never reached")

    backend = Failing(list(range(10, 30)), aborts=[1, 2])
    runner = SampleRunner(backend, max_model_len=100)
    with pytest.raises(TinkerError, match="unloaded"):
        await runner.run(SampleJob([1], "a", None, 2, SamplingParams(max_tokens=8)))
    await asyncio.sleep(0)
    assert Failing.cancelled


async def test_a_stopping_server_ends_its_samples_and_takes_no_more() -> None:
    store = FutureStore()

    async def forever() -> bytes:
        await asyncio.sleep(60)
        return b""

    future = store.submit("k", forever, lambda: "active")
    await asyncio.sleep(0)
    assert store.stop() == 1
    await asyncio.wait_for(future.done.wait(), 5)
    assert future.failure is not None and future.failure.category == "server"
    assert "stopped" in future.failure.message
    with pytest.raises(TinkerError) as refused:
        store.submit("k", forever, lambda: "active")
    assert refused.value.status == 503
