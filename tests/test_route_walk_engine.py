"""Default-deny API keys against the real server's whole route table.

The server (``conftest.dev_server``) runs as the vLLM and TRL docs tell RL
users to run it, with ``VLLM_SERVER_DEV_MODE=1`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, so vLLM adds ``/collective_rpc``, its
global ``/pause``, ``/sleep`` and its own adapter routes. The walk asks the
running app for its routes and expects a tenant key to get 403 on every one
that is not on the tenant allowlist: a route a future vLLM adds is covered
without editing this test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from skyrl_lora.client import RemoteInferenceClient
from skyrl_lora.errors import PermissionDeniedError
from skyrl_lora.server.http.auth import OPEN_PATHS, TENANT_PREFIXES, TENANT_ROUTES
from skyrl_lora.server.tinker.routes import is_tinker_route
from tests.conftest import ADMIN_KEY, DevServer
from tests.conftest import DEV_TENANT as TENANT

pytestmark = pytest.mark.engine


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


async def test_every_route_off_the_allowlist_is_admin_only(
    dev_server: DevServer, local_ray
) -> None:
    routes = local_ray.get(dev_server.handle.routes.remote())
    paths = {path for path, _ in routes}
    for dev_route in ("/collective_rpc", "/pause", "/resume", "/v1/load_lora_adapter"):
        assert dev_route in paths, f"{dev_route} missing: the dev-mode env did not take effect"
    checked = []
    for path, methods in routes:
        if path in OPEN_PATHS:
            continue
        for method in methods:
            # The Tinker routes check the key's scope themselves (test_tinker_sdk_engine.py).
            if (method, path) in TENANT_ROUTES or is_tinker_route(method, path):
                continue
            if any(method == m and path.startswith(p) for m, p in TENANT_PREFIXES):
                continue  # a lease's route: it checks the lease's adapter itself
            body = {"model": "meow", "lora_name": "meow"} if method in ("POST", "PUT") else None
            status, answer = await dev_server.call(method, concrete(path), TENANT, body)
            assert status == 403, (method, path, status, answer)
            checked.append(f"{method} {path}")
    assert len(checked) >= 20, checked  # vLLM's dev and admin routes are many


async def test_the_issues_four_findings_fail_closed(dev_server: DevServer) -> None:
    outside = str(dev_server.model.adapters["moo"])  # a valid adapter outside --adapter-root
    status, answer = await dev_server.call(
        "POST", "/v1/unload_lora_adapter", TENANT, {"lora_name": "woof"}
    )
    assert status == 403 and "needs an admin key" in answer["error"]["message"]
    status, _ = await dev_server.call("POST", "/collective_rpc", TENANT, {"method": "list_loras"})
    assert status == 403
    for path in ("/pause?mode=abort", "/resume"):
        status, _ = await dev_server.call("POST", path, TENANT, {})
        assert status == 403, path
    for key in (TENANT, ADMIN_KEY):  # vLLM's loader would bypass confinement and versions
        status, answer = await dev_server.call(
            "POST", "/v1/load_lora_adapter", key, {"lora_name": "sneak", "lora_path": outside}
        )
        assert status == 403 and "/skyrl/v1/adapters/load" in answer["error"]["message"]
    status, listing = await dev_server.call("GET", "/skyrl/v1/adapters", ADMIN_KEY)
    names = [a["lora_name"] for a in listing["adapters"]]
    assert "woof" in names and "sneak" not in names
    status, answer = await dev_server.call(
        "POST",
        "/v1/completions",
        ADMIN_KEY,
        {"model": "woof", "prompt": "hi", "max_tokens": 2, "temperature": 0},
    )
    assert status == 200 and answer["choices"][0]["text"].split() == ["woof", "woof"]
    status, paused = await dev_server.call("GET", "/is_paused", ADMIN_KEY)
    assert status == 200 and paused == {"is_paused": False}


async def test_the_allowlist_still_serves_a_tenant(dev_server: DevServer) -> None:
    status, answer = await dev_server.call(
        "POST",
        "/v1/completions",
        TENANT,
        {"model": "meow", "prompt": "hi", "max_tokens": 2, "temperature": 0},
    )
    assert status == 200 and answer["choices"][0]["text"].split() == ["meow", "meow"]
    status, _ = await dev_server.call(
        "POST", "/v1/completions", TENANT, {"model": "woof", "prompt": "hi", "max_tokens": 2}
    )
    assert status == 403
    status, answer = await dev_server.call(
        "POST", "/tokenize", TENANT, {"model": "meow", "prompt": "hi"}
    )
    assert status == 200 and answer["tokens"]
    for path in ("/v1/models", "/metrics", "/skyrl/v1/adapters", "/skyrl/v1/server_info"):
        status, _ = await dev_server.call("GET", path, TENANT)
        assert status == 200, path
    for path in ("/skyrl/v1/pause", "/skyrl/v1/resume"):
        status, answer = await dev_server.call("POST", path, TENANT, {"lora_name": "meow"})
        assert status == 200, (path, answer)
    status, answer = await dev_server.call(
        "POST",
        "/skyrl/v1/adapters/load",
        TENANT,
        {"lora_name": "meow", "lora_path": str(dev_server.store), "version": 1},
    )
    # A tenant may name a version; 1 is not above meow's (and the store is empty).
    assert status in (400, 409), answer


async def test_a_tenant_pushes_only_its_own_existing_adapter(dev_server: DevServer) -> None:
    """The push body is multipart: the middleware finds ``lora_name`` in its first bytes."""
    folder = str(dev_server.model.adapters["woof"])
    async with RemoteInferenceClient(dev_server.url, api_key=TENANT) as tenant:
        (info,) = await tenant.push_lora_adapter("meow", folder)
        assert info.lora_name == "meow" and info.version == 2
        # --no-push-stream here: the open is refused, and the client sent the body.
        assert info.lora_path.startswith("push:sha256=") and not tenant.metrics().pushes_streamed
        open_body = {"lora_name": "meow", "config": {}, "weights_bytes": 1}
        status, answer = await dev_server.call(
            "POST", "/skyrl/v1/adapters/push/stream", TENANT, open_body
        )
        assert status == 422 and answer["error"]["type"] == "push_stream_unavailable", answer
        with pytest.raises(PermissionDeniedError, match="'woof'"):
            await tenant.push_lora_adapter("woof", folder)
        with pytest.raises(PermissionDeniedError):
            await tenant.push_lora_adapter("brand-new", folder)
        out = await tenant.sample(
            [1, 2], sampling_params={"max_tokens": 2, "temperature": 0}, lora_name="meow"
        )
    assert out.adapter_version == 2


async def test_hand_overs_are_off_by_default_and_the_client_pushes_bytes_instead(
    dev_server: DevServer,
) -> None:
    from safetensors.torch import load_file

    from skyrl_lora.client import AdapterHandover

    folder = Path(dev_server.model.adapters["woof"])
    with AdapterHandover(json.loads((folder / "adapter_config.json").read_text())) as adapter:
        adapter.update(load_file(str(folder / "adapter_model.safetensors")))
        body = {"lora_name": "meow", **adapter.request()}
        status, answer = await dev_server.call(
            "POST", "/skyrl/v1/adapters/handover", ADMIN_KEY, body
        )
        assert status == 422 and "allow-handover" in answer["error"]["message"], answer
        async with RemoteInferenceClient(dev_server.url, api_key=TENANT) as tenant:
            (info,) = await tenant.push_lora_adapter("meow", adapter)
            assert info.lora_path.startswith("push:sha256=")  # the bytes went instead
            assert tenant.metrics().handover_fallbacks == 1
            out = await tenant.sample(
                [1, 2], sampling_params={"max_tokens": 4, "temperature": 0}, lora_name="meow"
            )
    assert out.adapter_version == info.version
    status, info_body = await dev_server.call("GET", "/skyrl/v1/server_info", ADMIN_KEY, None)
    assert info_body["adapter_handover"] is False


async def test_slot_prefill_the_reader_naps_and_gc_freeze_can_be_turned_off(
    dev_server: DevServer,
) -> None:
    status, info = await dev_server.call("GET", "/skyrl/v1/server_info", ADMIN_KEY, None)
    assert status == 200, info
    assert info["adapter_staging"] is True and info["adapter_slot_prefill"] is False
    assert info["adapter_reader_process"] is False
    assert info["adapter_staging_yield"] is False
    assert info["gc_frozen_objects"] == 0
