"""Weights pushed over the wire and the ``finish_old`` swap policy, on the real engine."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from skyrl_lora.chunk_digest import CHUNK_BYTES, digest_of
from skyrl_lora.client import ClientConfig, InMemoryAdapter, RemoteInferenceClient
from skyrl_lora.errors import (
    BadRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from skyrl_lora.types import PUSH_STREAM_HELLO
from tests.conftest import MAX_ADAPTER_BYTES, TENANT_KEYS, EngineServer, counts_by_label, until

pytestmark = pytest.mark.engine

#: Stagings that read their file as it arrived, by read (a counter of ``/metrics``).
ARRIVING = "skyrl_adapter_arriving_reads_total"
#: Tokens: several seconds on CPU, so a push lands mid-sample (GPU runs set more).
LONG = int(os.environ.get("SKYRL_TEST_LONG", "360"))


def files_of(server: EngineServer, word: str) -> dict[str, bytes]:
    folder = Path(server.model.adapters[word])
    return {f.name: f.read_bytes() for f in folder.iterdir()}


def in_memory(files: dict[str, bytes], **config_changes: Any) -> InMemoryAdapter:
    config = {**json.loads(files["adapter_config.json"]), **config_changes}
    return InMemoryAdapter(weights=files["adapter_model.safetensors"], config=config)


def words(server: EngineServer, tokens: list[int]) -> set[str]:
    return set(server.tokenizer.decode(tokens).split())


@pytest.fixture(scope="module")
async def admin(engine_server: EngineServer):
    async with RemoteInferenceClient(engine_server.url, api_key=engine_server.admin_key) as c:
        yield c


async def sample(client: RemoteInferenceClient, server: EngineServer, name: str, n: int = 8):
    params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    return await client.sample_with_retry(
        server.encode("hello"), sampling_params=params, lora_name=name
    )


async def wait_running(client: RemoteInferenceClient, name: str, count: int = 1) -> None:
    for _ in range(1000):
        (state,) = [a for a in (await client.list_adapters()).adapters if a.lora_name == name]
        if state.engine_requests >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name}: requests never reached the engine")


async def test_push_a_folder_and_in_memory_weights(engine_server, admin) -> None:
    """This server has a push stream: the client sends the weights over it."""
    streamed = admin.metrics().pushes_streamed
    (info,) = await admin.push_lora_adapter("pushed", engine_server.model.adapters["woof"])
    assert info.version == 1 and info.lora_path.startswith("push-stream:xxh3_128-chunked-8MiB=")
    out = await sample(admin, engine_server, "pushed")
    assert words(engine_server, out.sequences[0].tokens) == {"woof"}
    (info,) = await admin.push_lora_adapter("pushed", in_memory(files_of(engine_server, "moo")))
    assert info.version == 2
    out = await sample(admin, engine_server, "pushed")
    assert words(engine_server, out.sequences[0].tokens) == {"moo"}
    assert out.adapter_version == 2
    assert admin.metrics().pushes_streamed == streamed + 2
    assert list((engine_server.snapshot_dir / ".uploads").iterdir()) == []


async def test_push_in_the_http_body_where_the_client_says_so(engine_server) -> None:
    config = ClientConfig(push_stream=False)
    key = engine_server.admin_key
    async with RemoteInferenceClient(engine_server.url, api_key=key, config=config) as client:
        (info,) = await client.push_lora_adapter("pushed-body", engine_server.model.adapters["moo"])
        assert info.lora_path.startswith("push:sha256=") and not client.metrics().pushes_streamed
        (info,) = await client.push_lora_adapter(
            "pushed-body", in_memory(files_of(engine_server, "woof"))
        )
        out = await sample(client, engine_server, "pushed-body")
    assert out.adapter_version == info.version == 2
    assert words(engine_server, out.sequences[0].tokens) == {"woof"}


async def test_push_mid_sample_abort_resume_gives_two_ranges(engine_server, admin) -> None:
    await admin.push_lora_adapter("push-ar", engine_server.model.adapters["meow"])
    task = asyncio.create_task(sample(admin, engine_server, "push-ar", LONG))
    await wait_running(admin, "push-ar")
    await asyncio.sleep(0.3)
    (info,) = await admin.push_lora_adapter("push-ar", engine_server.model.adapters["woof"])
    assert info.applied_swap_policy == "abort_resume"
    (seq,) = (await task).sequences
    assert len(seq.tokens) == LONG and seq.segments >= 2
    assert [r.version for r in seq.versions] == [1, 2]
    first, second = seq.versions
    assert words(engine_server, seq.tokens[: first.end]) == {"meow"}
    assert words(engine_server, seq.tokens[second.start :]) == {"woof"}


async def test_finish_old_lets_in_flight_finish_on_the_old_version(engine_server, admin) -> None:
    await admin.push_lora_adapter("push-fo", engine_server.model.adapters["meow"])
    old = asyncio.create_task(
        admin.sample(
            engine_server.encode("hello"),
            sampling_params={"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True},
            lora_name="push-fo",
        )
    )
    await wait_running(admin, "push-fo")
    (info,) = await admin.push_lora_adapter(
        "push-fo", engine_server.model.adapters["woof"], swap_policy="finish_old"
    )
    assert info.applied_swap_policy == "finish_old" and info.version == 2
    assert [(d.version, d.in_flight) for d in info.draining] == [(1, 1)]
    new = await sample(admin, engine_server, "push-fo", 16)  # admitted after the push
    assert words(engine_server, new.sequences[0].tokens) == {"woof"}
    assert [r.version for r in new.sequences[0].versions] == [2]
    done = await old
    (seq,) = done.sequences
    assert seq.stop_reason == "length" and len(seq.tokens) == LONG  # never aborted
    assert done.adapter_version == 1 and words(engine_server, seq.tokens) == {"meow"}
    for _ in range(100):  # the old version retires once its last request ended
        (state,) = [a for a in (await admin.list_adapters()).adapters if a.lora_name == "push-fo"]
        if not state.draining:
            break
        await asyncio.sleep(0.02)
    assert state.draining == [] and state.version == 2
    assert not (engine_server.snapshot_dir / "push-fo" / "v1").exists()


async def test_finish_old_falls_back_when_no_lora_slot_is_free(engine_server, admin) -> None:
    """Every engine slot (--max-loras 5) busy: an extra version would starve someone."""
    names = [f"slot-{i}" for i in range(5)]
    for name in names:
        await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    long = {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
    prompt = engine_server.encode("hello")
    tasks = [
        asyncio.create_task(admin.sample_with_retry(prompt, sampling_params=long, lora_name=n))
        for n in names
    ]
    for name in names:
        await wait_running(admin, name)
    (info,) = await admin.push_lora_adapter(
        names[0], engine_server.model.adapters["woof"], swap_policy="finish_old"
    )
    assert info.applied_swap_policy == "abort_resume"
    assert all(d.in_flight == 0 for d in info.draining)  # retired after the answer
    results = await asyncio.gather(*tasks)
    seq = results[0].sequences[0]
    assert [r.version for r in seq.versions] == [1, 2] and len(seq.tokens) == LONG
    assert all(r.sequences[0].segments == 1 for r in results[1:])  # the others untouched


def _damaged(files: dict[str, bytes]) -> dict[str, tuple[dict[str, Any], str]]:
    weights = files["adapter_model.safetensors"]
    from safetensors.torch import load, save

    renamed = save({k.replace("q_proj", "no_such_proj"): v for k, v in load(weights).items()})
    return {
        "truncated": ({"weights": weights[: len(weights) // 2]}, "truncated"),
        "corrupt": ({"weights": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"}, "corrupt"),
        "rank above --max-lora-rank": ({"config": {"r": 128}}, "rank"),
        "unknown target module": ({"weights": renamed}, "no_such_proj"),
    }


@pytest.mark.parametrize(
    "case", ["truncated", "corrupt", "rank above --max-lora-rank", "unknown target module"]
)
async def test_bad_pushes_get_400_and_the_old_version_serves(engine_server, admin, case) -> None:
    name = "push-bad"
    if name not in [a.lora_name for a in (await admin.list_adapters()).adapters]:
        await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    before = (await sample(admin, engine_server, name)).adapter_version
    files = files_of(engine_server, "woof")
    change, message = _damaged(files)[case]
    adapter = InMemoryAdapter(
        weights=change.get("weights", files["adapter_model.safetensors"]),
        config={**json.loads(files["adapter_config.json"]), **change.get("config", {})},
    )
    with pytest.raises(BadRequestError, match=message):
        await admin.push_lora_adapter(name, adapter)
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == before and words(engine_server, out.sequences[0].tokens) == {
        "meow"
    }
    assert list((engine_server.snapshot_dir / ".uploads").iterdir()) == []  # nothing left behind


async def raw_push(
    server: EngineServer, key: str | None, fields: dict[str, Any]
) -> tuple[int, dict]:
    form = aiohttp.FormData()
    for field, value in fields.items():
        if isinstance(value, bytes):
            form.add_field(field, value, filename=field)
        else:
            form.add_field(field, str(value))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(server.url + "/skyrl/v1/adapters/push", data=form) as resp:
            return resp.status, await resp.json(content_type=None)


async def test_malformed_pushes_get_4xx(engine_server, admin) -> None:
    files = files_of(engine_server, "woof")
    await admin.push_lora_adapter("push-form", engine_server.model.adapters["meow"])
    key = engine_server.admin_key
    cases = [
        ({"adapter_config.json": files["adapter_config.json"]}, 400, "lora_name"),
        (
            {"lora_name": "push-form", "adapter_config.json": files["adapter_config.json"]},
            400,
            "adapter_model.safetensors",
        ),
        ({"lora_name": "push-form", **files, "sha256": "0" * 64}, 400, "sha256"),
        ({"lora_name": "push-form", **files, "swap_policy": "whenever"}, 400, "swap_policy"),
        ({"lora_name": "push-form", **files, "evil.py": b"x"}, 400, "unexpected file"),
        (
            {
                "lora_name": "push-form",
                "adapter_config.json": files["adapter_config.json"],
                "adapter_model.safetensors": b"\0" * (MAX_ADAPTER_BYTES + 1),
            },
            413,
            "max-adapter-bytes",
        ),
    ]
    for fields, status, message in cases:
        got, body = await raw_push(engine_server, key, fields)
        assert got == status and message in body["error"]["message"], (fields.keys(), body)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        async with session.post(
            engine_server.url + "/skyrl/v1/adapters/push", json={"lora_name": "x"}
        ) as resp:
            assert resp.status == 400
    out = await sample(admin, engine_server, "push-form")
    assert out.adapter_version == 1 and words(engine_server, out.sequences[0].tokens) == {"meow"}
    assert list((engine_server.snapshot_dir / ".uploads").iterdir()) == []
    with pytest.raises(PayloadTooLargeError):
        big = InMemoryAdapter(weights=b"\0" * (MAX_ADAPTER_BYTES + 1), config={})
        await admin.push_lora_adapter("push-form", big)


async def test_tenant_keys_push_only_their_own_existing_adapters(engine_server, admin) -> None:
    """With ``--api-keys`` the push stream (on by default) takes the keys and
    scopes of the HTTP routes: a push over it is opened by a route like any
    other (no key: 401; another tenant's adapter or a new name: 403), and
    its port admits nothing but a ticket that such an open issued."""
    await admin.push_lora_adapter("sec-a", engine_server.model.adapters["meow"])
    woof = engine_server.model.adapters["woof"]
    async with RemoteInferenceClient(engine_server.url, api_key=TENANT_KEYS["sec-a"]) as tenant:
        (info,) = await tenant.push_lora_adapter("sec-a", woof)
        assert info.lora_name == "sec-a" and tenant.metrics().pushes_streamed == 1
        assert info.lora_path.startswith("push-stream:")
        with pytest.raises(PermissionDeniedError):
            await tenant.push_lora_adapter("sec-b", woof)
        with pytest.raises(PermissionDeniedError):
            await tenant.push_lora_adapter("sec-a-new-name", woof)
        assert tenant.metrics().pushes_streamed == 1  # refused at the open: no bytes went
    files = files_of(engine_server, "moo")
    body = {
        "lora_name": "sec-a",
        "config": json.loads(files["adapter_config.json"]),
        "weights_bytes": len(files["adapter_model.safetensors"]),
    }
    url = engine_server.url + "/skyrl/v1/adapters/push/stream"
    for headers, status in [({}, 401), ({"Authorization": f"Bearer {TENANT_KEYS['sec-b']}"}, 403)]:
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(url, json=body) as resp:
                assert resp.status == status, await resp.text()
    made_up = {"port": (await admin.server_info()).push_stream_port, "ticket": "0" * 32}
    answer = await asyncio.to_thread(stream_in_steps, engine_server, made_up)
    assert answer["error"]["type"] == "authentication_error", answer
    (state,) = [a for a in (await admin.list_adapters()).adapters if a.lora_name == "sec-a"]
    assert state.version == info.version  # nothing refused was loaded


def padded(weights: bytes, header_end: int) -> bytes:
    """The same safetensors file with metadata in its header up to byte
    ``header_end`` (a multiple of 8): a file of several 8 MiB chunks (so of
    several lanes) from a tiny adapter."""
    length = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8 : 8 + length])
    header["__metadata__"] = {**header.get("__metadata__", {}), "pad": ""}
    bare = len(json.dumps(header).encode())
    header["__metadata__"]["pad"] = "x" * (header_end - 8 - bare)
    raw = json.dumps(header).encode()
    assert 8 + len(raw) == header_end
    return len(raw).to_bytes(8, "little") + raw + weights[8 + length :]


async def open_stream(server: EngineServer, name: str, files: dict[str, bytes]) -> dict[str, Any]:
    """Open a push over HTTP as the client does; the ticket."""
    body = {
        "lora_name": name,
        "config": json.loads(files["adapter_config.json"]),
        "weights_bytes": len(files["adapter_model.safetensors"]),
    }
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        url = server.url + "/skyrl/v1/adapters/push/stream"
        async with session.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())


def stream_in_steps(server: EngineServer, ticket: dict[str, Any], *steps: bytes | float) -> dict:
    """One lane: each bytes step is sent, each float step is a pause; the answer."""
    host = urlsplit(server.url).hostname or "127.0.0.1"
    with socket.create_connection((host, ticket["port"]), timeout=60) as sock:
        sock.sendall(PUSH_STREAM_HELLO + ticket["ticket"].encode() + b"00\n")
        for step in steps:
            if isinstance(step, float):
                time.sleep(step)
            else:
                sock.sendall(step)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
    return dict(json.loads(answer))


async def test_a_streamed_push_is_staged_as_it_arrives_and_installed_whole(
    engine_server, admin, http
) -> None:
    """The load starts with the stream: the staging reads the file as its bytes
    land (``skyrl_adapter_arriving_reads_total``), and the new version serves
    only once every byte came and the digest matched."""
    name = "push-arriving"
    await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    await sample(admin, engine_server, name)  # v1 installed, the engine warm: the next is quick
    before = sum((await counts_by_label(http, engine_server.url, ARRIVING)).values())
    files = files_of(engine_server, "woof")
    # The header fills the first chunk but for a few tensor bytes; the rest is the second.
    weights = padded(files["adapter_model.safetensors"], CHUNK_BYTES - 64)
    files = {**files, "adapter_model.safetensors": weights}
    ticket = await open_stream(engine_server, name, files)
    sending = asyncio.create_task(
        asyncio.to_thread(
            stream_in_steps,
            engine_server,
            ticket,
            weights[:CHUNK_BYTES],
            3.0,  # long enough for the sample below on a loaded CI machine
            weights[CHUNK_BYTES:],
            digest_of(weights).encode(),
        )
    )
    await asyncio.sleep(0.5)  # the first chunk is in, its staging waits: the old version serves
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == 1 and words(engine_server, out.sequences[0].tokens) == {"meow"}
    answer = await sending
    assert answer["status"] == 200 and answer["adapter"]["version"] == 2, answer
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == 2 and words(engine_server, out.sequences[0].tokens) == {"woof"}
    after = sum((await counts_by_label(http, engine_server.url, ARRIVING)).values())
    assert after == before + 1
    assert list((engine_server.snapshot_dir / ".uploads").iterdir()) == []
    snapshot = engine_server.snapshot_dir / name
    assert not list(snapshot.rglob(".arriving"))  # the marker goes once the file is whole
    # The engine writes the snapshot's weights file from what it read, after the swap.
    await until(lambda: not list(snapshot.rglob("weights.pending")), timeout_s=10)
    assert (snapshot / "v2" / "adapter_model.safetensors").read_bytes() == weights


async def test_a_streamed_push_cut_or_damaged_installs_nothing(engine_server, admin) -> None:
    """Whether the stream breaks off or its digest does not match (after the
    staging read every byte), the old version serves and nothing is left."""
    name = "push-cut"
    await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    files = files_of(engine_server, "woof")
    weights = files["adapter_model.safetensors"]
    ticket = await open_stream(engine_server, name, files)
    cut = await asyncio.to_thread(stream_in_steps, engine_server, ticket, weights[:100])
    assert cut["status"] == 400 and "broke off" in cut["error"]["message"], cut
    ticket = await open_stream(engine_server, name, files)
    wrong = digest_of(weights[1:]).encode()
    damaged = await asyncio.to_thread(stream_in_steps, engine_server, ticket, weights, 0.3, wrong)
    assert damaged["status"] == 400 and "damaged" in damaged["error"]["message"], damaged
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == 1 and words(engine_server, out.sequences[0].tokens) == {"meow"}
    assert list((engine_server.snapshot_dir / ".uploads").iterdir()) == []
    (info,) = await admin.push_lora_adapter(name, engine_server.model.adapters["woof"])
    assert info.version == 2  # the failed pushes took no version
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == 2 and words(engine_server, out.sequences[0].tokens) == {"woof"}
    versions = sorted(p.name for p in (engine_server.snapshot_dir / name).iterdir())
    assert len(versions) <= 2, versions  # v1 (draining or gone) and v2; the failed ones left none


async def test_a_push_over_several_lanes_serves_and_repeats(engine_server, admin, http) -> None:
    """A push of three chunks goes over three lanes at once; its header spans
    two chunks, so it is checked and staged from the whole file; the version
    serves, and naming it again with the same weights reloads nothing."""
    name = "push-lanes"
    await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    before = sum((await counts_by_label(http, engine_server.url, ARRIVING)).values())
    files = files_of(engine_server, "woof")
    weights = padded(files["adapter_model.safetensors"], 17 << 20)
    adapter = in_memory({**files, "adapter_model.safetensors": weights})
    (info,) = await admin.push_lora_adapter(name, adapter)
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == info.version == 2
    assert words(engine_server, out.sequences[0].tokens) == {"woof"}
    after = sum((await counts_by_label(http, engine_server.url, ARRIVING)).values())
    assert after == before  # read whole, not as it arrived
    folder = engine_server.snapshot_dir / name / "v2"
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # no marker left
    assert (folder / "adapter_model.safetensors").read_bytes() == weights
    # Naming the current version with the same weights is a repeat: nothing reloads.
    (again,) = await admin.push_lora_adapter(name, adapter, version=2)
    assert again.version == 2
