"""RemoteInferenceClient against fake servers: fan-out, gates, stitching, errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp import web

from skyrl_lora.client import ClientConfig, RemoteInferenceClient
from skyrl_lora.client.gates import AdapterGates
from skyrl_lora.errors import (
    AdapterNotFoundError,
    BadRequestError,
    FanOutError,
    RequestTimeoutError,
    ServerUnavailableError,
)
from skyrl_lora.types import VersionRange
from tests.fake_server import FakeServer, answer, seq

PROMPT = [11, 12, 13]


async def test_pause_with_name_closes_gate_and_fans_out() -> None:
    async with FakeServer() as s1, FakeServer() as s2:
        async with RemoteInferenceClient([s1.url, s2.url]) as client:
            await client.pause_generation(lora_name="a")
            assert client.gates.is_closed("a") and not client.gates.is_closed("b")
            assert s1.controls == s2.controls == [("pause", {"lora_name": "a"})]
            await client.resume_generation(lora_name="a")
            assert not client.gates.is_closed("a")
            assert s1.controls[-1] == ("resume", {"lora_name": "a"})


async def test_the_global_pause_is_explicit_and_held_in_the_clients_name() -> None:
    async with FakeServer() as s1, FakeServer() as s2:
        async with RemoteInferenceClient([s1.url, s2.url]) as client:
            with pytest.raises(TypeError):
                await client.pause_generation()  # type: ignore[call-arg]
            await client.pause_all()
            await client.resume_generation(lora_name=None)  # spelled out: the same as resume_all
            held = {"lora_name": None, "holder": client.holder}
            for s in (s1, s2):
                assert s.controls == [("pause", held), ("resume", held)]


async def test_group_control_calls_answer_once_with_the_replicas_inside() -> None:
    async with FakeServer() as s1, FakeServer() as s2:
        async with RemoteInferenceClient([s1.url, s2.url]) as client:
            paused = await client.pause_generation("a")
            assert len(paused) == len(paused.replicas) == 2
            assert paused.paused and paused.lora_name == "a"
            assert paused.aborted == sum(r.aborted for r in paused.replicas)
            assert paused.drain_seconds == max(r.drain_seconds for r in paused.replicas)
            await client.resume_generation("a")


async def test_retry_stitches_across_abort() -> None:
    async with FakeServer() as server:
        server.script = [
            answer(seq([1, 2, 3], "abort", version=1)),
            answer(seq([4, 5], "abort", version=1)),
            answer(seq([6, 7], "length", version=2), version=2),
        ]
        async with RemoteInferenceClient(server.url) as client:
            out = await client.sample_with_retry(
                PROMPT, sampling_params={"max_tokens": 7}, lora_name="a"
            )
        first, second, third = server.samples
        assert first.prompt_token_ids == PROMPT and first.sampling_params.max_tokens == 7
        assert (
            second.prompt_token_ids == [*PROMPT, 1, 2, 3] and second.sampling_params.max_tokens == 4
        )
        assert second.generated_prefix_len == 3
        assert (
            third.prompt_token_ids == [*PROMPT, 1, 2, 3, 4, 5]
            and third.sampling_params.max_tokens == 2
        )
        (result,) = out.sequences
        assert result.tokens == [1, 2, 3, 4, 5, 6, 7]
        assert result.logprobs == pytest.approx([-0.5 - t / 100 for t in result.tokens])
        assert result.stop_reason == "length"
        assert result.versions == [
            VersionRange(start=0, end=5, version=1),
            VersionRange(start=5, end=7, version=2),
        ]
        assert out.adapter_version == 2


async def test_no_abort_means_one_request() -> None:
    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        out = await client.sample_with_retry(
            PROMPT, sampling_params={"max_tokens": 5}, lora_name="a"
        )
        assert len(server.samples) == 1
        assert out.sequences[0].tokens == [0, 1, 2, 3, 4]


async def test_retry_waits_on_gate_until_resume() -> None:
    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        server.script = [answer(seq([1, 2], "abort"))]
        await client.pause_generation(lora_name="a")
        task = asyncio.create_task(
            client.sample_with_retry(PROMPT, sampling_params={"max_tokens": 4}, lora_name="a")
        )
        await asyncio.sleep(0.2)
        assert len(server.samples) == 1 and not task.done(), "retry must wait for resume"
        await client.resume_generation(lora_name="a")
        out = await asyncio.wait_for(task, 5)
        assert len(server.samples) == 2
        assert out.sequences[0].tokens == [1, 2, 0, 1]


async def test_num_samples_retries_each_sequence_alone() -> None:
    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        server.script = [answer(seq([1, 2], "abort"), seq([3, 4, 5], "stop"), seq([6], "abort"))]
        out = await client.sample_with_retry(
            PROMPT, num_samples=3, sampling_params={"max_tokens": 4}, lora_name="a"
        )
        assert [s.tokens for s in out.sequences] == [[1, 2, 0, 1], [3, 4, 5], [6, 0, 1, 2]]
        assert [s.stop_reason for s in out.sequences] == ["length", "stop", "length"]
        resubmits = server.samples[1:]
        assert sorted(r.prompt_token_ids[len(PROMPT) :] for r in resubmits) == [[1, 2], [6]]
        assert all(r.num_samples == 1 for r in resubmits)


async def test_budget_exhausted_on_abort_is_not_resubmitted() -> None:
    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        server.script = [answer(seq([1, 2, 3], "abort"))]
        out = await client.sample_with_retry(
            PROMPT, sampling_params={"max_tokens": 3}, lora_name="a"
        )
        assert len(server.samples) == 1 and out.sequences[0].stop_reason == "length"


async def test_context_limit_stops_without_resubmit() -> None:
    async with FakeServer(max_model_len=6) as server, RemoteInferenceClient(server.url) as client:
        server.script = [answer(seq([1, 2, 3], "abort"))]
        out = await client.sample_with_retry(
            PROMPT, sampling_params={"max_tokens": 50}, lora_name="a"
        )
        assert len(server.samples) == 1 and out.sequences[0].stop_reason == "length"


async def test_stop_token_on_boundary_is_not_resubmitted() -> None:
    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        server.script = [answer(seq([1, 99], "abort"))]
        out = await client.sample_with_retry(
            PROMPT, sampling_params={"max_tokens": 50, "stop": [99]}, lora_name="a"
        )
        assert len(server.samples) == 1 and out.sequences[0].stop_reason == "stop"


async def test_prompt_logprobs_only_for_original_prompt() -> None:
    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        first = answer(seq([1], "abort"))
        first["prompt_logprobs"] = [None, -1.0, -2.0]
        server.script = [first]
        out = await client.sample_with_retry(
            PROMPT, sampling_params={"max_tokens": 3}, lora_name="a", prompt_logprobs=True
        )
        assert out.prompt_logprobs == [None, -1.0, -2.0]
        assert server.samples[0].prompt_logprobs and not server.samples[1].prompt_logprobs


def test_gates_across_event_loops_and_threads() -> None:
    gates = AdapterGates()
    gates.close("a")
    woke = threading.Event()
    waiting = threading.Event()

    def sampler_thread() -> None:
        async def wait() -> None:
            waiting.set()
            await gates.wait_open("a")
            woke.set()

        asyncio.run(wait())

    sampler = threading.Thread(target=sampler_thread)
    sampler.start()
    assert waiting.wait(5)
    assert not woke.wait(0.2)
    opener = threading.Thread(target=lambda: asyncio.run(_open_later(gates)))
    opener.start()
    opener.join(5)
    sampler.join(5)
    assert woke.is_set()


async def _open_later(gates: AdapterGates) -> None:
    await asyncio.sleep(0.05)
    gates.open("a")


async def test_an_opened_gate_lets_its_waiters_go_at_the_servers_pace() -> None:
    """The n-th waiter goes n spacings after the open (never earlier), none
    later than the window; a waiter let go after the gate closed again waits
    for the next open."""
    gates = AdapterGates(spacing_s=0.03, window_s=0.07)
    gates.close("a")
    woke: list[tuple[int, float]] = []

    async def waiter(n: int) -> None:
        await gates.wait_open("a")
        woke.append((n, time.monotonic()))

    tasks = [asyncio.create_task(waiter(n)) for n in range(5)]
    await asyncio.sleep(0.01)
    opened = time.monotonic()
    gates.open("a")
    await asyncio.gather(*tasks)
    after = {n: t - opened for n, t in woke}
    assert [n for n, _ in woke][:3] == [0, 1, 2]
    # uvloop's and asyncio's timers may fire up to a millisecond early, never later by design
    assert after[1] >= 0.028 and after[2] >= 0.058
    assert after[3] >= 0.068 and after[4] >= 0.068  # the window's end, not 0.09 and 0.12
    assert abs(after[4] - after[3]) < 0.015  # both at the window's end, in one timer pass
    assert max(after.values()) < 0.07 + 0.2  # slack for a loaded machine

    gates.close("a")
    late = [asyncio.create_task(waiter(n)) for n in (10, 11)]
    await asyncio.sleep(0.01)
    gates.open("a")
    gates.close("a")  # paused again before either waiter ran
    await asyncio.sleep(0.1)
    assert len(woke) == 5 and not any(task.done() for task in late)
    gates.open("a")
    await asyncio.wait_for(asyncio.gather(*late), 1)
    assert [n for n, _ in woke[5:]] == [10, 11]


async def test_typed_errors_carry_the_server_message() -> None:
    def not_found(_req: object) -> web.Response:
        return web.json_response(
            {"error": {"type": "adapter_not_found", "message": "no 'zz'"}}, status=404
        )

    def vllm_style(_req: object) -> web.Response:
        return web.json_response(
            {"error": {"message": "bad temp", "type": "BadRequestError", "code": 400}}, status=400
        )

    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        server.script = [not_found, vllm_style]
        with pytest.raises(AdapterNotFoundError, match="no 'zz'") as info:
            await client.sample(PROMPT, lora_name="zz")
        assert info.value.status == 404 and info.value.url
        with pytest.raises(BadRequestError, match="bad temp"):
            await client.sample(PROMPT)


async def test_an_answer_off_the_wire_format_is_a_typed_error() -> None:
    """A NaN logprob reaches the client as JSON's null: a typed error that
    names the server and the field, not pydantic's own."""
    from skyrl_lora.errors import ResponseFormatError

    def null_logprob(_req: object) -> web.Response:
        body = answer(seq([5, 6], "length"))
        body["sequences"][0]["logprobs"] = [-0.5, None]
        return web.json_response(body)

    async with FakeServer() as server, RemoteInferenceClient(server.url) as client:
        server.script = [null_logprob]
        with pytest.raises(ResponseFormatError, match=r"sequences\.0\.logprobs\.1") as info:
            await client.sample(PROMPT)
        assert info.value.url == server.url


async def test_server_gone_and_timeout_are_typed() -> None:
    async with RemoteInferenceClient("http://127.0.0.1:9") as client:
        with pytest.raises(ServerUnavailableError):
            await client.sample(PROMPT)
    async with FakeServer() as server:
        server.sample_delay = 2.0
        async with RemoteInferenceClient(
            server.url, config=ClientConfig(sample_timeout=0.2)
        ) as client:
            with pytest.raises(RequestTimeoutError):
                await client.sample(PROMPT)


async def test_fan_out_failure_raises_after_all_answered() -> None:
    async with FakeServer() as good:
        async with RemoteInferenceClient([good.url, "http://127.0.0.1:9"]) as client:
            with pytest.raises(FanOutError) as info:
                await client.pause_generation(lora_name="a")
            assert list(info.value.results) == [good.url]
            (failure,) = info.value.failures.values()
            assert isinstance(failure, ServerUnavailableError)
            assert good.controls == [("pause", {"lora_name": "a"})]
            assert not client.gates.is_closed("a"), "a failed pause must not leave the gate closed"


async def test_a_resumed_seeded_sample_draws_anew_and_is_counted() -> None:
    from skyrl_lora.stitching import resumed_seed

    async with FakeServer() as server:
        server.script = [
            answer(seq([1, 2, 3], "abort")),
            answer(seq([], "abort")),  # paused before its first token: no segment
            answer(seq([4, 5], "length")),
        ]
        async with RemoteInferenceClient(server.url) as client:
            out = await client.sample_with_retry(
                PROMPT, sampling_params={"max_tokens": 5, "seed": 7}, lora_name="a"
            )
            metrics = client.metrics()
        seeds = [s.sampling_params.seed for s in server.samples]
        assert seeds == [7, resumed_seed(7, 3), resumed_seed(7, 3)]
        assert len(set(seeds)) == 2  # the resumed part does not replay the first's draws
        assert out.sequences[0].segments == 2
        assert (metrics.samples, metrics.resubmits) == (1, 2)
        assert (metrics.resumed_segments, metrics.resumed_tokens) == (1, 2)
        assert dict(metrics.errors) == {}


async def test_an_in_process_server_shows_each_clients_counters_on_its_metrics() -> None:
    import importlib

    from prometheus_client import REGISTRY, generate_latest

    importlib.import_module("skyrl_lora.server.telemetry.observability")  # a server in this process
    async with FakeServer() as server:
        server.script = [answer(seq([1, 2], "abort")), answer(seq([3], "length"))]
        async with (
            RemoteInferenceClient(server.url) as one,
            RemoteInferenceClient(server.url) as two,
        ):
            await one.sample_with_retry(PROMPT, sampling_params={"max_tokens": 3}, lora_name="a")
            text = generate_latest(REGISTRY).decode()
            assert f'skyrl_client_samples_total{{client="{one.holder}"}} 1.0' in text
            assert f'skyrl_client_resubmits_total{{client="{one.holder}"}} 1.0' in text
            assert f'skyrl_client_resumed_tokens_total{{client="{one.holder}"}} 1.0' in text
            assert f'skyrl_client_samples_total{{client="{two.holder}"}} 0.0' in text
    assert one.holder not in generate_latest(REGISTRY).decode()  # gone once closed
