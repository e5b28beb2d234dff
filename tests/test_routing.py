"""Routing policies, health tracking, failover and fan-out, against fake servers."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest

from skyrl_lora.client import ClientConfig, RemoteInferenceClient
from skyrl_lora.client.routing import AdapterAffinity, LeastOutstanding, Replica, ReplicaSet
from skyrl_lora.errors import ServerUnavailableError
from tests.fake_server import DROP, FakeServer, answer, seq

PROMPT = [11, 12, 13]


class FirstHealthy:
    """Deterministic policy for tests: always the first healthy replica."""

    def choose(self, replicas, lora_name):
        return replicas[0]


def test_least_outstanding_picks_the_idle_replica() -> None:
    replicas = [
        Replica("a", outstanding=3),
        Replica("b", outstanding=1),
        Replica("c", outstanding=2),
    ]
    assert LeastOutstanding().choose(replicas, "x").url == "b"


def test_affinity_keeps_an_adapter_home_and_spreads_adapters() -> None:
    replicas = [Replica(f"http://r{i}") for i in range(4)]
    policy = AdapterAffinity()
    homes = {name: policy.choose(replicas, name).url for name in (f"tenant-{i}" for i in range(40))}
    assert all(policy.choose(replicas, n).url == u for n, u in homes.items())
    assert len(set(homes.values())) == 4, "adapters should spread over replicas"


def test_affinity_spills_when_home_is_overloaded() -> None:
    replicas = [Replica("http://r0"), Replica("http://r1")]
    policy = AdapterAffinity(spill_factor=2.0, min_spill=4)
    home = policy.choose(replicas, "t")
    home.outstanding = 10
    assert policy.choose(replicas, "t") is not home


def test_affinity_moves_only_the_dead_replicas_adapters() -> None:
    replicas = [Replica(f"http://r{i}") for i in range(4)]
    policy = AdapterAffinity()
    names = [f"tenant-{i}" for i in range(40)]
    before = {n: policy.choose(replicas, n).url for n in names}
    survivors = replicas[1:]
    after = {n: policy.choose(survivors, n).url for n in names}
    moved = {n for n in names if before[n] != after[n]}
    assert moved == {n for n in names if before[n] == "http://r0"}


async def test_unhealthy_replica_is_skipped_until_its_health_check_passes() -> None:
    alive = {"http://a": True, "http://b": True}

    async def probe(url: str) -> bool:
        return alive[url]

    rs = ReplicaSet(list(alive), LeastOutstanding(), probe, recheck_after=0.05)
    alive["http://a"] = False
    rs.mark_unhealthy("http://a")
    assert [rs.pick(None).url for _ in range(5)] == ["http://b"] * 5
    await asyncio.sleep(0.1)
    rs.pick(None)  # starts a probe, which fails
    await asyncio.sleep(0.01)
    assert not rs.replicas["http://a"].healthy
    alive["http://a"] = True
    await asyncio.sleep(0.1)
    rs.pick(None)
    await asyncio.sleep(0.01)
    assert rs.replicas["http://a"].healthy
    rs.mark_unhealthy("http://a")
    rs.mark_unhealthy("http://b")
    with pytest.raises(ServerUnavailableError, match="no healthy replica"):
        rs.pick(None)


async def test_retry_prefers_the_replica_that_served_the_first_segment() -> None:
    async with FakeServer() as s1, FakeServer() as s2:
        for s in (s1, s2):
            s.script = [answer(seq([1, 2], "abort"))]
        async with RemoteInferenceClient([s1.url, s2.url]) as client:
            await client.sample_with_retry(PROMPT, sampling_params={"max_tokens": 4}, lora_name="a")
        served = s1 if s1.samples else s2
        other = s2 if served is s1 else s1
        assert len(served.samples) == 2 and not other.samples


async def test_replica_dying_mid_sample_resumes_elsewhere() -> None:
    """The first replica answers one aborted segment, then drops the connection
    of the resubmit; the sample finishes on the second with nothing lost."""
    async with FakeServer() as s1, FakeServer() as s2:
        s1.script = [answer(seq([1, 2, 3], "abort")), DROP]
        async with RemoteInferenceClient([s1.url, s2.url], policy=FirstHealthy()) as client:
            out = await client.sample_with_retry(PROMPT, sampling_params={"max_tokens": 6})
            assert not client.replicas.replicas[s1.url].healthy
        assert out.sequences[0].tokens == [1, 2, 3, 0, 1, 2]
        assert len(s1.samples) == 2
        (resumed,) = s2.samples
        assert resumed.prompt_token_ids == [*PROMPT, 1, 2, 3]
        assert resumed.sampling_params.max_tokens == 3


async def test_pause_fan_out_time_stays_flat(capsys) -> None:
    """Pause reaches every replica concurrently: 32 servers that each take
    50 ms must answer in about 50 ms, not 32 x 50 ms."""
    delay = 0.05
    timings = {}
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(FakeServer()) for _ in range(32)]
        for s in servers:
            s.control_delay = delay
        for n in (1, 2, 4, 8, 16, 32):
            async with RemoteInferenceClient([s.url for s in servers[:n]]) as client:
                await client.pause_generation(lora_name="warm")  # open the connections
                best = float("inf")
                for _ in range(3):
                    started = time.perf_counter()
                    acks = await client.pause_generation(lora_name="a")
                    best = min(best, time.perf_counter() - started)
                    assert len(acks) == n
                timings[n] = best
    with capsys.disabled():
        print(
            "\npause fan-out (50 ms per server): "
            + ", ".join(f"{n}: {t * 1000:.0f} ms" for n, t in timings.items())
        )
    assert timings[32] < 4 * delay, f"fan-out grows with the number of servers: {timings}"
    assert timings[32] < 2.5 * timings[1]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        RemoteInferenceClient("http://x", config=ClientConfig(routing="random"))


async def test_replica_whose_engine_died_fails_over_then_rejoins() -> None:
    """A replica that answers but whose engine is dead (503 ``engine_unavailable``)
    is treated like one that dropped the connection: the sample resumes on the
    other replica, and the replica rejoins once its health check passes again
    (the group rebuilt it on the same URL)."""
    from aiohttp import web

    dead = web.json_response(
        {"error": {"type": "engine_unavailable", "message": "the engine is dead"}}, status=503
    )

    async def healthy(_: web.Request) -> web.Response:
        return web.Response()

    s1 = FakeServer()
    s1.server.app.router.add_get("/health", healthy)
    async with s1, FakeServer() as s2:
        s1.script = [answer(seq([1, 2, 3], "abort")), lambda _: dead]
        config = ClientConfig(recheck_after=0.05)
        async with RemoteInferenceClient(
            [s1.url, s2.url], config=config, policy=FirstHealthy()
        ) as client:
            out = await client.sample_with_retry(PROMPT, sampling_params={"max_tokens": 6})
            assert out.sequences[0].tokens == [1, 2, 3, 0, 1, 2]
            assert not client.replicas.replicas[s1.url].healthy
            await asyncio.sleep(0.1)
            client.replicas.pick("a")  # starts the background re-check of s1
            deadline = time.monotonic() + 5
            while not client.replicas.replicas[s1.url].healthy:
                assert time.monotonic() < deadline, "the rebuilt replica never rejoined"
                await asyncio.sleep(0.02)
            await client.sample(PROMPT, sampling_params={"max_tokens": 2})
        assert len(s1.samples) == 3, "traffic goes back to the rejoined replica"
