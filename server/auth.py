"""API keys scoped to adapters, enforced on every route (vLLM's included).

A keys file (``--api-keys FILE``) lists keys, each with the adapters it may
sample from and control; ``admin`` keys may do everything, including the
global pause and loading adapter names no tenant owns yet. The check runs in
an ASGI middleware in front of the whole app, so vLLM's own OpenAI routes
are covered without touching them: the adapter is read from the JSON body
(``lora_name`` on our routes, ``model`` on vLLM's) and the body is replayed
to the app unchanged.

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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skyrl_lora.errors import AuthenticationError, PermissionDeniedError, ServerError
from skyrl_lora.types import ErrorBody, ErrorDetail

#: Routes anyone may call: liveness for orchestrators.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
#: Where the middleware leaves the authenticated key for the routes.
SCOPE_KEY = "skyrl.api_key"


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
        body = await _read_body(receive)
        try:
            key = self._authenticate(scope)
            self._authorize(key, scope, body)
        except ServerError as exc:
            await _send_error(send, exc)
            return
        scope[SCOPE_KEY] = key
        await self.app(scope, _replay(body, receive), send)

    def _authenticate(self, scope: Scope) -> ApiKey:
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode(errors="replace")
        if not auth.lower().startswith("bearer "):
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        key = self.keys.lookup(auth[7:].strip())
        if key is None:
            raise AuthenticationError("unknown API key")
        return key

    def _authorize(self, key: ApiKey, scope: Scope, body: bytes) -> None:
        if key.admin or scope["method"] != "POST":
            return  # GET routes are read-only and filter what they show by key
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            return  # malformed bodies get the route's own 400
        if not isinstance(payload, dict):
            return
        path = scope["path"]
        if path.startswith("/skyrl/"):
            target = payload.get("lora_name")
            if target is None and path.rsplit("/", 1)[-1] in ("pause", "resume"):
                raise PermissionDeniedError("the global pause and resume need an admin key")
        else:
            model = payload.get("model")
            target = None if model in (None, self.base_model_name) else model
        if not isinstance(target, str | None) or not key.may_use(target):
            what = "the base model" if target is None else f"adapter {target!r}"
            raise PermissionDeniedError(f"this API key may not use {what}")


def request_key(scope: Scope) -> ApiKey | None:
    """The key that authenticated this request (None when auth is off)."""
    key = scope.get(SCOPE_KEY)
    return key if isinstance(key, ApiKey) else None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # disconnects and the like

    return replay


async def _send_error(send: Send, exc: ServerError) -> None:
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
