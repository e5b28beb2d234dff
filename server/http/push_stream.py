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
2. The trainer opens the ticket's ``lanes`` connections to the port. On
   each it sends :data:`~skyrl_lora.types.PUSH_STREAM_HELLO`, the 32 hex
   digits of the ticket, the lane's index in 2 hex digits and a newline,
   then the lane's 8 MiB chunks of the safetensors file (every ``lanes``-th,
   :func:`~skyrl_lora.chunk_digest.lane_chunks`), then the 64 hex digits of
   the whole file's chunked digest (:mod:`skyrl_lora.chunk_digest`).
3. A thread per lane reads its chunks into reused buffers; other threads
   write each one at its offset in the push's folder and hash it meanwhile.
   Once every lane is in and the digests match, the push is loaded on the
   event loop exactly as an HTTP push is, and every lane gets the answer as
   one JSON line: ``{"status": 200, "adapter": AdapterInfo}`` or
   ``{"status": 4xx, "error": {"type", "message"}}``.

Why lanes: one loopback TCP connection read by one Python thread carried
336 MB in about 100 ms on the 2-core CPU machine, two in about 57 ms
(main cbbcf6b, 2026-11-25); the kernel's copies of each connection run on
the core of the thread that reads it. A lane that fails fails the push, and
the others answer that failure.

A ticket not used within :attr:`PushStreamConfig.ticket_ttl_s` expires and
its folder is removed; so is the folder of a push whose lanes do not all
connect within :attr:`PushStreamConfig.idle_timeout_s`, or one of which
breaks off or fails any check, and the adapter's current version keeps
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_lora.chunk_digest import (
    CHUNK_BYTES,
    ChunkedDigest,
    chunk_count,
    chunk_span,
    lane_bytes,
    lane_chunks,
)
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
from ..weights.arrival import MARKER, ArrivalWriter
from ..weights.registry import AdapterRecord, PreparedVersion
from .push import (
    WEIGHTS_FILE,
    check_safetensors,
    check_safetensors_head,
    checked_push,
    load_pushed,
)

logger = logging.getLogger(__name__)

#: How a streamed version's ``source_path`` reads in the registry (its digest follows).
STREAMED_PREFIX = f"push-stream:{DIGEST_NAME}="
_TICKET_HEX = 32
_HEADER_BYTES = len(PUSH_STREAM_HELLO) + _TICKET_HEX + 2 + 1  # ticket, lane, newline
_HEX = frozenset("0123456789abcdef")
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
    #: Buffers of one push written or hashed while the next is read (shared
    #: by its lanes, at least 2 each).
    buffers_in_flight: int = 8
    #: Connections one push may use at once (it asks for its number).
    max_lanes: int = 8
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
    #: Connections its weights travel over (asked for; the ticket grants at most
    #: :attr:`PushStreamConfig.max_lanes`).
    lanes: int = 1


class Receipt:
    """How far a push's bytes came, as its load awaits it on the event loop.

    Each step raises the stream's error instead if the push failed first.
    """

    def __init__(self) -> None:
        self._head: Future[bytes | None] = Future()
        self._digest: Future[str] = Future()

    async def head(self) -> bytes | None:
        """The weights file's first bytes, its safetensors header among them,
        once they are written; None for a header longer than the first chunk
        (then check the file once :meth:`digest` answers)."""
        return await asyncio.wrap_future(self._head)

    async def digest(self) -> str:
        """The weights' chunked digest, once every lane is in, it matched and
        the file is whole: the version may install from then on."""
        return await asyncio.wrap_future(self._digest)

    def head_written(self, head: bytes | None) -> None:
        _settle(self._head, head)

    def received(self, digest: str) -> None:
        _settle(self._digest, digest)

    def failed(self, exc: BaseException) -> None:
        for future in (self._head, self._digest):
            with contextlib.suppress(InvalidStateError):
                future.set_exception(exc)


def _settle(future: Future[Any], value: Any) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_result(value)


#: Loads a push on the event loop, as an HTTP push is loaded, from the moment
#: its first lane connects: it may stage while the bytes arrive (the
#: folder's weights file is followed through its :mod:`arrival
#: <skyrl_lora.server.weights.arrival>` marker), and must install nothing
#: before :meth:`Receipt.digest` answers.
Finish = Callable[[OpenedPush, Receipt], Coroutine[Any, Any, AdapterInfo]]


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
        self._assemblies: dict[str, _Assembly] = {}  # pushes whose lanes are arriving
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
            lanes = max(1, min(push.lanes, self.config.max_lanes, chunk_count(push.weights_bytes)))
            push = dataclasses.replace(push, lanes=lanes)
            self._tickets[ticket] = (push, time.monotonic() + self.config.ticket_ttl_s)
        ttl = self.config.ticket_ttl_s
        return PushStreamTicket(ticket=ticket, port=self.port, expires_in_s=ttl, lanes=lanes)

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
        """One lane's answer: the push's, once every lane's bytes are in and
        the push is loaded (or refused). The push's folder is gone before
        the first answer is sent (moved into its snapshot, else removed)."""
        assembly: _Assembly | None = None
        try:
            assembly, lane = self._claim(conn)
            self._receive_lane(conn, assembly, lane)
            return assembly.wait_for_reply(self.config.idle_timeout_s)
        except ServerError as exc:
            return self._failed(assembly, exc)
        except OSError as exc:
            return self._failed(assembly, BadRequestError(f"the push stream broke off: {exc}"))
        except Exception as exc:  # answered, not lost: the trainer sees why
            logger.exception("push stream failed")
            error = InternalServerError(f"the push stream failed: {exc!r}")
            return self._failed(assembly, error)
        finally:
            if assembly is not None:
                self._leave(assembly)

    def _failed(self, assembly: _Assembly | None, exc: ServerError) -> dict[str, Any]:
        """The answer of a lane that failed: the push fails with it (unless
        it was answered already), and the push's first failure is what
        every lane answers."""
        if assembly is None:
            return _error_reply(exc)
        return assembly.fail(exc)

    def _claim(self, conn: socket.socket) -> tuple[_Assembly, int]:
        conn.settimeout(self.config.hello_timeout_s)
        header = bytearray(_HEADER_BYTES)
        _recv_exactly(conn, memoryview(header))
        ticket = bytes(header[len(PUSH_STREAM_HELLO) : -3]).decode("ascii", errors="replace")
        lane_hex = bytes(header[-3:-1]).decode("ascii", errors="replace")
        if (
            not header.startswith(PUSH_STREAM_HELLO)
            or header[-1:] != b"\n"
            or not all(c in _HEX for c in lane_hex)
        ):
            raise BadRequestError(
                f"a push stream starts with {PUSH_STREAM_HELLO.decode()!r}, "
                "its ticket, its lane in 2 hex digits and a newline"
            )
        lane = int(lane_hex, 16)
        with self._lock:
            self._expire_locked()
            assembly = self._assemblies.get(ticket)
            if assembly is None:
                entry = self._tickets.get(ticket)
                if entry is None:
                    raise AuthenticationError(
                        "unknown push stream ticket (used already, expired, or never issued)"
                    )
                _check_lane(lane, entry[0].lanes)
                del self._tickets[ticket]
                assembly = _Assembly(entry[0], self.config.idle_timeout_s)
                self._assemblies[ticket] = assembly
                assembly.start_load(self._finish, self._loop)
            assembly.join(lane)
        return assembly, lane

    def _leave(self, assembly: _Assembly) -> None:
        """A lane's thread is done with the push; the last one closes its file
        and forgets its ticket."""
        if assembly.leave():
            with self._lock:
                for ticket, known in list(self._assemblies.items()):
                    if known is assembly:
                        del self._assemblies[ticket]

    def _receive_lane(self, conn: socket.socket, assembly: _Assembly, lane: int) -> None:
        """Read one lane's chunks into reused buffers; each is written at its
        offset and hashed on threads of their own while the next is read.
        The lane that brings the last bytes checks the digest and loads."""
        push = assembly.push
        conn.settimeout(self.config.idle_timeout_s)
        chunks = lane_chunks(lane, push.lanes, push.weights_bytes)
        in_flight: deque[tuple[bytearray, list[Future[Any]]]] = deque()
        most = max(2, self.config.buffers_in_flight // push.lanes)
        lane_total = lane_bytes(lane, push.lanes, push.weights_bytes)
        received = 0
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="skyrl-push-stream-write") as writer:
                for index in chunks:
                    assembly.raise_if_failed()
                    if len(in_flight) < most:
                        buffer = self._buffer()
                    else:
                        buffer, done = in_flight.popleft()
                        for future in done:
                            future.result()
                    start, length = chunk_span(index, push.weights_bytes)
                    view = memoryview(buffer)[:length]
                    _recv_exactly(conn, view, received, lane_total)
                    received += length
                    in_flight.append(
                        (
                            buffer,
                            [
                                writer.submit(assembly.write, index, view, start),
                                assembly.digest.add(view, index),
                            ],
                        )
                    )
                for _, done in in_flight:
                    for future in done:
                        future.result()
        finally:
            with self._lock:
                spare = self.config.buffers_in_flight * 2 - len(self._buffers)
                self._buffers.extend(buffer for buffer, _ in list(in_flight)[: max(0, spare)])
        theirs = bytearray(_DIGEST_HEX)
        _recv_exactly(conn, memoryview(theirs))
        if assembly.lane_done(theirs.decode("ascii", errors="replace")):
            assembly.check()

    def _buffer(self) -> bytearray:
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
        return bytearray(CHUNK_BYTES)


class _Assembly:
    """One push on its way in over its lanes: the files they write, the digest
    they feed, the load that follows them, and the one answer all lanes give."""

    def __init__(self, push: OpenedPush, join_timeout_s: float) -> None:
        self.push = push
        self.started = time.perf_counter()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.fd = os.open(push.folder / WEIGHTS_FILE, flags, 0o600)
        self._dir = os.open(push.folder, os.O_RDONLY | os.O_DIRECTORY)  # kept across its move
        self.arrival = ArrivalWriter(push.folder, push.weights_bytes)
        self.digest = ChunkedDigest(total_bytes=push.weights_bytes)
        self.receipt = Receipt()
        self.digests_said: list[str] = []
        self._join_deadline = time.monotonic() + join_timeout_s
        self._lock = threading.Lock()
        self._joined: set[int] = set()
        self._inside = 0
        self._written: set[int] = set()
        self._prefix = 0  # chunks written from the file's start
        self._head: bytes | None = None  # the file's first bytes to its header's end
        self._reply: dict[str, Any] | None = None
        self._answered = threading.Event()

    def start_load(self, finish: Finish, loop: asyncio.AbstractEventLoop) -> None:
        """Start the push's load now: it stages while the bytes arrive."""
        load = asyncio.run_coroutine_threadsafe(finish(self.push, self.receipt), loop)
        load.add_done_callback(self._loaded)

    def _loaded(self, load: Future[AdapterInfo]) -> None:
        exc = load.exception()
        if exc is None:
            self._settle({"status": 200, "adapter": load.result().model_dump()})
        elif isinstance(exc, ServerError):
            self.fail(exc)
        else:  # answered, not lost: the trainer sees why
            logger.error("push stream's load failed", exc_info=exc)
            self.fail(InternalServerError(f"the push stream's load failed: {exc!r}"))

    def join(self, lane: int) -> None:
        """Lane ``lane`` connected (called under the listener's lock)."""
        with self._lock:
            _check_lane(lane, self.push.lanes)
            if lane in self._joined:
                raise BadRequestError(f"lane {lane} of the push is connected already")
            self._joined.add(lane)
            self._inside += 1

    def leave(self) -> bool:
        """A lane's thread is out; True for the last one (the files are closed then)."""
        with self._lock:
            self._inside -= 1
            last = self._inside == 0
        if last:  # the folder went into its snapshot, or goes now
            self.digest.close()
            for fd in (self.fd, self._dir):
                os.close(fd)
            self.arrival.close()
            shutil.rmtree(self.push.folder, ignore_errors=True)
        return last

    def write(self, index: int, view: memoryview, offset: int) -> None:
        """Write chunk ``index`` at ``offset``; tell readers how far the file
        is written from its start."""
        _write_at(self.fd, view, offset)
        with self._lock:
            if index == 0:  # safetensors: the header's length, then the header
                end = 8 + int.from_bytes(view[:8], "little") if len(view) >= 8 else len(view)
                self._head = bytes(view[: min(end, len(view))]) if end <= len(view) else None
            self._written.add(index)
            advanced = self._prefix
            while advanced in self._written:
                self._written.discard(advanced)
                advanced += 1
            if advanced > self._prefix:
                if self._prefix == 0:
                    self.receipt.head_written(self._head)
                self._prefix = advanced
                self.arrival.ready(min(advanced * CHUNK_BYTES, self.push.weights_bytes))

    def lane_done(self, digest_said: str) -> bool:
        """A lane's bytes and digest are in; True for the push's last lane."""
        with self._lock:
            self.digests_said.append(digest_said)
            return len(self.digests_said) == self.push.lanes

    def check(self) -> None:
        """Every lane is in: check the digest; the load may install now."""
        push = self.push
        digest = self.digest.hexdigest()
        for said in self.digests_said:
            if said != digest:
                raise BadRequestError(
                    f"{WEIGHTS_FILE} has chunked sha256 {digest}, the stream said "
                    f"{said}: the bytes were damaged"
                )
        self.arrival.complete()
        with contextlib.suppress(FileNotFoundError):  # the folder may be a snapshot by now
            os.unlink(MARKER, dir_fd=self._dir)
        log_event(
            "push_stream_received",
            lora_name=push.lora_name,
            bytes=push.weights_bytes,
            lanes=push.lanes,
            ms=round((time.perf_counter() - self.started) * 1000, 2),
        )
        self.receipt.received(digest)

    def raise_if_failed(self) -> None:
        """Stop a lane's receive once the push failed elsewhere."""
        reply = self._reply
        if reply is not None and reply["status"] != 200:
            raise BadRequestError("another lane of the push, or its load, failed")

    def fail(self, exc: ServerError) -> dict[str, Any]:
        """Fail the push (unless it was answered already); its answer."""
        self.receipt.failed(exc)
        with self._lock:
            if self._reply is None:
                self.arrival.fail()
                shutil.rmtree(self.push.folder, ignore_errors=True)
        return self._settle(_error_reply(exc))

    def _settle(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The push's answer: the first one given, to every lane."""
        with self._lock:
            if self._reply is None:
                self._reply = reply
            settled = self._reply
        self._answered.set()
        return settled

    def wait_for_reply(self, poll_s: float) -> dict[str, Any]:
        """The push's answer, once it has one; a push whose other lanes never
        connect fails after the join timeout."""
        while not self._answered.wait(min(poll_s, 0.5)):
            with self._lock:
                missing = self.push.lanes - len(self._joined)
            if missing and time.monotonic() > self._join_deadline:
                self.fail(
                    BadRequestError(
                        f"{missing} of the push's {self.push.lanes} lanes never connected"
                    )
                )
        assert self._reply is not None
        return self._reply


def _check_lane(lane: int, lanes: int) -> None:
    if lane >= lanes:
        raise BadRequestError(f"the push has lanes 0 to {lanes - 1}, not {lane}")


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``view`` is at ``offset``."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


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


async def load_opened(engine: GatedEngine, push: OpenedPush, receipt: Receipt) -> AdapterInfo:
    """The :data:`Finish` of a server: check the push's fields as an HTTP
    push's are checked, stage it while its bytes arrive, and install it as
    the adapter's next version once they all came and their digest matched.

    A push naming the current version is compared by its weights, so that
    one waits for all of them first.
    """
    fields = {**push.fields, "lora_name": push.lora_name}
    pushed = checked_push(fields, push.folder, "", weights_written=False)
    registry = engine.registry

    async def prepare(replaces: int | None) -> PreparedVersion | AdapterRecord:
        head = await receipt.head()
        if head is None:  # a header past the first chunk: checked in the whole file
            await receipt.digest()
            check_safetensors(push.folder / WEIGHTS_FILE)
        else:
            check_safetensors_head(head, push.weights_bytes)
        if registry.repeats(pushed.lora_name, pushed.version):  # compared by the whole file
            source = STREAMED_PREFIX + await receipt.digest()
            return await registry.prepare_owned(
                pushed.lora_name, pushed.folder, source, pushed.version, replaces
            )
        prepared = await registry.prepare_owned(
            pushed.lora_name, pushed.folder, STREAMED_PREFIX + "arriving", pushed.version, replaces
        )
        if isinstance(prepared, AdapterRecord):
            return prepared
        try:
            digest = await receipt.digest()
        except BaseException:
            await registry.abandon(prepared)
            raise
        return dataclasses.replace(prepared, source_path=STREAMED_PREFIX + digest)

    applied = await load_pushed(engine, pushed, prepare)
    return engine.adapter_info(push.lora_name, applied=applied)
