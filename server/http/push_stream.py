"""A push's weights over a TCP stream of their own, beside HTTP (``serve --push-stream-port``).

Why: uvicorn hands a request body to the app in pieces of at most 256 KB,
each through httptools' callbacks, an asyncio queue and a copy or two, and
python-multipart parses every piece again. Bytes that are dropped as they
arrive got through that stack at about 1 GB/s on the 2-core CPU machine;
a socket read straight into a reused buffer runs at 2.5 GB/s there. On the
H100 machine a rank-64 push of the 8B model (336 MB) took 0.49 s against
87 ms for the same weights by path (main 8b38bb1, 2026-11-25).

How, in three steps:

1. The trainer opens the push over HTTP (``POST /skyrl/v1/adapters/push/stream``,
   a :class:`~skyrl_lora.types.PushStreamRequest`). Keys, scopes, size limit
   and config are checked there, by the same middleware and rules as every
   other route; the answer is a one-time ticket. The stream itself trusts
   nothing but the ticket, so it adds no second place where access is decided.
2. The trainer connects to the port and sends
   :data:`~skyrl_lora.types.PUSH_STREAM_HELLO`, the 32 hex digits of the
   ticket and a newline, then exactly ``weights_bytes`` bytes
   of the safetensors file, then the 64 hex digits of their chunked digest
   (:mod:`skyrl_lora.chunk_digest`).
3. A thread of the listener reads the bytes into reused 8 MiB buffers; other
   threads write each one to the push's folder and hash it meanwhile. If the
   digests match, the push is loaded on the event loop exactly as an HTTP
   push is, and the answer goes back as one JSON line: ``{"status": 200,
   "adapter": AdapterInfo}`` or ``{"status": 4xx, "error": {"type", "message"}}``.

A ticket not used within :attr:`PushStreamConfig.ticket_ttl_s` expires and
its folder is removed; so is the folder of a stream that breaks off or
fails any check, and the adapter's current version keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_lora.chunk_digest import CHUNK_BYTES, ChunkedDigest
from skyrl_lora.chunk_digest import NAME as DIGEST_NAME
from skyrl_lora.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    ServerError,
)
from skyrl_lora.types import PUSH_STREAM_HELLO, AdapterInfo, PushStreamTicket

from ..engine.gated import GatedEngine
from ..observability import log_event
from ..weights.snapshot_writer import write_all
from .push import WEIGHTS_FILE, checked_push, load_pushed

logger = logging.getLogger(__name__)

#: How a streamed version's ``source_path`` reads in the registry (its digest follows).
STREAMED_PREFIX = f"push-stream:{DIGEST_NAME}="
_TICKET_HEX = 32
_HEADER_BYTES = len(PUSH_STREAM_HELLO) + _TICKET_HEX + 1
_DIGEST_HEX = 64


@dataclass(frozen=True)
class PushStreamConfig:
    """Limits of the stream listener."""

    #: Seconds an opened push waits for its stream.
    ticket_ttl_s: float = 60.0
    #: Pushes opened and not yet streamed, at most (beyond: 409 at the open).
    max_open: int = 16
    #: Connections served at once, at most; more are closed unanswered.
    max_connections: int = 32
    #: Seconds a connection may take to send its ticket line.
    hello_timeout_s: float = 10.0
    #: Seconds any read of the weights may wait for bytes.
    idle_timeout_s: float = 30.0
    #: Buffers of one stream written or hashed while the next is read.
    buffers_in_flight: int = 8
    #: Seconds a refused stream's bytes are still read (and dropped) after its answer.
    linger_s: float = 5.0


@dataclass(frozen=True)
class OpenedPush:
    """A push checked at its open, waiting for its weights."""

    lora_name: str
    #: Holds ``adapter_config.json`` already; the weights are written here.
    folder: Path
    weights_bytes: int
    #: The push's form fields (``swap_policy``, ``version``, ``keep_previous_s``).
    fields: dict[str, str] = field(default_factory=dict)


#: Loads a received push (its folder complete, its digest checked) on the
#: event loop, as an HTTP push is loaded; given the push and the digest.
Finish = Callable[[OpenedPush, str], Coroutine[Any, Any, AdapterInfo]]


class PushStreamListener:
    """Owns the listening socket, the tickets and the threads that receive."""

    def __init__(
        self,
        host: str | None,
        port: int,
        finish: Finish,
        loop: asyncio.AbstractEventLoop,
        config: PushStreamConfig | None = None,
    ) -> None:
        self.config = config or PushStreamConfig()
        self._finish = finish
        self._loop = loop
        self._lock = threading.Lock()
        self._tickets: dict[str, tuple[OpenedPush, float]] = {}
        self._connections = threading.BoundedSemaphore(self.config.max_connections)
        self._buffers: list[bytearray] = []  # reused across streams
        self._sock = socket.create_server((host or "", port))
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="skyrl-push-stream", daemon=True
        )
        self._acceptor.start()

    # -- tickets (called on the event loop) ---------------------------------
    def open(self, push: OpenedPush) -> PushStreamTicket:
        """A ticket for ``push``, whose folder the listener owns from now on."""
        with self._lock:
            self._expire_locked()
            if self._closed or len(self._tickets) >= self.config.max_open:
                shutil.rmtree(push.folder, ignore_errors=True)
                raise ConflictError(
                    f"{len(self._tickets)} pushes are open and waiting for their streams; "
                    "send theirs first (or let them expire)"
                )
            ticket = secrets.token_hex(_TICKET_HEX // 2)
            self._tickets[ticket] = (push, time.monotonic() + self.config.ticket_ttl_s)
        ttl = self.config.ticket_ttl_s
        return PushStreamTicket(ticket=ticket, port=self.port, expires_in_s=ttl)

    def _take(self, ticket: str) -> OpenedPush | None:
        with self._lock:
            self._expire_locked()
            entry = self._tickets.pop(ticket, None)
        return None if entry is None else entry[0]

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for ticket, (push, deadline) in list(self._tickets.items()):
            if deadline <= now:
                del self._tickets[ticket]
                shutil.rmtree(push.folder, ignore_errors=True)
                logger.info("push stream of %s expired unused", push.lora_name)

    def close(self) -> None:
        """Stop accepting, and remove the folders of pushes never streamed."""
        with self._lock:
            self._closed = True
            for push, _ in self._tickets.values():
                shutil.rmtree(push.folder, ignore_errors=True)
            self._tickets.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    # -- streams (listener threads) ------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._connections.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="skyrl-push-stream-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reply = self._handle(conn)
                _answer(conn, json.dumps(reply).encode() + b"\n", self.config.linger_s)
        finally:
            self._connections.release()

    def _handle(self, conn: socket.socket) -> dict[str, Any]:
        """The stream's answer; the push's folder is gone before it is sent
        (moved into its snapshot when loaded, else removed)."""
        push: OpenedPush | None = None
        try:
            push = self._claim(conn)
            answer = self._receive_and_load(conn, push)
            return {"status": 200, "adapter": answer.model_dump()}
        except ServerError as exc:
            return _error_reply(exc)
        except OSError as exc:
            return _error_reply(BadRequestError(f"the push stream broke off: {exc}"))
        except Exception as exc:  # answered, not lost: the trainer sees why
            logger.exception("push stream failed")
            return _error_reply(InternalServerError(f"the push stream failed: {exc!r}"))
        finally:
            if push is not None:
                shutil.rmtree(push.folder, ignore_errors=True)

    def _claim(self, conn: socket.socket) -> OpenedPush:
        conn.settimeout(self.config.hello_timeout_s)
        header = bytearray(_HEADER_BYTES)
        _recv_exactly(conn, memoryview(header))
        ticket = bytes(header[len(PUSH_STREAM_HELLO) : -1]).decode("ascii", errors="replace")
        if not header.startswith(PUSH_STREAM_HELLO) or header[-1:] != b"\n":
            raise BadRequestError(
                f"a push stream starts with {PUSH_STREAM_HELLO.decode()!r}, "
                "its ticket and a newline"
            )
        push = self._take(ticket)
        if push is None:
            raise AuthenticationError(
                "unknown push stream ticket (used already, expired, or never issued)"
            )
        return push

    def _receive_and_load(self, conn: socket.socket, push: OpenedPush) -> AdapterInfo:
        conn.settimeout(self.config.idle_timeout_s)
        started = time.perf_counter()
        digest = self._receive(conn, push)
        received_s = time.perf_counter() - started
        theirs = bytearray(_DIGEST_HEX)
        _recv_exactly(conn, memoryview(theirs))
        if theirs.decode("ascii", errors="replace") != digest:
            raise BadRequestError(
                f"{WEIGHTS_FILE} has chunked sha256 {digest}, the stream said "
                f"{theirs.decode('ascii', errors='replace')}: the bytes were damaged"
            )
        log_event(
            "push_stream_received",
            lora_name=push.lora_name,
            bytes=push.weights_bytes,
            ms=round(received_s * 1000, 2),
        )
        return asyncio.run_coroutine_threadsafe(self._finish(push, digest), self._loop).result()

    def _receive(self, conn: socket.socket, push: OpenedPush) -> str:
        """Read the weights into reused buffers; each is written and hashed
        on threads of their own while the next one is read."""
        fd = os.open(push.folder / WEIGHTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        in_flight: deque[tuple[bytearray, list[Future[Any]]]] = deque()
        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="skyrl-push-stream-write") as writer,
                ChunkedDigest() as digest,
            ):
                remaining = push.weights_bytes
                while remaining:
                    if len(in_flight) < self.config.buffers_in_flight:
                        buffer = self._buffer()
                    else:
                        buffer, done = in_flight.popleft()
                        for future in done:
                            future.result()
                    view = memoryview(buffer)[: min(CHUNK_BYTES, remaining)]
                    _recv_exactly(conn, view, push.weights_bytes - remaining, push.weights_bytes)
                    remaining -= len(view)
                    in_flight.append(
                        (buffer, [writer.submit(write_all, fd, [view]), digest.add(view)])
                    )
                for _, done in in_flight:
                    for future in done:
                        future.result()
                return digest.hexdigest()
        finally:
            os.close(fd)
            with self._lock:
                spare = self.config.buffers_in_flight * 2 - len(self._buffers)
                self._buffers.extend(buffer for buffer, _ in list(in_flight)[: max(0, spare)])

    def _buffer(self) -> bytearray:
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
        return bytearray(CHUNK_BYTES)


def _recv_exactly(
    conn: socket.socket, view: memoryview, before: int = 0, total: int | None = None
) -> None:
    """Fill ``view`` from the stream (``before`` of its ``total`` bytes came earlier)."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            expected = len(view) + before if total is None else total
            raise ConnectionError(f"the stream ended after {before + got} of {expected} bytes")
        got += n


def _answer(conn: socket.socket, line: bytes, linger_s: float) -> None:
    """Send the answer, then read (and drop) what the sender still sends, for
    at most ``linger_s``: closed with bytes unread, the socket would reset the
    connection, and the sender of a refused stream could lose the answer
    that says why."""
    try:
        conn.sendall(line)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(linger_s)
        deadline = time.monotonic() + linger_s
        while conn.recv(1 << 20) and time.monotonic() < deadline:
            pass
    except OSError:
        pass  # the sender is gone; the push's outcome is in the log


def _error_reply(exc: ServerError) -> dict[str, Any]:
    return {"status": exc.status, "error": {"type": exc.error_type, "message": exc.message}}


async def load_opened(engine: GatedEngine, push: OpenedPush, digest: str) -> AdapterInfo:
    """The :data:`Finish` of a server: check the received push as an HTTP
    push is checked, and load it as the adapter's next version."""
    fields = {**push.fields, "lora_name": push.lora_name}
    pushed = checked_push(fields, push.folder, digest)
    pushed = dataclasses.replace(pushed, source=STREAMED_PREFIX + digest)
    applied = await load_pushed(engine, pushed)
    return engine.adapter_info(push.lora_name, applied=applied)
