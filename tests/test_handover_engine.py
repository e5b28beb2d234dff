"""Adapters handed over from a trainer's memory, on the real engine.

The session server runs with ``--allow-handover``; the trainer here is the
test process, on the same host, handing over host tensors through a
shared-memory file (the GPU hand-over, CUDA IPC, is in ``gpu_tests``). The
route-walk server, without the flag, refuses them (``test_route_walk_engine``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from skyrl_lora.client import AdapterHandover, RemoteInferenceClient
from skyrl_lora.errors import (
    BadRequestError,
    ConflictError,
    HandoverUnavailableError,
    PermissionDeniedError,
)
from skyrl_lora.server.adapters import snapshot_writer
from tests.conftest import TENANT_KEYS, EngineServer, counts_by_label
from tests.test_push_engine import LONG, admin, sample, wait_running, words

pytestmark = pytest.mark.engine

__all__ = ["admin"]  # the module-scoped admin client fixture, shared with the push tests


def handover_of(server: EngineServer, word: str) -> AdapterHandover:
    """A trainer's adapter: the embedded ``word`` adapter's tensors, in memory."""
    folder = Path(server.model.adapters[word])
    adapter = AdapterHandover(json.loads((folder / "adapter_config.json").read_text()))
    adapter.update(load_file(str(folder / "adapter_model.safetensors")))
    return adapter


async def test_a_handed_over_adapter_serves_like_the_same_weights_pushed(
    engine_server, admin
) -> None:
    with handover_of(engine_server, "woof") as adapter:
        (info,) = await admin.push_lora_adapter("handed", adapter)
    assert info.version == 1 and info.lora_path == "handover:shm"
    assert admin.metrics().handovers == 1 and admin.metrics().handover_fallbacks == 0
    await admin.push_lora_adapter("handed-pushed", engine_server.model.adapters["woof"])
    handed = await sample(admin, engine_server, "handed", 24)
    pushed = await sample(admin, engine_server, "handed-pushed", 24)
    assert handed.sequences[0].tokens == pushed.sequences[0].tokens
    assert words(engine_server, handed.sequences[0].tokens) == {"woof"}
    # The snapshot is an ordinary adapter folder (vLLM reads it again after an eviction).
    snapshot = engine_server.snapshot_dir / "handed" / "v1"
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


async def test_a_layout_seen_before_builds_from_its_template_and_serves_the_same(
    engine_server, admin, http
) -> None:
    """The second hand-over of a layout skips vLLM's loader and packing
    (:mod:`skyrl_lora.server.transfer.handover_template`): it must serve what
    the same weights pushed as files serve, token for token, and its snapshot
    must hold the weights as handed over (not with the scaling folded in)."""
    woof = Path(engine_server.model.adapters["woof"]) / "adapter_model.safetensors"
    with handover_of(engine_server, "meow") as adapter:
        await admin.push_lora_adapter("handed-tpl", adapter)  # the layout is known from now
        before = await counts_by_label(http, engine_server.url, "skyrl_adapter_reads_total")
        adapter.update(load_file(str(woof)))
        (info,) = await admin.push_lora_adapter("handed-tpl", adapter)
    assert info.version == 2
    after = await counts_by_label(http, engine_server.url, "skyrl_adapter_reads_total")
    assert after.get("handover_template", 0) == before.get("handover_template", 0) + 1
    await admin.push_lora_adapter("handed-tpl-pushed", engine_server.model.adapters["woof"])
    handed = (await sample(admin, engine_server, "handed-tpl", 24)).sequences[0]
    pushed = (await sample(admin, engine_server, "handed-tpl-pushed", 24)).sequences[0]
    assert handed.tokens == pushed.tokens
    assert handed.logprobs == pytest.approx(pushed.logprobs, abs=1e-5)
    snapshot = engine_server.snapshot_dir / "handed-tpl" / "v2"
    snapshot_writer.wait_for_weights(snapshot, timeout_s=30)
    saved = load_file(str(snapshot / "adapter_model.safetensors"))
    original = load_file(str(woof))
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)


async def test_a_hand_over_mid_sample_aborts_resumes_and_loses_nothing(
    engine_server, admin
) -> None:
    with handover_of(engine_server, "meow") as adapter:
        await admin.push_lora_adapter("handed-ar", adapter)
        task = asyncio.create_task(sample(admin, engine_server, "handed-ar", LONG))
        await wait_running(admin, "handed-ar")
        await asyncio.sleep(0.3)
        folder = Path(engine_server.model.adapters["moo"])
        adapter.update(load_file(str(folder / "adapter_model.safetensors")))  # the same buffer
        (info,) = await admin.push_lora_adapter("handed-ar", adapter, version=5)
    assert info.applied_swap_policy == "abort_resume" and info.version == 5
    (seq,) = (await task).sequences
    assert len(seq.tokens) == LONG and len(seq.logprobs) == LONG
    assert [r.version for r in seq.versions] == [1, 5]
    first, second = seq.versions
    assert words(engine_server, seq.tokens[: first.end]) == {"meow"}
    assert words(engine_server, seq.tokens[second.start :]) == {"moo"}


async def post_handover(server: EngineServer, key: str | None, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(server.url + "/skyrl/v1/adapters/handover", json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def test_bad_hand_overs_get_a_clear_4xx_and_lose_nothing_in_flight(
    engine_server, admin
) -> None:
    tenant_name, tenant_key = next(iter(TENANT_KEYS.items()))
    other = next(n for n in TENANT_KEYS if n != tenant_name)
    for name in (tenant_name, other):
        if name not in [a.lora_name for a in (await admin.list_adapters()).adapters]:
            await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    running = asyncio.create_task(sample(admin, engine_server, tenant_name, LONG))
    await wait_running(admin, tenant_name)
    with handover_of(engine_server, "woof") as adapter:
        good = {"lora_name": tenant_name, **adapter.request()}
        end = good["buffer"]["nbytes"]
        past_end = [{**good["tensors"][0], "offset": end}]
        missing = {**good["buffer"], "name": "skyrl-handover-" + "0" * 32}
        current = (await admin.list_adapters()).adapters
        running_version = next(a.version for a in current if a.lora_name == tenant_name)
        cases = [
            ({**good, "tensors": past_end}, tenant_key, 400, "past the buffer"),
            ({**good, "buffer": missing}, tenant_key, 422, "push the weights instead"),
            ({**good, "buffer": {**good["buffer"], "nbytes": 1 << 30}}, tenant_key, 413, "limit"),
            ({**good, "lora_name": other}, tenant_key, 403, other),
            ({**good, "version": running_version}, tenant_key, 409, "new version"),
            ({**good, "version": 0}, tenant_key, 400, "version"),
            ({**good, "buffer": {"kind": "pickle"}}, tenant_key, 400, "buffer"),
        ]
        for body, key, status, message in cases:
            got, answer = await post_handover(engine_server, key, body)
            assert got == status, (status, answer)
            assert message in answer["error"]["message"], answer
        async with RemoteInferenceClient(engine_server.url, api_key=tenant_key) as tenant:
            with pytest.raises(PermissionDeniedError):
                await tenant.push_lora_adapter(other, adapter)
            with pytest.raises(ConflictError):
                await tenant.push_lora_adapter(tenant_name, adapter, version=running_version)
    (seq,) = (await running).sequences
    assert len(seq.tokens) == LONG and seq.segments == 1  # never touched
    assert list((engine_server.snapshot_dir / ".uploads").iterdir()) == []  # nothing left behind


async def test_a_hand_over_the_engine_cannot_build_fails_and_the_old_version_serves(
    engine_server, admin
) -> None:
    name = "handed-bad"
    await admin.push_lora_adapter(name, engine_server.model.adapters["meow"])
    folder = Path(engine_server.model.adapters["woof"])
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    renamed = {k.replace("q_proj", "no_such_proj"): v for k, v in tensors.items()}
    config = json.loads((folder / "adapter_config.json").read_text())
    with AdapterHandover(config) as adapter:
        adapter.update(renamed)
        with pytest.raises(BadRequestError, match="no_such_proj"):
            await admin.push_lora_adapter(name, adapter)
    out = await sample(admin, engine_server, name)
    assert out.adapter_version == 1 and words(engine_server, out.sequences[0].tokens) == {"meow"}


def test_the_client_needs_tensors_of_one_device() -> None:
    with pytest.raises(ValueError, match="one device"):
        AdapterHandover({}).update({"a": torch.zeros(2), "b": torch.zeros(2, device="meta")})
    with pytest.raises(RuntimeError, match="update"):
        AdapterHandover({}).request()
    assert HandoverUnavailableError.status == 422
