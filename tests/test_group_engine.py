"""Two real CPU vLLM replicas in a local Ray cluster, driven by one client.

Module-scoped: the group starts once for these tests (a start costs over a
minute on the 2-core CPU machine, so every group test shares this one).

Atomic group swaps run first, while no replica has been rebuilt: replica 1
runs with a ``--max-adapter-bytes`` just above the embedded adapters' size
(every other test loads or pushes adapters of that size, which it takes);
a push of the same weights with a padded safetensors header (a larger,
equally valid file) lands on replica 0 and is refused by replica 1. The
group must then roll replica 0 back: both serve the old version, at the
same number, and the error is replica 1's.

The failure drills run last, in order: the group chaos soak, in which an
engine process is killed mid-flight while every tenant samples there and
random pause/swap/resume cycles run (the group notices, rebuilds the
replica with every adapter at its version and paused state, and it serves
again); then an actor killed mid-flight whose rebuilds its engine refuses
(the client fails over, the group gives up on it and names it). A rebuild
costs a replica's start, so the soak's is the only one: the engine kill is
the soak's rather than a drill of its own, and the actor kill needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skyrl_lora.client import InMemoryAdapter, RemoteInferenceClient
from skyrl_lora.errors import FanOutError, PayloadTooLargeError
from skyrl_lora.types import SampleResponse
from tests.conftest import counts_by_label, replica_group, soak_size, staged_file_reads

pytestmark = pytest.mark.engine

LONG = 300


ATOMIC_GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PAD = 64 * 1024


def files_of(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def padded(folder: Path) -> dict[str, bytes]:
    """The adapter's files with ``PAD`` bytes of safetensors metadata: the same
    weights in a larger file that every replica without a byte limit loads."""
    from safetensors.torch import load, save

    files = files_of(folder)
    weights = "adapter_model.safetensors"
    files[weights] = save(load(files[weights]), metadata={"pad": "x" * PAD})
    return files


@pytest.fixture(scope="module")
def group(embedded_model: Any, local_ray: Any) -> Iterator[Any]:
    size = sum(len(b) for b in files_of(embedded_model.adapters["moo"]).values())
    with replica_group(
        embedded_model, replica_argv={1: ["--max-adapter-bytes", str(size + PAD // 2)]}
    ) as started:
        yield started


async def served(url: str, tokenizer: Any, name: str) -> tuple[int | None, set[str] | None]:
    """(version, greedy words) of ``name`` on one replica; (None, None) when not loaded."""
    async with RemoteInferenceClient(url) as client:
        listing = await client.list_adapters()
        found = [a for a in listing.adapters if a.lora_name == name]
        if not found:
            return None, None
        out = await client.sample(
            tokenizer.encode("hello", add_special_tokens=False),
            sampling_params=ATOMIC_GREEDY,
            lora_name=name,
        )
        assert out.adapter_version == found[0].version
        return found[0].version, set(tokenizer.decode(out.sequences[0].tokens).split())


async def everywhere(group: Any, tokenizer: Any, name: str) -> list[tuple[Any, Any]]:
    return [await served(url, tokenizer, name) for url in group.urls]


async def test_a_push_one_replica_refuses_lands_nowhere(group, embedded_model, tokenizer) -> None:
    adapters = embedded_model.adapters
    push = group.push_lora_adapter
    infos = await asyncio.to_thread(push, "atom", files_of(adapters["moo"]))
    assert [i.version for i in infos] == [1, 1]
    assert await everywhere(group, tokenizer, "atom") == [(1, {"moo"})] * 2

    before = [await staged_file_reads(url) for url in group.urls]
    with pytest.raises(PayloadTooLargeError) as caught:
        await asyncio.to_thread(push, "atom", padded(adapters["woof"]))
    # Replica 0 staged (and installed) version 2; replica 1 refused it unread.
    assert [await staged_file_reads(url) for url in group.urls] == [before[0] + 1, before[1]]
    assert "--max-adapter-bytes" in str(caught.value)
    assert any("replica 1" in note for note in getattr(caught.value, "__notes__", []))
    # Replica 0 had loaded version 2: it serves version 1's weights again.
    assert await everywhere(group, tokenizer, "atom") == [(1, {"moo"})] * 2
    assert group.record()["atom"].version == 1

    # The same version number lands everywhere once every replica takes it.
    infos = await asyncio.to_thread(push, "atom", files_of(adapters["woof"]))
    assert [i.version for i in infos] == [2, 2]
    assert await everywhere(group, tokenizer, "atom") == [(2, {"woof"})] * 2
    await asyncio.sleep(1.5)  # supervision rounds: nothing is caught up or rebuilt
    assert await everywhere(group, tokenizer, "atom") == [(2, {"woof"})] * 2
    assert group.restarts == []


async def test_a_first_load_one_replica_refuses_leaves_the_name_unloaded(
    group, embedded_model, tokenizer
) -> None:
    with pytest.raises(PayloadTooLargeError):
        await asyncio.to_thread(
            group.push_lora_adapter, "atom-new", padded(embedded_model.adapters["meow"])
        )
    assert await everywhere(group, tokenizer, "atom-new") == [(None, None)] * 2
    assert "atom-new" not in group.record()
    infos = await asyncio.to_thread(
        group.push_lora_adapter, "atom-new", files_of(embedded_model.adapters["meow"])
    )
    assert [i.version for i in infos] == [1, 1]
    assert await everywhere(group, tokenizer, "atom-new") == [(1, {"meow"})] * 2


async def test_the_clients_fan_out_is_atomic_too(group, embedded_model, tokenizer) -> None:
    """The same refusal through the client's push to every replica: replica 1
    answers 413 (as it opens the push stream), replica 0 is rolled back through
    ``/skyrl/v1/adapters/rollback``."""
    woof = embedded_model.adapters["woof"]
    files = padded(woof)
    big = InMemoryAdapter(files["adapter_model.safetensors"], files["adapter_config.json"])
    async with RemoteInferenceClient(group.urls) as client:
        first = await client.push_lora_adapter("atom-http", embedded_model.adapters["moo"])
        assert first.version == 1 and first.consistent
        assert await everywhere(group, tokenizer, "atom-http") == [(1, {"moo"})] * 2
        with pytest.raises(FanOutError) as caught:
            await client.push_lora_adapter("atom-http", big)
        assert list(caught.value.failures) == [group.urls[1]]
        assert isinstance(caught.value.failures[group.urls[1]], PayloadTooLargeError)
        assert "rolled back" in str(caught.value)
        assert await everywhere(group, tokenizer, "atom-http") == [(1, {"moo"})] * 2
        loaded = await client.push_lora_adapter("atom-http", woof)
        assert loaded.version == 2 and loaded.consistent
        assert await everywhere(group, tokenizer, "atom-http") == [(2, {"woof"})] * 2


def greedy(max_tokens: int = LONG) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def engine_counts(client: RemoteInferenceClient, name: str) -> dict[str, int]:
    counts = {}
    for url in client.urls:
        listing = await client.list_adapters(url)
        (state,) = [a for a in listing.adapters if a.lora_name == name]
        counts[url] = state.engine_requests
    return counts


async def wait_everywhere(client: RemoteInferenceClient, name: str) -> None:
    deadline = time.monotonic() + 90
    while min((await engine_counts(client, name)).values()) == 0:
        assert time.monotonic() < deadline, f"{name} never ran on every replica"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)


def text(tokenizer: Any, result: SampleResponse) -> list[str]:
    return tokenizer.decode(result.sequences[0].tokens).split()


async def test_group_serves_on_every_replica(group, embedded_model, tokenizer) -> None:
    """...and each replica stages the adapter's file in one read (``adapters/adapter_file.py``)."""
    assert len(set(group.urls)) == 2
    before = [await staged_file_reads(url) for url in group.urls]
    async with RemoteInferenceClient(group.urls) as client:
        infos = await client.load_lora_adapter("g-meow", str(embedded_model.adapters["meow"]))
        assert [i.version for i in infos] == [1, 1]
    assert [await staged_file_reads(url) for url in group.urls] == [b + 1 for b in before]


async def pushed_bytes(url: str) -> dict[str, float]:
    """``skyrl_pushed_bytes_total`` of one replica, by how the bytes came."""
    async with aiohttp.ClientSession() as http:
        return await counts_by_label(http, url, "skyrl_pushed_bytes_total")


async def test_a_push_to_one_host_sends_its_bytes_once(group, embedded_model, tokenizer) -> None:
    """Both replicas share a host (``push_share_host``): the client streams
    each push to the first replica only, and the second loads it from the
    first's receive area as it lands (``adapters/push/shared``). Both serve
    every version, token for token."""
    adapters = embedded_model.adapters
    weights = [adapters[w] / "adapter_model.safetensors" for w in ("moo", "woof")]
    sizes = [w.stat().st_size for w in weights]
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    receiver, peer = group.urls
    async with RemoteInferenceClient(group.urls) as client:
        hosts = {(await client.server_info(url)).push_share_host for url in group.urls}
        assert len(hosts) == 1 and None not in hosts
        before = [await pushed_bytes(url) for url in group.urls]
        for version, word in enumerate(("moo", "woof"), start=1):
            infos = await client.push_lora_adapter("g-pushed", adapters[word])
            assert [i.version for i in infos] == [version, version]
            paths = {i.lora_path for i in infos}  # one digest: the same bytes
            assert len(paths) == 1 and paths.pop().startswith("push-stream:")
            outs = []
            for url in group.urls:
                async with RemoteInferenceClient(url) as one:
                    outs.append(
                        await one.sample(prompt, sampling_params=greedy(8), lora_name="g-pushed")
                    )
            assert [o.adapter_version for o in outs] == [version, version]
            assert outs[0].sequences[0].tokens == outs[1].sequences[0].tokens
            assert set(text(tokenizer, outs[0])) == {word}
        metrics = client.metrics()
        assert (metrics.pushes_streamed, metrics.pushes_shared) == (2, 2)
    after = [await pushed_bytes(url) for url in group.urls]
    came = [
        {via: after[i].get(via, 0.0) - before[i].get(via, 0.0) for via in ("stream", "host_share")}
        for i in range(2)
    ]
    assert came[0] == {"stream": sum(sizes), "host_share": 0}, (receiver, came)
    assert came[1] == {"stream": 0, "host_share": sum(sizes)}, (peer, came)


async def test_push_from_a_trainer_actor_through_the_object_store(
    group, embedded_model, tokenizer, local_ray
) -> None:
    """A trainer actor ``ray.put``s its adapter; the group loads it everywhere
    from that ref: no shared disk, no HTTP body, no copy through the driver."""
    folder = embedded_model.adapters["moo"]

    @local_ray.remote(num_cpus=0)
    class Trainer:
        def export(self) -> list[Any]:
            files = {f.name: f.read_bytes() for f in folder.iterdir()}
            return [local_ray.put(files)]  # wrapped: the caller gets the ref itself

    trainer = Trainer.remote()
    (ref,) = await asyncio.to_thread(local_ray.get, trainer.export.remote())
    infos = await asyncio.to_thread(group.push_lora_adapter, "g-ray", ref)
    assert [i.version for i in infos] == [1, 1]
    infos = await asyncio.to_thread(group.push_lora_adapter, "g-ray", ref, "finish_old")
    assert [(i.version, i.applied_swap_policy) for i in infos] == [(2, "finish_old")] * 2
    assert group.record()["g-ray"].version == 2
    for url in group.urls:  # each replica serves the pushed weights
        async with RemoteInferenceClient(url) as client:
            out = await client.sample(
                tokenizer.encode("hello", add_special_tokens=False),
                sampling_params=greedy(8),
                lora_name="g-ray",
            )
            assert set(text(tokenizer, out)) == {"moo"} and out.adapter_version == 2


async def pause_leaves_the_others_running(
    urls: list[str], embedded_model: Any, tokenizer: Any, prefix: str, length: int = LONG
) -> None:
    """``{prefix}-meow`` paused on every replica while it and ``{prefix}-woof``
    sample there: meow runs nowhere until resumed, woof keeps running on
    every replica, and both finish whole, meow in two segments or more.
    The CPU group's test and the GPU group's (``gpu_tests/test_gpu_group.py``)."""
    meow_name, woof_name = f"{prefix}-meow", f"{prefix}-woof"
    async with RemoteInferenceClient(urls) as client:
        await client.load_lora_adapter(meow_name, str(embedded_model.adapters["meow"]))
        await client.load_lora_adapter(woof_name, str(embedded_model.adapters["woof"]))
        prompt = tokenizer.encode("hello there", add_special_tokens=False)

        def run(name: str) -> asyncio.Task[SampleResponse]:
            return asyncio.create_task(
                client.sample_with_retry(prompt, sampling_params=greedy(length), lora_name=name)
            )

        meow = [run(meow_name) for _ in range(4)]
        woof = [run(woof_name) for _ in range(4)]
        await wait_everywhere(client, meow_name)
        await wait_everywhere(client, woof_name)
        acks = await client.pause_generation(lora_name=meow_name)
        assert len(acks) == len(urls) and all(a.aborted > 0 for a in acks), acks
        for _ in range(8):  # while paused: meow runs nowhere, woof runs everywhere
            meow_counts = await engine_counts(client, meow_name)
            woof_counts = await engine_counts(client, woof_name)
            assert set(meow_counts.values()) == {0}, meow_counts
            assert min(woof_counts.values()) > 0, woof_counts
            assert not any(t.done() for t in meow)
            await asyncio.sleep(0.1)
        await client.resume_generation(lora_name=meow_name)
        for r in await asyncio.gather(*meow):
            assert text(tokenizer, r) == ["meow"] * length and r.sequences[0].segments >= 2
        for r in await asyncio.gather(*woof):
            assert text(tokenizer, r) == ["woof"] * length and r.sequences[0].segments == 1


async def test_pause_on_both_replicas_leaves_other_adapters_running(
    group, embedded_model, tokenizer
) -> None:
    await pause_leaves_the_others_running(group.urls, embedded_model, tokenizer, "g")


async def adapter_lists(client: RemoteInferenceClient) -> list[list[tuple[str, int, bool]]]:
    lists = []
    for url in client.urls:
        listing = await client.list_adapters(url)
        lists.append([(a.lora_name, a.version, a.paused) for a in listing.adapters])
    return lists


async def converged(client: RemoteInferenceClient, timeout: float = 60) -> list[tuple]:
    """Wait until every replica lists the same adapters, versions and pauses."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            lists = await adapter_lists(client)
        except Exception:  # a replica still starting
            lists = []
        if lists and all(x == lists[0] for x in lists):
            return lists[0]
        assert time.monotonic() < deadline, f"replicas never converged: {lists}"
        await asyncio.sleep(0.25)


async def running_on(client: RemoteInferenceClient, url: str, names: list[str]) -> None:
    """Wait until the engine behind ``url`` runs requests of every one of ``names``."""
    deadline = time.monotonic() + 90
    while True:
        listing = await client.list_adapters(url)
        counts = {a.lora_name: a.engine_requests for a in listing.adapters}
        if all(counts.get(n, 0) > 0 for n in names):
            return
        assert time.monotonic() < deadline, f"not all of {names} ran on {url}: {counts}"
        await asyncio.sleep(0.05)


async def test_a_file_layout_seen_before_builds_from_its_template_and_serves_the_same(
    group, embedded_model, engine_server
) -> None:
    """The replicas read files on their staging threads (no reader process):
    once a layout was built by vLLM's loader, the next file of that layout
    is built from its template (``file_template``), and it must serve what
    vLLM's own build of the same file serves (the session server's reader
    process builds it with vLLM's loader), token for token."""
    woof = str(embedded_model.adapters["woof"])
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    prompt = [1, 2, 3]
    async with RemoteInferenceClient(group.urls) as client:
        await client.load_lora_adapter("g-tpl", str(embedded_model.adapters["moo"]))
        before = [await file_template_reads(url) for url in group.urls]
        await client.load_lora_adapter("g-tpl", woof)
        assert [await file_template_reads(url) for url in group.urls] == [b + 1 for b in before]
    built = []
    for url in group.urls:
        async with RemoteInferenceClient(url) as replica:
            built.append(await replica.sample(prompt, sampling_params=params, lora_name="g-tpl"))
    async with RemoteInferenceClient(
        engine_server.url, api_key=engine_server.admin_key
    ) as reference:
        await reference.load_lora_adapter("g-tpl-ref", woof)
        expected = await reference.sample(prompt, sampling_params=params, lora_name="g-tpl-ref")
    (want,) = expected.sequences
    for out in built:
        (got,) = out.sequences
        assert got.tokens == want.tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


async def file_template_reads(url: str) -> float:
    return await staged_file_reads(url, ("file_template",))


#: The soak's adapters, each swapped between its two words.
SOAK_WEIGHTS = {
    "chaos-a": ("meow", "woof"),
    "chaos-b": ("moo", "quack"),
    "chaos-c": ("woof", "moo"),
}


async def test_chaos_soak_over_a_group_with_an_engine_kill(
    group: Any, embedded_model: Any, tokenizer: Any, capsys
) -> None:
    """Resumable samples arrive all along while random pause/reload/resume
    cycles (``chaos-c`` by push, the others by path) run on two replicas, and
    replica 0's engine process is SIGKILLed once every tenant runs there. A
    fourth adapter sits paused all along. Samples keep arriving until the
    group has rebuilt the replica; every one must complete, with each version
    range's tokens from the weights that version names. The rebuilt replica
    must hold every adapter at its version (the pushed one too, which has no
    path to reload from) and the paused one still paused, and serve again
    within a bounded time.

    The chaos soak of ``tests/test_chaos_soak.py`` over this module's group
    (a group start of its own cost over a minute on the CPU machine), and its
    engine-kill drill: the module's one rebuild, as a rebuild costs a
    replica's start. So it is no ``soak`` test: every selection runs it, as
    every selection must rebuild a replica once, and it lasts about as long
    as the rebuild (samples keep arriving until then) whatever
    ``SKYRL_TEST_SOAK_SCALE`` says. Before the actor-kill drill, which
    leaves replica 1 down, with adapter names of its own; it counts only the
    rebuild its own kill causes."""
    rng = random.Random(4321)
    word_id = {
        w: tokenizer.encode(w, add_special_tokens=False)[0]
        for w in ("meow", "woof", "moo", "quack")
    }
    said: dict[tuple[str, int], int] = {}
    done = asyncio.Event()
    restarts_before = len(group.restarts)

    async def swap(client: RemoteInferenceClient, name: str, word: str) -> None:
        folder = str(embedded_model.adapters[word])
        try:
            if name == "chaos-c":
                infos = await client.push_lora_adapter(name, folder)
            else:
                infos = await client.load_lora_adapter(name, folder)
        except FanOutError as partial:  # the replica that is down
            infos = list(partial.results.values())
        for info in infos:
            said[(name, info.version)] = word_id[word]

    async with RemoteInferenceClient(group.urls) as client:
        for name, (word, _) in SOAK_WEIGHTS.items():
            await swap(client, name, word)
        await client.load_lora_adapter("chaos-held", str(embedded_model.adapters["moo"]))
        await client.pause_generation(lora_name="chaos-held")

        async def one(i: int) -> tuple[str, dict, SampleResponse]:
            name = rng.choice(list(SOAK_WEIGHTS))
            params = {"max_tokens": rng.randint(20, 160), "temperature": 0.0, "ignore_eos": True}
            prompt = tokenizer.encode(
                rng.choice(["hello", "hello there"]), add_special_tokens=False
            )
            result = await client.sample_with_retry(prompt, sampling_params=params, lora_name=name)
            return name, params, result

        async def arrivals() -> list[asyncio.Task]:
            started = []
            while not done.is_set() or len(started) < soak_size(60, least=20):
                started.append(asyncio.create_task(one(len(started))))
                await asyncio.sleep(rng.uniform(0.05, 0.3))
            return started

        cycle_ends: list[float] = []  # monotonic; the outage's cycles are counted below

        async def chaos() -> int:
            cycles = 0
            while not done.is_set():
                await asyncio.sleep(rng.uniform(0.5, 1.5))  # RL-step cadence
                name = rng.choice(list(SOAK_WEIGHTS))
                with contextlib.suppress(FanOutError):
                    await client.pause_generation(lora_name=name)
                await swap(client, name, SOAK_WEIGHTS[name][(cycles + 1) % 2])
                with contextlib.suppress(FanOutError):
                    await client.resume_generation(lora_name=name)
                cycles += 1
                cycle_ends.append(time.monotonic())
            return cycles

        async def kill_and_heal() -> tuple[Any, float, float]:
            await running_on(client, group.urls[0], list(SOAK_WEIGHTS))
            killed = time.monotonic()
            assert await asyncio.to_thread(group.kill_engine, 0), "no engine process to kill"
            restarts = await asyncio.to_thread(group.wait_restarts, restarts_before + 1, 400)
            (restart,) = restarts[restarts_before:]
            done.set()
            return restart, killed, restart.detected_at + restart.seconds - killed

        started = time.monotonic()
        arriving = asyncio.create_task(arrivals())
        cycles, (rebuilt, killed, heal_s) = await asyncio.wait_for(
            asyncio.gather(chaos(), kill_and_heal()), 480
        )
        results = await asyncio.wait_for(asyncio.gather(*await arriving), 300)
        elapsed = time.monotonic() - started
        for name in SOAK_WEIGHTS:  # leave nothing paused behind a failed fan-out
            await client.resume_generation(lora_name=name)
        state = await converged(client)
        prompt = tokenizer.encode("hello", add_special_tokens=False)
        async with RemoteInferenceClient(group.urls[0]) as rebuilt_replica:
            alone = {
                name: await rebuilt_replica.sample(
                    prompt, sampling_params=greedy(4), lora_name=name
                )
                for name in SOAK_WEIGHTS
            }
        await client.resume_generation(lora_name="chaos-held")

    lost = 0
    for name, params, result in results:
        (seq,) = result.sequences
        lost += len(seq.tokens) != params["max_tokens"]
        assert seq.versions[0].start == 0 and seq.versions[-1].end == len(seq.tokens)
        for before, after in zip(seq.versions, seq.versions[1:]):
            assert before.end == after.start and before.version <= after.version
        for r in seq.versions:
            assert set(seq.tokens[r.start : r.end]) == {said[(name, r.version)]}, (name, r)
    assert lost == 0 and cycles > 0
    assert rebuilt.index == 0 and rebuilt.url == group.urls[0], "rebuilt on the same URL"
    assert heal_s < 240, "the replica serves again within a bounded time"
    # weights changed while the replica was down: its rebuild must replay them
    assert sum(killed < t < killed + heal_s for t in cycle_ends) >= 2, cycle_ends
    assert ("chaos-held", 1, True) in state, "a paused adapter stays paused on the rebuilt replica"
    for name, out in alone.items():  # every adapter, the pushed one too, at its version there
        (seq,) = out.sequences
        assert set(seq.tokens) == {said[(name, out.adapter_version)]}, (name, out)
    with capsys.disabled():
        print(
            f"\nchaos soak over 2 replicas: {len(results)} samples, {cycles} pause/swap/resume "
            f"cycles, engine killed and replica serving again with {rebuilt.adapters} adapters "
            f"after {heal_s:.1f} s, {lost} samples lost, {elapsed:.1f} s"
        )


async def test_killing_a_replica_that_cannot_be_rebuilt_loses_no_sample_and_names_it(
    group: Any, embedded_model: Any, tokenizer: Any
) -> None:
    """The last drill: replica 1's actor killed while six samples run on both
    replicas, and its rebuilds refused by its engine (a context longer than
    the model's, as a GPU replica's rebuild can meet a GPU out of memory).
    The client fails over: every sample completes whole, on replica 0. The
    group tries ``rebuild_attempts`` times, then stops, and names replica 1
    with the engine's reason (:attr:`ServerGroup.failed`); replica 0 keeps
    serving all along.

    A killed actor and a killed engine fail the same check and take the same
    rebuild (``ServerGroup._rebuild``): the rebuild on the same URL, with
    every adapter at its version, is the chaos soak's to prove (above). A
    rebuild here of its own would cost a replica's start."""
    from dataclasses import replace

    refused = [*group.config.replica_argv.get(1, ()), "--max-model-len", "10000000"]
    group.config = replace(
        group.config, replica_argv={**group.config.replica_argv, 1: refused}, rebuild_attempts=2
    )
    restarts = len(group.restarts)
    async with RemoteInferenceClient(group.urls) as client:
        await client.load_lora_adapter("g-moo", str(embedded_model.adapters["moo"]))
        prompt = tokenizer.encode("hello there", add_special_tokens=False)
        tasks = [
            asyncio.create_task(
                client.sample_with_retry(prompt, sampling_params=greedy(), lora_name="g-moo")
            )
            for _ in range(6)
        ]
        await wait_everywhere(client, "g-moo")
        group.kill(1)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        for r in results:
            (seq,) = r.sequences
            assert seq.stop_reason == "length" and len(seq.tokens) == LONG
            assert text(tokenizer, r) == ["moo"] * LONG
            assert len(seq.logprobs) == LONG
        assert client.replicas.replicas[group.urls[0]].healthy
    deadline = time.monotonic() + 240
    while 1 not in group.failed:
        assert time.monotonic() < deadline, "the group kept rebuilding replica 1"
        await asyncio.sleep(0.25)
    assert "max_model_len" in group.failed[1].lower().replace("-", "_"), group.failed[1]
    await asyncio.sleep(3 * group.config.health_interval_s)
    assert group._rebuild_failures[1] == 2, "no rebuild after giving up"
    assert len(group.restarts) == restarts
    version, words = await served(group.urls[0], tokenizer, "g-moo")
    assert version is not None and words == {"moo"}
