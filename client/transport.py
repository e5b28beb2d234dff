"""HTTP plumbing: connection pools, JSON calls, and error mapping.

aiohttp sessions belong to the event loop that created them, so the
transport keeps one pool per event loop the client is used from (one in the
common case) instead of one per request. Every failure leaves here as a
:class:`~skyrl_lora.errors.SkyRLLoraError` subclass carrying the server's own
message.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from pydantic import BaseModel

from skyrl_lora.client.config import ClientConfig
from skyrl_lora.client.push import StreamedForm
from skyrl_lora.errors import (
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
    error_class_for,
)

_JSON = {"Content-Type": "application/json"}


def error_from_body(status: int, text: str, url: str) -> ServerError:
    """Build the typed error from our, vLLM's or FastAPI's error body."""
    message, error_type = text.strip() or f"HTTP {status}", None
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = str(error.get("message", message))
            error_type = error.get("type")
        elif isinstance(error, str):
            message = error
        elif "detail" in body:
            message = (
                json.dumps(body["detail"])
                if not isinstance(body["detail"], str)
                else body["detail"]
            )
    return error_class_for(status, error_type)(message, status=status, url=url)


class Transport:
    """Per-loop aiohttp sessions that carry the per-request constants.

    The JSON content type, the auth header and the untimed default (the
    sampling case) are set once on the session, so the hot path passes no
    per-request headers or timeout for aiohttp to merge and allocate; a
    timed call reuses one ``ClientTimeout`` per distinct timeout.
    """

    def __init__(self, config: ClientConfig, headers: dict[str, str] | None = None) -> None:
        self._config = config
        self._headers = {**_JSON, **(headers or {})}
        self._lock = threading.Lock()
        self._sessions: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, aiohttp.ClientSession
        ] = weakref.WeakKeyDictionary()
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}

    def _timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(total)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=total, sock_connect=self._config.connect_timeout)
            self._timeouts[total] = timeout
        return timeout

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is None or session.closed:
                connector = aiohttp.TCPConnector(limit=self._config.max_connections)
                session = aiohttp.ClientSession(
                    connector=connector, headers=self._headers, timeout=self._timeout(None)
                )
                self._sessions[loop] = session
            return session

    async def call(
        self,
        method: str,
        url: str,
        body: BaseModel | Mapping[str, Any] | StreamedForm | None = None,
        *,
        timeout: float | None,
    ) -> bytes:
        """One JSON request; returns the raw answer body or raises a typed error.

        Pydantic bodies are serialised, and answers parsed by the caller, in
        pydantic's compiled code: on the sampling hot path that is most of
        what separates this client from a bare aiohttp loop.
        """
        headers = _JSON
        data: bytes | AsyncIterator[bytes | memoryview] | None
        if isinstance(body, BaseModel):
            data = body.model_dump_json().encode()
        elif isinstance(body, StreamedForm):
            # The session's default JSON type would win over the form's own:
            # name the multipart type (with its boundary) on the request.
            data = body.chunks()
            headers = {"Content-Type": body.content_type, "Content-Length": str(body.length)}
        else:
            data = None if body is None else json.dumps(body).encode()
        client_timeout = aiohttp.ClientTimeout(
            total=timeout, sock_connect=self._config.connect_timeout
        )
        try:
            async with self._session().request(
                method,
                url,
                data=data,
                headers=headers if data is not None else None,
                timeout=client_timeout,
            ) as response:
                raw = await response.read()
                if response.status >= 400:
                    raise error_from_body(response.status, raw.decode(errors="replace"), url)
                return raw
        except asyncio.TimeoutError as exc:
            raise RequestTimeoutError(f"{method} {url} timed out after {timeout} s") from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise ServerUnavailableError(f"{method} {url} failed: {exc!r}") from exc

    async def aclose(self) -> None:
        """Close the pool of the current loop (and forget pools of closed loops)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.pop(loop, None)
            stale = [lp for lp in self._sessions if lp.is_closed()]
            for lp in stale:
                del self._sessions[lp]
        if session is not None:
            await session.close()
