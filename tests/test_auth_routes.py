"""The API-key middleware on its own: default-deny for tenants, vLLM's adapter
routes refused for everyone, and a bounded look into multipart pushes.

The middleware is plain ASGI and depends on nothing from vLLM, so it runs
here in front of a small Starlette app; ``tests/test_route_walk_engine.py``
walks the real server's route table.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from skyrl_lora.server.http.auth import (
    PUSH_NAME_WINDOW,
    TENANT_ROUTES,
    ApiKey,
    AuthMiddleware,
    KeyStore,
)

ADMIN = "admin-key"
TENANT = "tenant-key"


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"path": request.url.path, "bytes": len(body)})


PATHS = [
    "/v1/completions",
    "/skyrl/v1/sample",
    "/skyrl/v1/pause",
    "/skyrl/v1/adapters/load",
    "/skyrl/v1/adapters/push",
    "/skyrl/v1/adapters/lease",
    "/collective_rpc",
    "/pause",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/some_route_a_future_vllm_adds",
]


def make_app() -> Any:
    app = Starlette(routes=[Route(p, echo, methods=["GET", "POST"]) for p in PATHS])
    keys = KeyStore(
        [
            ApiKey(ADMIN, admin=True),
            ApiKey(TENANT, adapters=frozenset({"meow"}), base_model=True),
        ]
    )
    return AuthMiddleware(app, keys=keys, base_model_name="base")


@pytest.fixture(scope="module")
def client() -> Any:
    with TestClient(make_app()) as test_client:
        yield test_client


def post(client: Any, path: str, key: str, **kwargs: Any) -> Any:
    return client.post(path, headers={"Authorization": f"Bearer {key}"}, **kwargs)


@pytest.mark.parametrize(
    "path",
    ["/collective_rpc", "/pause", "/v1/unload_lora_adapter", "/some_route_a_future_vllm_adds"],
)
def test_routes_off_the_allowlist_are_admin_only(client: Any, path: str) -> None:
    denied = post(client, path, TENANT, json={"model": "meow", "lora_name": "meow"})
    assert denied.status_code == 403
    assert "needs an admin key" in denied.json()["error"]["message"]
    assert post(client, path, ADMIN, json={}).status_code == 200
    assert client.get(path, headers={"Authorization": f"Bearer {TENANT}"}).status_code == 403


def test_vllm_adapter_loads_are_refused_for_admins_too(client: Any) -> None:
    for key in (TENANT, ADMIN):
        body = {"lora_name": "meow", "lora_path": "/tmp"}
        answer = post(client, "/v1/load_lora_adapter", key, json=body)
        assert answer.status_code == 403
        assert "/skyrl/v1/adapters/load" in answer.json()["error"]["message"]


def test_tenant_data_and_control_routes_check_the_adapter(client: Any) -> None:
    sample = {"prompt_token_ids": [1], "lora_name": "meow"}
    assert post(client, "/skyrl/v1/sample", TENANT, json=sample).json()["bytes"] > 0
    other = {**sample, "lora_name": "woof"}
    assert post(client, "/skyrl/v1/sample", TENANT, json=other).status_code == 403
    completion = {"model": "base", "prompt": "hi"}
    assert post(client, "/v1/completions", TENANT, json=completion).status_code == 200
    assert post(client, "/skyrl/v1/pause", TENANT, json={"lora_name": "meow"}).status_code == 200
    assert post(client, "/skyrl/v1/pause", TENANT, json={}).status_code == 403
    pinned = {"lora_name": "meow", "lora_path": "/x", "version": 7}  # a trainer's own step
    assert post(client, "/skyrl/v1/adapters/load", TENANT, json=pinned).status_code == 200
    lease = {"lora_name": "woof", "version": 1}
    assert post(client, "/skyrl/v1/adapters/lease", TENANT, json=lease).status_code == 403
    assert post(client, "/skyrl/v1/adapters/lease", ADMIN, json=lease).status_code == 200


def test_every_allowlisted_route_is_a_known_shape() -> None:
    """The allowlist is small and explicit: data-plane, reads, and our control routes."""
    assert all(method in ("GET", "POST") for method, _ in TENANT_ROUTES)
    assert not any("lora_adapter" in path or "rpc" in path for _, path in TENANT_ROUTES)


def multipart(fields: list[tuple[str, bytes]], boundary: str = "XyZ") -> tuple[bytes, str]:
    parts = []
    for name, value in fields:
        disposition = f'form-data; name="{name}"'
        if name == "weights":
            disposition += '; filename="adapter.safetensors"'
        parts.append(
            f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
        )
    return b"".join(
        parts
    ) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_push_is_authorized_by_its_lora_name_field(client: Any) -> None:
    weights = b"\x00" * (3 * PUSH_NAME_WINDOW)
    body, content_type = multipart([("lora_name", b"meow"), ("weights", weights)])
    headers = {"Authorization": f"Bearer {TENANT}", "Content-Type": content_type}
    answer = client.post("/skyrl/v1/adapters/push", content=body, headers=headers)
    assert answer.status_code == 200
    assert answer.json()["bytes"] == len(body), "the route gets the whole body, unchanged"
    body, content_type = multipart([("lora_name", b"woof"), ("weights", weights)])
    headers["Content-Type"] = content_type
    answer = client.post("/skyrl/v1/adapters/push", content=body, headers=headers)
    assert answer.status_code == 403 and "'woof'" in answer.json()["error"]["message"]


async def test_push_with_the_name_after_the_weights_is_refused_after_a_bounded_read() -> None:
    """A tenant cannot make the middleware buffer a whole upload to find the name."""
    chunk = b"\x01" * 4096
    body, content_type = multipart([("weights", chunk * 1000), ("lora_name", b"meow")])
    pieces = [body[i : i + len(chunk)] for i in range(0, len(body), len(chunk))]
    served = 0

    async def receive() -> dict[str, Any]:
        nonlocal served
        piece = pieces[served]
        served += 1
        return {"type": "http.request", "body": piece, "more_body": served < len(pieces)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/skyrl/v1/adapters/push",
        "headers": [
            (b"authorization", f"Bearer {TENANT}".encode()),
            (b"content-type", content_type.encode()),
        ],
    }
    await asyncio.wait_for(make_app()(scope, receive, send), 10)
    assert sent[0]["status"] == 403
    assert "before the weights" in json.loads(sent[1]["body"])["error"]["message"]
    assert served * len(chunk) <= PUSH_NAME_WINDOW + len(chunk), "read no more than the window"
