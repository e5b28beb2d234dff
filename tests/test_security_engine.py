"""Tenant isolation, adapter path confinement and fault semantics on the real engine."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import aiohttp
import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import AuthenticationError, BadRequestError, PermissionDeniedError
from tests.conftest import TENANT_KEYS, EngineServer

pytestmark = pytest.mark.engine


async def call(
    server: EngineServer, method: str, path: str, key: str | None, body=None
) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.request(method, server.url + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


@pytest.fixture(scope="module")
async def tenants(engine_server: EngineServer) -> EngineServer:
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as admin:
        await admin.load_lora_adapter("sec-a", str(engine_server.model.adapters["meow"]))
        await admin.load_lora_adapter("sec-b", str(engine_server.model.adapters["woof"]))
    return engine_server


def sample_body(server: EngineServer, lora: str | None, max_tokens: int = 8) -> dict:
    return {
        "prompt_token_ids": server.encode("hello"),
        "lora_name": lora,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    }


async def test_missing_or_wrong_key_is_401_everywhere(tenants) -> None:
    for key in (None, "not-a-key"):
        status, body = await call(
            tenants, "POST", "/skyrl/v1/sample", key, sample_body(tenants, "sec-a")
        )
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, _ = await call(
            tenants,
            "POST",
            "/v1/completions",
            key,
            {"model": "sec-a", "prompt": "hi", "max_tokens": 2},
        )
        assert status == 401
        status, _ = await call(tenants, "GET", "/skyrl/v1/adapters", key)
        assert status == 401
    status, _ = await call(tenants, "GET", "/health", None)
    assert status == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/skyrl/v1/sample", "sample-b"),
        ("POST", "/skyrl/v1/pause", {"lora_name": "sec-b"}),
        ("POST", "/skyrl/v1/resume", {"lora_name": "sec-b"}),
        ("POST", "/skyrl/v1/abort_lora_requests", {"lora_name": "sec-b"}),
        ("POST", "/skyrl/v1/adapters/load", {"lora_name": "sec-b", "lora_path": "x"}),
        ("POST", "/skyrl/v1/adapters/unload", {"lora_name": "sec-b"}),
        ("POST", "/skyrl/v1/pause", {}),
        ("POST", "/skyrl/v1/sample", "sample-base"),
        ("POST", "/v1/completions", {"model": "sec-b", "prompt": "hi", "max_tokens": 2}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "sec-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ],
)
async def test_tenant_key_cannot_touch_another_tenant(tenants, method, path, body) -> None:
    if body == "sample-b":
        body = sample_body(tenants, "sec-b")
    elif body == "sample-base":
        body = sample_body(tenants, None)
    status, answer = await call(tenants, method, path, TENANT_KEYS["sec-a"], body)
    assert status == 403, answer
    assert answer["error"]["type"] == "permission_denied" and answer["error"]["message"]


async def test_tenant_key_works_on_its_own_adapter(tenants) -> None:
    key = TENANT_KEYS["sec-a"]
    status, answer = await call(
        tenants, "POST", "/skyrl/v1/sample", key, sample_body(tenants, "sec-a")
    )
    assert status == 200 and answer["sequences"][0]["tokens"] == [tenants.word_id("meow")] * 8
    status, answer = await call(
        tenants,
        "POST",
        "/v1/completions",
        key,
        {"model": "sec-a", "prompt": "hi", "max_tokens": 3, "temperature": 0},
    )
    assert status == 200 and answer["choices"][0]["text"].split() == ["meow"] * 3
    status, listing = await call(tenants, "GET", "/skyrl/v1/adapters", key)
    assert [a["lora_name"] for a in listing["adapters"]] == ["sec-a"], "other tenants are hidden"
    status, answer = await call(
        tenants,
        "POST",
        "/skyrl/v1/adapters/load",
        key,
        {"lora_name": "sec-new", "lora_path": str(tenants.model.adapters["moo"])},
    )
    assert status == 403, "only an admin loads a new adapter name"


async def test_client_raises_typed_auth_errors(tenants) -> None:
    async with RemoteInferenceClient(tenants.url, api_key=TENANT_KEYS["sec-a"]) as client:
        out = await client.sample(
            tenants.encode("hi"),
            sampling_params={"max_tokens": 2, "ignore_eos": True},
            lora_name="sec-a",
        )
        assert len(out.sequences[0].tokens) == 2
        with pytest.raises(PermissionDeniedError, match="sec-b"):
            await client.pause_generation(lora_name="sec-b")
        assert not client.gates.is_closed("sec-b")
    async with RemoteInferenceClient(tenants.url, api_key="wrong") as client:
        with pytest.raises(AuthenticationError):
            await client.sample(tenants.encode("hi"), lora_name="sec-a")


def _outside_copy(server: EngineServer) -> str:
    """A valid adapter right next to the allowed root, so ``root/../name`` reaches it."""
    assert server.adapter_root is not None
    outside = server.adapter_root.parent / "outside-adapter"
    if not outside.exists():
        shutil.copytree(server.model.adapters["woof"], outside)
    return str(outside)


async def test_adapter_paths_are_confined_to_the_roots(tenants) -> None:
    root = tenants.adapter_root
    assert root is not None
    outside = _outside_copy(tenants)
    (root / "link-out").symlink_to(outside)
    inner = root / "sneaky"
    inner.mkdir()
    shutil.copy(os.path.join(outside, "adapter_config.json"), inner)
    (inner / "adapter_model.safetensors").symlink_to(
        os.path.join(outside, "adapter_model.safetensors")
    )
    async with RemoteInferenceClient(tenants.url, api_key=tenants.admin_key) as admin:
        for path in (
            outside,
            str(root / ".." / "outside-adapter"),
            str(root / "link-out"),
            str(inner),
            "/etc",
        ):
            with pytest.raises(BadRequestError, match="outside the allowed adapter roots"):
                await admin.load_lora_adapter("sec-a", path)
        state = [a for a in (await admin.list_adapters()).adapters if a.lora_name == "sec-a"]
        assert state[0].lora_path == str(tenants.model.adapters["meow"].resolve())


async def test_corrupt_or_missing_weights_keep_the_old_version(tenants) -> None:
    root = tenants.adapter_root
    assert root is not None
    corrupt = root / "corrupt"
    shutil.copytree(tenants.model.adapters["woof"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 100)
    missing = root / "missing"
    missing.mkdir()
    shutil.copy(tenants.model.adapters["woof"] / "adapter_config.json", missing)
    async with RemoteInferenceClient(tenants.url, api_key=tenants.admin_key) as admin:
        before = next(a for a in (await admin.list_adapters()).adapters if a.lora_name == "sec-b")
        for path in (corrupt, missing):
            with pytest.raises(BadRequestError, match="loading LoRA adapter 'sec-b'"):
                await admin.reload_lora_adapter("sec-b", str(path))
        after = next(a for a in (await admin.list_adapters()).adapters if a.lora_name == "sec-b")
        assert after.version == before.version and not after.paused
        out = await admin.sample(
            tenants.encode("hi"),
            sampling_params={"max_tokens": 4, "temperature": 0},
            lora_name="sec-b",
        )
        assert out.sequences[0].tokens == [tenants.word_id("woof")] * 4
        assert out.adapter_version == before.version


async def test_failed_load_while_paused_stays_paused_and_loses_nothing(tenants) -> None:
    root = tenants.adapter_root
    assert root is not None
    corrupt = root / "corrupt-2"
    shutil.copytree(tenants.model.adapters["moo"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    async with RemoteInferenceClient(tenants.url, api_key=tenants.admin_key) as admin:
        await admin.load_lora_adapter("sec-fault", str(tenants.model.adapters["meow"]))
        running = asyncio.create_task(
            admin.sample_with_retry(
                tenants.encode("hi"),
                sampling_params={"max_tokens": 200, "temperature": 0, "ignore_eos": True},
                lora_name="sec-fault",
            )
        )
        await asyncio.sleep(0.5)
        (paused,) = await admin.pause_generation(lora_name="sec-fault")
        held = asyncio.create_task(
            admin.sample(
                tenants.encode("hi"),
                sampling_params={"max_tokens": 5, "temperature": 0},
                lora_name="sec-fault",
            )
        )
        await asyncio.sleep(0.3)
        with pytest.raises(BadRequestError):
            await admin.reload_lora_adapter("sec-fault", str(corrupt))
        (state,) = [a for a in (await admin.list_adapters()).adapters if a.lora_name == "sec-fault"]
        assert state.paused and state.version == 1 and state.held == 1
        assert not held.done() and not running.done()
        await admin.resume_generation(lora_name="sec-fault")
        done_held, done_running = await asyncio.wait_for(asyncio.gather(held, running), 60)
    assert (
        done_held.adapter_version == 1
        and done_held.sequences[0].tokens == [tenants.word_id("meow")] * 5
    )
    (seq,) = done_running.sequences
    assert len(seq.tokens) == 200 and set(seq.tokens) == {tenants.word_id("meow")}
    assert paused.aborted == 1 and seq.segments == 2


async def test_pause_edge_cases_behave_as_documented(tenants, http) -> None:
    url = tenants.url + "/skyrl/v1"
    async with http.post(url + "/pause", json={"lora_name": "no-such"}) as r:
        assert r.status == 200, "an admin may pause a name before its first load"
    async with http.post(url + "/resume", json={"lora_name": "no-such"}) as r:
        assert (await r.json())["was_paused"] is True
    async with http.post(url + "/resume", json={"lora_name": "no-such"}) as r:
        assert r.status == 404, "not loaded and not paused: unknown"
    async with http.post(url + "/resume", json={"lora_name": "sec-b"}) as r:
        assert (await r.json())["was_paused"] is False, "resume without pause is a no-op"
    started = time.monotonic()
    async with http.post(url + "/pause", json={"lora_name": "sec-b"}) as r:
        first = await r.json()
    async with http.post(url + "/pause", json={"lora_name": "sec-b"}) as r:
        second = await r.json()
    assert first["aborted"] == 0 and not first["was_paused"], "nothing in flight: nothing aborted"
    assert second["was_paused"] and second["paused"], "a double pause is harmless"
    assert time.monotonic() - started < 2.0
    async with http.post(url + "/resume", json={"lora_name": "sec-b"}) as r:
        assert (await r.json())["was_paused"] is True


async def test_metrics_and_counters_are_exported(tenants, http) -> None:
    async with http.get(tenants.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    for name in (
        "skyrl_pauses_total",
        "skyrl_aborted_requests_total",
        "skyrl_held_requests_total",
        "skyrl_resumed_segments_total",
        "skyrl_paced_requests_total",
        "skyrl_pause_to_aborted_seconds_bucket",
        "skyrl_event_loop_lag_seconds_bucket",
        "skyrl_gc_pause_seconds_bucket",
        "vllm:",
    ):
        assert name in text, name
