"""Trainer-named versions, pausing before the first load, and logprobs_mode, on the real engine."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import BadRequestError, ConflictError, PermissionDeniedError
from tests.conftest import TENANT_KEYS, EngineServer

pytestmark = pytest.mark.engine

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
async def admin(engine_server: EngineServer):
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        await c.load_lora_adapter("sec-a", str(engine_server.model.adapters["meow"]))
        yield c
        # Leave sec-a as the other modules expect it: meow.
        await c.load_lora_adapter("sec-a", str(engine_server.model.adapters["meow"]))


@pytest.fixture
async def tenant(engine_server: EngineServer):
    async with RemoteInferenceClient(engine_server.url, api_key=TENANT_KEYS["sec-a"]) as c:
        yield c


async def state(client: RemoteInferenceClient, name: str):
    (found,) = [a for a in (await client.list_adapters()).adapters if a.lora_name == name]
    return found


async def greedy_word(client: RemoteInferenceClient, server: EngineServer, name: str) -> set[str]:
    out = await client.sample(server.encode("hello"), sampling_params=GREEDY, lora_name=name)
    return set(server.tokenizer.decode(out.sequences[0].tokens).split())


async def test_a_tenant_names_its_versions_and_they_only_go_up(
    engine_server, admin, tenant
) -> None:
    adapters = engine_server.model.adapters
    current = (await state(tenant, "sec-a")).version
    step = current + 10
    (info,) = await tenant.push_lora_adapter("sec-a", adapters["woof"], version=step)
    assert info.version == step and info.applied_swap_policy == "abort_resume"
    assert await greedy_word(tenant, engine_server, "sec-a") == {"woof"}
    for lower in (step, step - 1):  # other weights at the current version, or an older one
        with pytest.raises(ConflictError) as caught:
            await tenant.push_lora_adapter("sec-a", adapters["moo"], version=lower)
        assert f"version {step}" in caught.value.message
        assert f"{lower}" in caught.value.message
    with pytest.raises(ConflictError, match=f"at version {step}; version {step - 3} is not"):
        await tenant.load_lora_adapter("sec-a", str(adapters["moo"]), version=step - 3)
    with pytest.raises(BadRequestError):
        await tenant.load_lora_adapter("sec-a", str(adapters["moo"]), version=0)
    after = await state(tenant, "sec-a")
    assert after.version == step and not after.paused
    assert await greedy_word(tenant, engine_server, "sec-a") == {"woof"}
    with pytest.raises(PermissionDeniedError):  # another tenant's adapter, version or not
        await tenant.load_lora_adapter("sec-b", str(adapters["moo"]), version=step + 50)


async def test_repeating_the_current_version_with_the_same_weights_reloads_nothing(
    engine_server, admin, tenant
) -> None:
    adapters = engine_server.model.adapters
    step = (await state(tenant, "sec-a")).version + 1
    (info,) = await tenant.load_lora_adapter("sec-a", str(adapters["quack"]), version=step)
    assert info.version == step and info.applied_swap_policy == "abort_resume"
    snapshot = engine_server.snapshot_dir / "sec-a" / f"v{step}"
    assert snapshot.is_dir()
    inode = snapshot.stat().st_ino
    prompt = engine_server.encode("hello")
    long = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    running = asyncio.create_task(tenant.sample(prompt, sampling_params=long, lora_name="sec-a"))
    await asyncio.sleep(0.3)
    # The same weights again, by path and pushed: 200, nothing paused or aborted.
    (again,) = await tenant.load_lora_adapter("sec-a", str(adapters["quack"]), version=step)
    (pushed,) = await tenant.push_lora_adapter("sec-a", adapters["quack"], version=step)
    for repeat in (again, pushed):
        assert repeat.version == step and repeat.applied_swap_policy is None
        assert not repeat.paused and repeat.draining == []
    (seq,) = (await running).sequences
    assert seq.stop_reason == "length" and len(seq.tokens) == 120, "the repeat aborted nothing"
    assert snapshot.stat().st_ino == inode and (await state(tenant, "sec-a")).version == step
    assert await greedy_word(tenant, engine_server, "sec-a") == {"quack"}


async def test_a_name_paused_before_its_first_load_holds_samples_until_loaded_and_resumed(
    engine_server, admin
) -> None:
    name = f"early-{uuid.uuid4().hex[:6]}"
    (paused,) = await admin.pause_generation(lora_name=name)
    assert paused.paused and not paused.was_paused and paused.aborted == 0
    prompt = engine_server.encode("hello")
    held = asyncio.create_task(admin.sample(prompt, sampling_params=GREEDY, lora_name=name))
    await asyncio.sleep(0.5)
    assert not held.done()
    (loaded,) = await admin.load_lora_adapter(name, str(engine_server.model.adapters["moo"]))
    assert loaded.version == 1 and loaded.paused and loaded.held == 1
    await asyncio.sleep(0.3)
    assert not held.done(), "loaded but still paused: held"
    await admin.resume_generation(lora_name=name)
    out = await asyncio.wait_for(held, 60)
    assert out.adapter_version == 1
    assert out.sequences[0].tokens == [engine_server.word_id("moo")] * GREEDY["max_tokens"]
    await admin.unload_lora_adapter(name)


async def test_a_paused_name_that_is_never_loaded_fails_its_held_samples_on_resume(
    engine_server, admin
) -> None:
    name = f"never-{uuid.uuid4().hex[:6]}"
    await admin.pause_generation(lora_name=name)
    held = asyncio.create_task(
        admin.sample(engine_server.encode("hello"), sampling_params=GREEDY, lora_name=name)
    )
    await asyncio.sleep(0.3)
    assert not held.done()
    await admin.resume_generation(lora_name=name)
    with pytest.raises(Exception, match="not loaded"):
        await asyncio.wait_for(held, 30)


def test_pausing_before_load_needs_a_key_that_may_load_the_name() -> None:
    from skyrl_lora.server.http.auth import ApiKey
    from skyrl_lora.server.http.routes import _check_may_pause

    owner = ApiKey("k", adapters=frozenset({"mine", "mine-next"}))
    _check_may_pause(None, "anything", [])
    _check_may_pause(ApiKey("a", admin=True), "anything", [])
    _check_may_pause(owner, "mine", ["mine"])
    with pytest.raises(PermissionDeniedError, match="before its first load"):
        _check_may_pause(owner, "mine-next", ["mine"])


async def test_server_info_reports_the_logprobs_mode(engine_server, admin) -> None:
    info = await admin.server_info()
    assert info.logprobs_mode == "raw_logprobs"  # vLLM's default: before temperature/top-p


def test_logprobs_mode_is_vllms_own_flag() -> None:
    from skyrl_lora.server.http.app import parse_server_args

    args = parse_server_args(["--model", "m", "--logprobs-mode", "processed_logprobs"])
    assert args.logprobs_mode == "processed_logprobs"
    assert parse_server_args(["--model", "m"]).max_versions_per_adapter >= 1
    with pytest.raises(SystemExit):
        parse_server_args(["--model", "m", "--max-versions-per-adapter", "0"])
