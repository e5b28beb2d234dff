"""The server half on a real CPU vLLM engine serving the embedded model.

Every test that changes adapter state loads adapters under its own names, so
the tests do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import time
from typing import Any

import aiohttp
import pytest
import torch

from tests.conftest import EngineServer, counts_by_label

pytestmark = pytest.mark.engine

# GPU runs set these: the CUDA engine is fast enough to finish short samples
# before a pause could land.
LONG = int(
    os.environ.get("SKYRL_TEST_LONG", "360")
)  # tokens: several seconds on CPU, so aborts land mid-flight
SETTLE_S = float(os.environ.get("SKYRL_TEST_SETTLE_S", "0.3"))


async def post(
    http: aiohttp.ClientSession, server: EngineServer, path: str, body: Any, expect: int = 200
) -> Any:
    async with http.post(server.url + path, json=body) as resp:
        payload = await resp.json(content_type=None)
        assert resp.status == expect, (resp.status, payload)
        return payload


async def get(http: aiohttp.ClientSession, server: EngineServer, path: str) -> Any:
    async with http.get(server.url + path) as resp:
        assert resp.status == 200
        return await resp.json()


def sample_body(
    server: EngineServer,
    lora: str | None,
    max_tokens: int = LONG,
    temperature: float = 0.0,
    **extra: Any,
) -> dict:
    return {
        "prompt_token_ids": server.encode("hello there how are you"),
        "lora_name": lora,
        "sampling_params": {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,
        },
        **extra,
    }


async def sample(http, server, lora, max_tokens=LONG, **extra) -> dict:
    body = sample_body(server, lora, max_tokens, **extra)
    return await post(http, server, "/skyrl/v1/sample", body)


async def load(http, server, name: str, adapter: str) -> dict:
    path = str(server.model.adapters[adapter])
    return await post(
        http, server, "/skyrl/v1/adapters/load", {"lora_name": name, "lora_path": path}
    )


async def adapter_state(http, server, name: str) -> dict:
    listing = await get(http, server, "/skyrl/v1/adapters")
    (state,) = [a for a in listing["adapters"] if a["lora_name"] == name]
    return state


async def wait_until_running(http, server, name: str, count: int) -> None:
    """Wait until vLLM itself tracks ``count`` requests of the adapter."""
    deadline = time.monotonic() + 60
    while (await adapter_state(http, server, name))["engine_requests"] < count:
        assert time.monotonic() < deadline, "requests never reached the engine"
        await asyncio.sleep(0.05)
    await asyncio.sleep(SETTLE_S)  # let them produce some tokens


async def test_adapter_loads_are_staged_off_the_step_loop(engine_server, http) -> None:
    info = await get(http, engine_server, "/skyrl/v1/server_info")
    assert info["adapter_staging"] is True  # the worker extension is live in vLLM's workers
    assert info["adapter_slot_prefill"] is True  # and writes engine slots off the loop too
    assert info["adapter_stage_channel"] is True  # asked beside the step loop, not through it
    assert info["adapter_gpu_staging"] is torch.cuda.is_available()  # built on the GPU there
    # pinned host memory taken before serving where vLLM pins adapters (a GPU), none on a CPU
    assert (info["adapter_pinned_reserve_bytes"] > 0) is torch.cuda.is_available()
    assert info["engine_long_step_ms"] == 50  # every worker watches its steps
    name = "staged-load"
    await post(
        http,
        engine_server,
        "/skyrl/v1/adapters/load",
        {"lora_name": name, "lora_path": str(engine_server.model.adapters["woof"])},
    )
    out = await post(http, engine_server, "/skyrl/v1/sample", sample_body(engine_server, name, 8))
    assert set(engine_server.tokenizer.decode(out["sequences"][0]["tokens"]).split()) == {"woof"}
    await post(http, engine_server, "/skyrl/v1/adapters/unload", {"lora_name": name})


async def test_a_path_load_snapshots_the_file_it_was_handed_byte_for_byte(
    engine_server, http, tmp_path
) -> None:
    """The registry hands the weights file to the workers open (over the
    stage channel) instead of copying it: the snapshot's weights file is the
    worker's copy of what it read, and must equal the file that was loaded,
    even after the tenant replaces that file."""
    assert engine_server.adapter_root is not None and engine_server.snapshot_dir is not None
    source = engine_server.adapter_root / "handed-open"
    shutil.copytree(engine_server.model.adapters["woof"], source)
    weights = (source / "adapter_model.safetensors").read_bytes()
    before = await counts_by_label(http, engine_server.url, "skyrl_adapter_snapshots_total")
    loaded = await post(
        http,
        engine_server,
        "/skyrl/v1/adapters/load",
        {"lora_name": "handed-open", "lora_path": str(source)},
    )
    after = await counts_by_label(http, engine_server.url, "skyrl_adapter_snapshots_total")
    assert after.get("held", 0) == before.get("held", 0) + 1  # not copied by the API server
    out = await sample(http, engine_server, "handed-open", max_tokens=8)
    assert out["sequences"][0]["tokens"] == [engine_server.word_id("woof")] * 8
    replaced = tmp_path / "meow.safetensors"  # the tenant writes its next checkpoint
    shutil.copy(engine_server.model.adapters["meow"] / "adapter_model.safetensors", replaced)
    os.replace(replaced, source / "adapter_model.safetensors")
    snapshot = engine_server.snapshot_dir / "handed-open" / f"v{loaded['version']}"
    deadline = time.monotonic() + 30
    while (snapshot / "weights.pending").exists():  # written after the swap
        assert time.monotonic() < deadline, "the snapshot's weights were never written"
        await asyncio.sleep(0.05)
    assert (snapshot / "adapter_model.safetensors").read_bytes() == weights
    await post(http, engine_server, "/skyrl/v1/adapters/unload", {"lora_name": "handed-open"})


async def test_adapters_produce_their_word_and_base_does_not(engine_server, http) -> None:
    for word in ("meow", "woof", "moo"):
        out = await sample(http, engine_server, word, max_tokens=20)
        (seq,) = out["sequences"]
        assert seq["tokens"] == [engine_server.word_id(word)] * 20
        assert len(seq["logprobs"]) == 20 and all(lp <= 0 for lp in seq["logprobs"])
        assert seq["stop_reason"] == "length"
        assert out["adapter_version"] >= 1
        assert seq["versions"] == [{"start": 0, "end": 20, "version": out["adapter_version"]}]
    base = await sample(http, engine_server, None, max_tokens=20)
    animals = {engine_server.word_id(w) for w in ("meow", "woof", "moo")}
    assert set(base["sequences"][0]["tokens"]) - animals, "base model should not bark"
    assert base["adapter_version"] is None


async def test_abort_one_adapter_leaves_the_other_running(engine_server, http) -> None:
    await load(http, engine_server, "abort-a", "meow")
    await load(http, engine_server, "abort-b", "woof")
    a = [asyncio.create_task(sample(http, engine_server, "abort-a")) for _ in range(4)]
    b = [asyncio.create_task(sample(http, engine_server, "abort-b")) for _ in range(4)]
    await wait_until_running(http, engine_server, "abort-a", 4)
    started = time.monotonic()
    aborted = await post(
        http, engine_server, "/skyrl/v1/abort_lora_requests", {"lora_name": "abort-a"}
    )
    abort_latency = time.monotonic() - started
    assert aborted["aborted"] == 4
    assert not any(t.done() for t in b), "the other adapter must keep running"
    meow, woof = engine_server.word_id("meow"), engine_server.word_id("woof")
    for result in await asyncio.gather(*a):
        (seq,) = result["sequences"]
        assert seq["stop_reason"] == "abort"
        assert 0 < len(seq["tokens"]) < LONG, "abort must land mid-flight with partial tokens"
        assert set(seq["tokens"]) == {meow} and len(seq["logprobs"]) == len(seq["tokens"])
    for result in await asyncio.gather(*b):
        (seq,) = result["sequences"]
        assert seq["stop_reason"] == "length" and seq["tokens"] == [woof] * LONG
    print(f"abort of 4 in-flight requests answered in {abort_latency * 1000:.1f} ms")


async def test_parallel_sampling_parent_is_aborted(engine_server, http) -> None:
    await load(http, engine_server, "abort-n", "moo")
    task = asyncio.create_task(
        sample(http, engine_server, "abort-n", num_samples=3, temperature=1.0)
    )
    await wait_until_running(http, engine_server, "abort-n", 3)
    aborted = await post(
        http, engine_server, "/skyrl/v1/abort_lora_requests", {"lora_name": "abort-n"}
    )
    assert aborted["aborted"] == 1  # one request, three children
    result = await task
    assert len(result["sequences"]) == 3
    assert all(s["stop_reason"] == "abort" and len(s["tokens"]) < LONG for s in result["sequences"])


async def test_paused_request_is_held_and_runs_on_the_new_version(engine_server, http) -> None:
    v1 = (await load(http, engine_server, "swap", "meow"))["version"]
    paused = await post(http, engine_server, "/skyrl/v1/pause", {"lora_name": "swap"})
    assert paused["paused"] and not paused["was_paused"]
    held = asyncio.create_task(sample(http, engine_server, "swap", max_tokens=20))
    await asyncio.sleep(1.0)
    assert not held.done(), "a request to a paused adapter must wait"
    assert (await adapter_state(http, engine_server, "swap"))["held"] == 1
    reloaded = await load(http, engine_server, "swap", "woof")
    assert reloaded["version"] == v1 + 1 and reloaded["paused"]
    resumed = await post(http, engine_server, "/skyrl/v1/resume", {"lora_name": "swap"})
    assert resumed["was_paused"]
    result = await asyncio.wait_for(held, 60)
    assert result["adapter_version"] == v1 + 1
    assert result["sequences"][0]["tokens"] == [engine_server.word_id("woof")] * 20


async def test_no_tokens_from_a_paused_adapter(engine_server, http) -> None:
    """A flood of requests around the pause: between pause and resume, vLLM
    itself tracks no request of the adapter; everything sent meanwhile waits."""
    await load(http, engine_server, "flood", "meow")
    meow, woof = engine_server.word_id("meow"), engine_server.word_id("woof")

    async def one(delay: float) -> tuple[float, dict]:
        await asyncio.sleep(delay)
        result = await sample(http, engine_server, "flood", max_tokens=LONG // 6)
        return time.monotonic(), result

    tasks = [asyncio.create_task(one(i * 0.02)) for i in range(40)]
    await asyncio.sleep(0.3)
    pause = await post(http, engine_server, "/skyrl/v1/pause", {"lora_name": "flood"})
    paused_at = time.monotonic()
    assert pause["aborted"] > 0, "the pause must hit requests in flight"
    for _ in range(20):  # ~1 s of watching the engine while paused
        state = await adapter_state(http, engine_server, "flood")
        assert state["engine_requests"] == 0 and state["in_flight"] == 0, state
        await asyncio.sleep(0.05)
    await load(http, engine_server, "flood", "woof")
    resume_at = time.monotonic()
    await post(http, engine_server, "/skyrl/v1/resume", {"lora_name": "flood"})
    results = await asyncio.gather(*tasks)
    new_version = pause_version = None
    for finished_at, result in results:
        (seq,) = result["sequences"]
        if seq["tokens"] and seq["tokens"][0] == woof:
            new_version = result["adapter_version"]
            assert finished_at > resume_at and set(seq["tokens"]) == {woof}
            assert seq["stop_reason"] == "length"
        else:
            pause_version = result["adapter_version"]
            assert set(seq["tokens"]) <= {meow}
            assert finished_at < paused_at + 0.5, "old-version output arrived long after the pause"
    assert new_version is not None and pause_version is not None and new_version > pause_version


async def test_reload_in_place_changes_output_and_version(engine_server, http) -> None:
    first = await load(http, engine_server, "reload", "meow")
    before = await sample(http, engine_server, "reload", max_tokens=8)
    second = await load(http, engine_server, "reload", "woof")
    after = await sample(http, engine_server, "reload", max_tokens=8)
    assert second["version"] == first["version"] + 1 and not second["paused"]
    assert before["sequences"][0]["tokens"] == [engine_server.word_id("meow")] * 8
    assert after["sequences"][0]["tokens"] == [engine_server.word_id("woof")] * 8
    assert after["adapter_version"] == second["version"]


async def staged_into_slots(http: aiohttp.ClientSession, server: EngineServer) -> dict[str, float]:
    return await counts_by_label(http, server.url, "skyrl_adapter_stagings_total")


async def test_staged_reads_run_in_the_reader_process(engine_server, http) -> None:
    """Once the reader process has started (it imports vLLM for some seconds
    after the server is up, and reads stay in the engine process meanwhile),
    a reload's files are read there, and the version it serves is the one
    read."""
    info = await get(http, engine_server, "/skyrl/v1/server_info")
    assert info["adapter_reader_process"] is True
    deadline = time.monotonic() + 120
    for reload in itertools.count():
        word = ("meow", "woof")[reload % 2]
        before = await counts_by_label(http, engine_server.url, "skyrl_adapter_reads_total")
        await load(http, engine_server, "via-reader", word)
        after = await counts_by_label(http, engine_server.url, "skyrl_adapter_reads_total")
        if after.get("reader", 0) == before.get("reader", 0) + 1:
            break
        # still starting: read on the staging thread, in one call
        assert after.get("one_buffer", 0) == before.get("one_buffer", 0) + 1
        assert time.monotonic() < deadline, "the reader process never took a read"
        await asyncio.sleep(0.5)
    out = await sample(http, engine_server, "via-reader", max_tokens=8)
    assert out["sequences"][0]["tokens"] == [engine_server.word_id(word)] * 8


async def test_a_paused_reload_with_every_slot_in_use_is_written_off_the_loop(
    engine_server, http, tmp_path
) -> None:
    """Every engine slot holds an active adapter. A trainer's pause, reload,
    resume lets the engine drop the old version as staging starts, so the new
    one is written into the freed slot off the step loop (before, none was
    spare and vLLM copied it in the loop, evicting another tenant's adapter
    from its CPU cache). Every adapter answers with its own weights after, and
    a failed reload under the same pause loses nothing."""
    slots = max(4, len(engine_server.model.adapters))  # embedded_server_argv's --max-loras
    names = [f"full-{i}" for i in range(slots)]
    words = {name: ("meow", "moo")[i % 2] for i, name in enumerate(names)}
    for name in names:  # each serves a request, which activates it: every slot is taken
        await load(http, engine_server, name, words[name])
        await sample(http, engine_server, name, max_tokens=1)
    before = await staged_into_slots(http, engine_server)
    await post(http, engine_server, "/skyrl/v1/pause", {"lora_name": names[0]})
    await load(http, engine_server, names[0], "woof")
    await post(http, engine_server, "/skyrl/v1/resume", {"lora_name": names[0]})
    after = await staged_into_slots(http, engine_server)
    assert after.get("written", 0) == before.get("written", 0) + 1
    assert after.get("none", 0) == before.get("none", 0)
    words[names[0]] = "woof"
    for name in names:
        out = await sample(http, engine_server, name, max_tokens=8)
        assert out["sequences"][0]["tokens"] == [engine_server.word_id(words[name])] * 8

    broken = (engine_server.adapter_root or tmp_path) / "full-broken"  # any path on the GPU
    shutil.copytree(engine_server.model.adapters["moo"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    await post(http, engine_server, "/skyrl/v1/pause", {"lora_name": names[0]})
    body = {"lora_name": names[0], "lora_path": str(broken)}
    await post(http, engine_server, "/skyrl/v1/adapters/load", body, expect=400)
    await post(http, engine_server, "/skyrl/v1/resume", {"lora_name": names[0]})
    out = await sample(http, engine_server, names[0], max_tokens=8)  # read again from its snapshot
    assert out["sequences"][0]["tokens"] == [engine_server.word_id("woof")] * 8


async def test_reload_with_requests_in_flight_pauses_itself(engine_server, http) -> None:
    await load(http, engine_server, "busy", "meow")
    running = [asyncio.create_task(sample(http, engine_server, "busy")) for _ in range(2)]
    await wait_until_running(http, engine_server, "busy", 2)
    reloaded = await load(http, engine_server, "busy", "woof")
    for result in await asyncio.gather(*running):
        assert result["sequences"][0]["stop_reason"] == "abort"
        assert result["adapter_version"] == reloaded["version"] - 1
    after = await sample(http, engine_server, "busy", max_tokens=5)
    assert after["sequences"][0]["tokens"] == [engine_server.word_id("woof")] * 5


async def staging_naps(http: aiohttp.ClientSession, server: EngineServer) -> float:
    """``skyrl_adapter_staging_naps_total`` from ``/metrics``."""
    async with http.get(server.url + "/metrics") as resp:
        text = await resp.text()
    (line,) = [x for x in text.splitlines() if x.startswith("skyrl_adapter_staging_naps_total ")]
    return float(line.split()[1])


async def test_the_api_process_froze_its_start_up_heap(engine_server, http) -> None:
    """As vLLM's own server does: what importing torch, transformers and vLLM
    left in the API process (about 690k objects on the CPU build, whose full
    collection took 340-380 ms) is out of the collector's reach, so a full
    collection under load walks only what serving created."""
    info = await get(http, engine_server, "/skyrl/v1/server_info")
    assert info["gc_frozen_objects"] > 100_000


async def test_a_staging_naps_while_the_engine_steps_never_when_idle(engine_server, http) -> None:
    """The yield points sit in the installed vLLM's adapter loader and the step
    hook on the worker's model runner: a reload beside another tenant's
    running requests naps, one with the engine idle does not (an idle swap
    costs what it did), and both install the weights they read."""
    info = await get(http, engine_server, "/skyrl/v1/server_info")
    assert info["adapter_staging_yield"] is True
    await load(http, engine_server, "naps", "meow")
    await asyncio.sleep(0.2)  # the engine's last step is long past
    idle = await staging_naps(http, engine_server)
    await load(http, engine_server, "naps", "woof")
    assert await staging_naps(http, engine_server) == idle
    running = [asyncio.create_task(sample(http, engine_server, "moo")) for _ in range(2)]
    await wait_until_running(http, engine_server, "moo", 2)
    await load(http, engine_server, "naps", "quack")
    assert await staging_naps(http, engine_server) > idle
    for result in await asyncio.gather(*running):  # the other tenant is untouched
        assert result["sequences"][0]["tokens"] == [engine_server.word_id("moo")] * LONG
    out = await sample(http, engine_server, "naps", max_tokens=5)
    assert out["sequences"][0]["tokens"] == [engine_server.word_id("quack")] * 5


async def test_vllm_routes_are_gated_and_tagged(engine_server, http) -> None:
    await load(http, engine_server, "openai", "quack")
    body = {"model": "openai", "prompt": "hello", "max_tokens": 5, "temperature": 0}
    await post(http, engine_server, "/skyrl/v1/pause", {"lora_name": "openai"})
    held = asyncio.create_task(http.post(engine_server.url + "/v1/completions", json=body))
    await asyncio.sleep(0.8)
    assert not held.done()
    await post(http, engine_server, "/skyrl/v1/resume", {"lora_name": "openai"})
    async with await asyncio.wait_for(held, 60) as resp:
        payload = await resp.json()
        assert resp.status == 200
        assert payload["choices"][0]["text"].split() == ["quack"] * 5
        version = (await adapter_state(http, engine_server, "openai"))["version"]
        assert resp.headers["x-skyrl-adapter-version"] == str(version)


async def test_global_pause_keep_mode_still_works(engine_server, http) -> None:
    task = asyncio.create_task(sample(http, engine_server, "meow", max_tokens=LONG))
    await wait_until_running(http, engine_server, "meow", 1)
    paused = await post(http, engine_server, "/skyrl/v1/pause", {})
    try:
        assert paused["lora_name"] is None and paused["paused"]
        await asyncio.sleep(1.0)
        assert not task.done(), "keep mode freezes requests in place"
        assert (await get(http, engine_server, "/skyrl/v1/adapters"))["engine_paused"]
    finally:  # never leave the engine paused for the tests after this one
        await post(http, engine_server, "/skyrl/v1/resume", {})
    result = await asyncio.wait_for(task, 60)
    assert result["sequences"][0]["stop_reason"] == "length"
    assert len(result["sequences"][0]["tokens"]) == LONG


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/skyrl/v1/sample", {"prompt_token_ids": [5], "lora_name": "nope"}, 404),
        (
            "/skyrl/v1/sample",
            {"prompt_token_ids": [5], "sampling_params": {"temperature": -1}},
            400,
        ),
        ("/skyrl/v1/sample", {"prompt_token_ids": [5], "sampling_params": {"max_tokens": 0}}, 400),
        ("/skyrl/v1/sample", {"prompt_token_ids": [5] * 1024}, 400),
        ("/skyrl/v1/sample", {"prompt_token_ids": [100000]}, 400),
        ("/skyrl/v1/sample", {"prompt_token_ids": []}, 400),
        ("/skyrl/v1/sample", {"prompt_token_ids": [5], "bogus": 1}, 400),
        ("/skyrl/v1/sample", "not json at all", 400),
        # A name not loaded yet may be paused (pause before load): not bad input.
        ("/skyrl/v1/pause", {"lora_name": "meow", "holder": ""}, 400),
        ("/skyrl/v1/resume", {"lora_name": None, "holder": "x" * 201}, 400),
        ("/skyrl/v1/abort_lora_requests", {"lora_name": "nope"}, 404),
        ("/skyrl/v1/adapters/load", {"lora_name": "x", "lora_path": "/does/not/exist"}, 400),
        ("/skyrl/v1/adapters/unload", {"lora_name": "nope"}, 404),
        ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}, 404),
    ],
)
async def test_bad_input_gets_4xx_and_disturbs_nothing(
    engine_server, http, path, body, status
) -> None:
    running = asyncio.create_task(sample(http, engine_server, "meow", max_tokens=40))
    await asyncio.sleep(0.1)
    kwargs = {"data": body} if isinstance(body, str) else {"json": body}
    async with http.post(engine_server.url + path, **kwargs) as resp:
        text = await resp.text()
        assert resp.status == status, text
        assert len(text) > 10, "the error must say what is wrong"
    result = await running
    assert result["sequences"][0]["stop_reason"] == "length"
    async with http.get(engine_server.url + "/health") as resp:
        assert resp.status == 200
