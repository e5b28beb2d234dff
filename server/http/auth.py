"""API keys scoped to adapters, enforced on every route (vLLM's included).

A keys file (``--api-keys FILE``) lists keys, each with the adapters it may
sample from and control; ``admin`` keys may do everything, including the
global pause and loading adapter names no tenant owns yet. The check runs in
an ASGI middleware in front of the whole app, so vLLM's own routes are
covered without touching them.

Tenant keys are **default-deny**: a tenant may call only the routes listed
in :data:`TENANT_ROUTES`, and on the ones that name an adapter only its own
adapters (read from the JSON body: ``lora_name`` on our routes, ``model`` on
vLLM's; from the ``lora_name`` form field on a multipart push). Every other
route, including whatever a future vLLM adds (``VLLM_SERVER_DEV_MODE``'s
``/collective_rpc``, ``/pause``, ``/sleep``, ...), needs an admin key. vLLM's
own ``/v1/load_lora_adapter`` (present with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) is refused for every key, admins
included: it would change the engine's adapters behind the registry's
versions, gate and path confinement. ``/v1/unload_lora_adapter`` is ours
(SkyRL's client unloads there, ``skyrl_routes``): admin-only.

Keys file format::

    {"keys": [
        {"key": "admin-secret", "admin": true},
        {"key": "tenant-a-secret", "adapters": ["tenant-a"]},
        {"key": "tenant-b-secret", "adapters": ["tenant-b"], "base_model": true}
    ]}
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skyrl_lora.errors import AuthenticationError, PermissionDeniedError, ServerError
from skyrl_lora.types import ErrorBody, ErrorDetail

from ..tinker.routes import PREFIX as TINKER_PREFIX
from ..tinker.routes import is_tinker_route

#: Routes anyone may call: liveness for orchestrators.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
#: Where the middleware leaves the authenticated key for the routes.
SCOPE_KEY = "skyrl.api_key"


class Access(Enum):
    """What a tenant key must show to call a route."""

    READ = "read"  # read-only; the route filters what it shows by key
    DATA = "data"  # names an adapter (or the base model) in its body
    CONTROL = "control"  # names one of the caller's adapters in ``lora_name``
    PUSH = "push"  # multipart upload naming one of the caller's adapters
    TINKER = "tinker"  # the Tinker SDK's routes: each checks the key's scope itself
    LEASE = "lease"  # names a lease in its path: the route checks the lease's adapter


#: The tenant allowlist, by (method, path). Anything not here is admin-only.
TENANT_ROUTES: dict[tuple[str, str], Access] = {
    ("GET", "/v1/models"): Access.READ,
    ("GET", "/metrics"): Access.READ,
    ("GET", "/load"): Access.READ,
    ("GET", "/skyrl/v1/adapters"): Access.READ,
    ("GET", "/skyrl/v1/server_info"): Access.READ,
    ("POST", "/v1/completions"): Access.DATA,
    ("POST", "/v1/chat/completions"): Access.DATA,
    ("POST", "/tokenize"): Access.DATA,
    ("POST", "/detokenize"): Access.DATA,
    ("POST", "/skyrl/v1/sample"): Access.DATA,
    ("POST", "/skyrl/v1/pause"): Access.CONTROL,
    ("POST", "/skyrl/v1/resume"): Access.CONTROL,
    ("POST", "/skyrl/v1/abort_lora_requests"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/load"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/unload"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/push"): Access.PUSH,
    ("POST", "/skyrl/v1/adapters/push/stream"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/push/shared"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/handover"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/lease"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/commit"): Access.CONTROL,
    ("POST", "/skyrl/v1/adapters/rollback"): Access.CONTROL,
}

#: Tenant routes with a parameter in their path, by (method, path prefix).
TENANT_PREFIXES: dict[tuple[str, str], Access] = {
    ("DELETE", "/skyrl/v1/adapters/lease/"): Access.LEASE,
}

#: vLLM's adapter routes, refused for every key, with the route to use instead.
REPLACED_ROUTES = {
    "/v1/load_lora_adapter": "POST /skyrl/v1/adapters/load (or /skyrl/v1/adapters/push)",
}

#: How much of a multipart push is read to find its ``lora_name`` field. The
#: field must come before the weights; the push route limits the full size.
PUSH_NAME_WINDOW = 64 * 1024


@dataclass(frozen=True)
class ApiKey:
    key: str
    adapters: frozenset[str] = frozenset()
    admin: bool = False
    base_model: bool = False

    def may_use(self, lora_name: str | None) -> bool:
        if self.admin:
            return True
        if lora_name is None:
            return self.base_model
        return lora_name in self.adapters


class KeyStore:
    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self._keys = list(keys)
        if not self._keys:
            raise ValueError("an API keys file must list at least one key")

    @classmethod
    def load(cls, path: Path) -> KeyStore:
        raw = json.loads(Path(path).read_text())
        return cls(
            ApiKey(
                key=str(entry["key"]),
                adapters=frozenset(entry.get("adapters", [])),
                admin=bool(entry.get("admin", False)),
                base_model=bool(entry.get("base_model", False)),
            )
            for entry in raw["keys"]
        )

    def lookup(self, presented: str) -> ApiKey | None:
        found = None
        for key in self._keys:  # constant time per key: no early exit on a match
            if hmac.compare_digest(key.key.encode(), presented.encode()):
                found = key
        return found


class AuthMiddleware:
    """Rejects requests without a valid key (401) or outside its scope (403)."""

    def __init__(self, app: ASGIApp, keys: KeyStore, base_model_name: str) -> None:
        self.app = app
        self.keys = keys
        self.base_model_name = base_model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            key = self._authenticate(scope)
            access = route_access(key, scope["method"], scope["path"])
            if access is not None and access not in (Access.READ, Access.TINKER, Access.LEASE):
                body, receive = await _peek_body(receive, access is Access.PUSH)
                self._authorize(key, scope, access, body)
        except ServerError as exc:
            await _send_error(send, exc, tinker=scope["path"].startswith(TINKER_PREFIX + "/"))
            return
        scope[SCOPE_KEY] = key
        await self.app(scope, receive, send)

    def _authenticate(self, scope: Scope) -> ApiKey:
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode(errors="replace")
        # The Tinker SDK sends ``X-API-Key: tml-<key>`` (it insists on the prefix).
        tinker = headers.get(b"x-api-key", b"").decode(errors="replace").strip()
        if auth.lower().startswith("bearer "):
            key = self.keys.lookup(auth[7:].strip())
        elif tinker:
            key = self.keys.lookup(tinker.removeprefix("tml-")) or self.keys.lookup(tinker)
        else:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' "
                "(the Tinker SDK: api_key='tml-<key>')"
            )
        if key is None:
            raise AuthenticationError("unknown API key")
        return key

    def _authorize(self, key: ApiKey, scope: Scope, access: Access, body: bytes) -> None:
        if access is Access.PUSH:
            target: object = _multipart_field(scope, body, "lora_name")
            if target is None:
                raise PermissionDeniedError(
                    "a tenant's push must send the lora_name form field before the weights "
                    f"(within the first {PUSH_NAME_WINDOW} bytes)"
                )
        else:
            payload = _json_object(body)
            if payload is None:
                return  # malformed bodies get the route's own 400
            if access is Access.CONTROL:
                target = payload.get("lora_name")
                if target is None:
                    raise PermissionDeniedError("the global pause and resume need an admin key")
            elif scope["path"].startswith("/skyrl/"):
                target = payload.get("lora_name")
            else:
                model = payload.get("model")
                target = None if model in (None, self.base_model_name) else model
        if not isinstance(target, str | None) or not key.may_use(target):
            what = "the base model" if target is None else f"adapter {target!r}"
            raise PermissionDeniedError(f"this API key may not use {what}")


def route_access(key: ApiKey, method: str, path: str) -> Access | None:
    """How ``key`` may call ``method path``: None for admins (no check), else the
    tenant allowlist's entry; raises for routes the key may not call at all."""
    replacement = REPLACED_ROUTES.get(path)
    if replacement is not None:
        raise PermissionDeniedError(
            f"{path} would bypass skyrl-lora's adapter versions, pause and path checks; "
            f"use {replacement}"
        )
    if key.admin:
        return None
    if is_tinker_route(method, path):
        return Access.TINKER
    access = TENANT_ROUTES.get((method, path))
    if access is None:
        access = next(
            (
                a
                for (m, prefix), a in TENANT_PREFIXES.items()
                if m == method and path.startswith(prefix)
            ),
            None,
        )
    if access is None:
        raise PermissionDeniedError(f"{method} {path} needs an admin key")
    return access


def request_key(scope: Scope) -> ApiKey | None:
    """The key that authenticated this request (None when auth is off)."""
    key = scope.get(SCOPE_KEY)
    return key if isinstance(key, ApiKey) else None


async def _peek_body(receive: Receive, capped: bool) -> tuple[bytes, Receive]:
    """Read the request body (``capped``: only its first :data:`PUSH_NAME_WINDOW`
    bytes) and return it with a ``receive`` that replays the messages read,
    unchanged, before passing through the rest of the stream."""
    read: list[Message] = []
    size = 0
    while True:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body", False) or (capped and size >= PUSH_NAME_WINDOW):
            break
    body = b"".join(m.get("body", b"") for m in read if m["type"] == "http.request")

    async def replaying() -> Message:
        if read:
            return read.pop(0)
        return await receive()

    return body, replaying


def _json_object(body: bytes) -> dict[str, object] | None:
    try:
        payload = json.loads(body) if body else {}
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


_BOUNDARY = re.compile(rb'boundary="?([^";]+)"?')


def _multipart_field(scope: Scope, prefix: bytes, name: str) -> str | None:
    """The value of text field ``name`` if it is complete within ``prefix`` of a
    ``multipart/form-data`` body (JSON bodies: the key ``name``)."""
    headers = dict(scope.get("headers", []))
    content_type = headers.get(b"content-type", b"")
    if content_type.startswith(b"application/json"):
        value = (_json_object(prefix) or {}).get(name)
        return value if isinstance(value, str) else None
    match = _BOUNDARY.search(content_type)
    if not content_type.startswith(b"multipart/form-data") or match is None:
        return None
    delimiter = b"--" + match.group(1)
    for part in prefix.split(delimiter)[1:-1]:  # the last piece may be cut off
        head, sep, value = part.partition(b"\r\n\r\n")
        disposition = re.search(rb'content-disposition:[^\r\n]*\bname="([^"]*)"', head, re.I)
        if sep and disposition is not None and disposition.group(1) == name.encode():
            return value.removesuffix(b"\r\n").decode(errors="replace")
    return None


async def _send_error(send: Send, exc: ServerError, *, tinker: bool = False) -> None:
    if tinker:  # the shape the Tinker SDK reads
        payload = json.dumps({"error": exc.message, "category": "user"}).encode()
    else:
        body = ErrorBody(error=ErrorDetail(type=exc.error_type, message=exc.message))
        payload = body.model_dump_json().encode()
    await send(
        {
            "type": "http.response.start",
            "status": exc.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
