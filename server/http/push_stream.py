"""A push's weights over a TCP stream of their own, beside HTTP (on unless ``--no-push-stream``).

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
3. A thread per lane reads its chunks straight into the push's receive
   area, shared memory the engine is then handed (:mod:`.receive_area`),
   or, on a host without ``/dev/shm``, into reused buffers that other
   threads write at their offsets in the push's folder; other threads hash
   each chunk meanwhile (:class:`~.push_assembly.Assembly`). The push's
   load starts on the event loop as the first lane connects, and stages
   while the bytes arrive (:mod:`~skyrl_lora.server.adapters.arrival`); it
   installs once every lane is in and the digests match, as an HTTP push
   is installed, and every lane gets the answer as one JSON line:
   ``{"status": 200, "adapter": AdapterInfo}`` or ``{"status": 4xx,
   "error": {"type", "message"}}``.

Why lanes: one loopback TCP connection read by one Python thread carried
336 MB in about 100 ms on the 2-core CPU machine, two in about 57 ms
(main cbbcf6b, 2026-11-25); the kernel's copies of each connection run on
the core of the thread that reads it. A lane that fails fails the push, and
the others answer that failure.

``serve`` runs this listener in a process of its own, where its threads
take no GIL from the event loop that streams the tenants' tokens; the
push's load stays on that loop (:mod:`.push_stream_process`).

A ticket not used within :attr:`PushStreamConfig.ticket_ttl_s` expires and
its folder is removed; so is the folder of a push whose lanes do not all
connect within :attr:`PushStreamConfig.idle_timeout_s`, or one of which
breaks off or fails any check, and the adapter's current version keeps
serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import shutil
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from skyrl_lora.chunk_digest import (
    CHUNK_BYTES,
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

from ..adapters.registry import AdapterRecord, PreparedVersion
from ..engine.gated import GatedEngine
from ..telemetry.observability import PUSHED_BYTES
from .push import (
    check_safetensors,
    check_safetensors_head,
    checked_push,
    load_pushed,
)
from .push_assembly import (
    UNKNOWN_TICKET,
    Answered,
    Assembly,
    Finish,
    LaneTiming,
    OpenedPush,
    Receipt,
    check_lane,
    error_reply,
)
from .receive_area import ReceiveArea, ReceiveAreas

logger = logging.getLogger(__name__)

#: How a streamed version's ``source_path`` reads in the registry (its digest follows).
STREAMED_PREFIX = f"push-stream:{DIGEST_NAME}="
_TICKET_HEX = 32
_HEADER_BYTES = len(PUSH_STREAM_HELLO) + _TICKET_HEX + 2 + 1  # ticket, lane, newline
#: What every version's hello starts with (the version follows).
_PROTOCOL = PUSH_STREAM_HELLO.split(b"/")[0] + b"/"
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
    #: Receive areas (:mod:`.receive_area`) kept for the next pushes of the
    #: same size; 0 writes each push's weights file in its folder instead.
    idle_areas: int = 2
    #: Threads that hash the chunks of every push.
    hash_threads: int = 8


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
        #: Pushes whose lanes are arriving, and, for a ticket's lifetime after
        #: they closed, those over (a lane that comes late gets their answer).
        self._assemblies: dict[str, Assembly] = {}
        self._claiming: set[str] = set()  # tickets whose first lane maps their area
        self._connections = threading.BoundedSemaphore(self.config.max_connections)
        self._buffers: list[bytearray] = []  # reused across streams
        self._hashers = ThreadPoolExecutor(
            self.config.hash_threads, thread_name_prefix="skyrl-chunk-hash"
        )
        self._areas = ReceiveAreas.available(self.config.idle_areas, self._hashers)
        self._sock = socket.create_server((host or "", port))
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="skyrl-push-stream", daemon=True
        )
        self._acceptor.start()

    def idle_areas(self) -> int:
        """Receive areas kept for the next pushes (0 where pushes write files)."""
        return 0 if self._areas is None else self._areas.idle()

    # -- tickets (called on the event loop) ---------------------------------
    async def open(self, push: OpenedPush) -> PushStreamTicket:
        """A ticket for ``push``, whose folder the listener owns from now on
        (a coroutine, as :meth:`.push_stream_process.PushStreamProcess.open` is)."""
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
        closed_before = now - self.config.ticket_ttl_s
        for ticket, assembly in list(self._assemblies.items()):
            if assembly.closed_at is not None and assembly.closed_at <= closed_before:
                del self._assemblies[ticket]  # kept until now to answer late lanes

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
        if self._areas is not None:
            self._areas.close()
        self._hashers.shutdown(wait=False)

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
        assembly: Assembly | None = None
        try:
            assembly, lane = self._claim(conn)
            self._receive_lane(conn, assembly, lane)
            return assembly.wait_for_reply(self.config.idle_timeout_s)
        except Answered as over:
            return over.reply
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
                assembly.leave()

    def _failed(self, assembly: Assembly | None, exc: ServerError) -> dict[str, Any]:
        """The answer of a lane that failed: the push fails with it (unless
        it was answered already), and the push's first failure is what
        every lane answers."""
        if assembly is None:
            return error_reply(exc)
        return assembly.fail(exc)

    def _claim(self, conn: socket.socket) -> tuple[Assembly, int]:
        conn.settimeout(self.config.hello_timeout_s)
        header = bytearray(_HEADER_BYTES)
        _recv_exactly(conn, memoryview(header))
        ticket = bytes(header[len(PUSH_STREAM_HELLO) : -3]).decode("ascii", errors="replace")
        lane_hex = bytes(header[-3:-1]).decode("ascii", errors="replace")
        if header.startswith(_PROTOCOL) and not header.startswith(PUSH_STREAM_HELLO):
            said = bytes(header[: len(PUSH_STREAM_HELLO)]).decode("ascii", errors="replace")
            said = said.strip()
            raise BadRequestError(
                f"this server speaks {PUSH_STREAM_HELLO.decode().strip()}, the client {said}: "
                "they digest the chunks differently; run one skyrl-lora version at both ends"
            )
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
        area = self._area_for(ticket)  # the push's first lane only
        deadline = time.monotonic() + self.config.hello_timeout_s
        try:
            while True:
                with self._lock:
                    self._expire_locked()
                    assembly = self._assemblies.get(ticket)
                    if assembly is not None or area is not None or ticket not in self._claiming:
                        if assembly is None:
                            assembly = self._assemble(ticket, lane, area)
                            area = None  # the push's now
                        assembly.join(lane)
                        return assembly, lane
                # its first lane is still mapping the push's area
                if time.monotonic() > deadline:
                    raise BadRequestError("the push's first lane never started it")
                time.sleep(0.001)
        finally:
            if area is not None and self._areas is not None:  # the push failed to start
                self._areas.give_back(area)

    def _assemble(self, ticket: str, lane: int, area: ReceiveArea | None) -> Assembly:
        """The push of ``ticket``, started by its first lane (under the lock)."""
        self._claiming.discard(ticket)
        entry = self._tickets.get(ticket)
        if entry is None:
            raise AuthenticationError(UNKNOWN_TICKET)
        check_lane(lane, entry[0].lanes)
        del self._tickets[ticket]
        assembly = Assembly(entry[0], self.config.idle_timeout_s, area, self._areas, self._hashers)
        self._assemblies[ticket] = assembly
        assembly.start_load(self._finish, self._loop)
        return assembly

    def _area_for(self, ticket: str) -> ReceiveArea | None:
        """The receive area of a push whose first lane this is; its other
        lanes wait meanwhile (``_claiming``). Taken outside the listener's
        lock: mapping a new one takes a few hundred ms, and the event loop
        takes that lock to open pushes."""
        if self._areas is None:
            return None
        with self._lock:
            if ticket in self._assemblies or ticket in self._claiming:
                return None
            entry = self._tickets.get(ticket)
            if entry is None:
                return None
            self._claiming.add(ticket)
        try:
            return self._areas.take(entry[0].weights_bytes)
        except BaseException:
            with self._lock:
                self._claiming.discard(ticket)
            raise

    def _receive_lane(self, conn: socket.socket, assembly: Assembly, lane: int) -> None:
        """Read one lane's chunks into the push's receive area, or into reused
        buffers each written at its offset on a thread of its own; each chunk
        is hashed on other threads while the next is read. The lane that
        brings the last bytes checks the digest and loads."""
        conn.settimeout(self.config.idle_timeout_s)
        if assembly.area is not None:
            timing = _receive_into(conn, assembly, lane)
        else:
            timing = self._receive_buffered(conn, assembly, lane)
        theirs = bytearray(_DIGEST_HEX)
        _recv_exactly(conn, memoryview(theirs))
        if assembly.lane_done(theirs.decode("ascii", errors="replace"), timing):
            assembly.check()

    def _receive_buffered(self, conn: socket.socket, assembly: Assembly, lane: int) -> LaneTiming:
        push = assembly.push
        chunks = lane_chunks(lane, push.lanes, push.weights_bytes)
        in_flight: deque[tuple[bytearray, list[Future[Any]]]] = deque()
        most = max(2, self.config.buffers_in_flight // push.lanes)
        lane_total = lane_bytes(lane, push.lanes, push.weights_bytes)
        received = 0
        timing = LaneTiming()
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="skyrl-push-stream-write") as writer:
                for index in chunks:
                    assembly.raise_if_failed()
                    if len(in_flight) < most:
                        buffer = self._buffer()
                    else:
                        buffer, done = in_flight.popleft()
                        waited = time.perf_counter()
                        for future in done:
                            future.result()
                        timing.wait_s += time.perf_counter() - waited
                    start, length = chunk_span(index, push.weights_bytes)
                    view = memoryview(buffer)[:length]
                    began = time.perf_counter()
                    _recv_exactly(conn, view, received, lane_total)
                    timing.recv_s += time.perf_counter() - began
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
                waited = time.perf_counter()
                for _, done in in_flight:
                    for future in done:
                        future.result()
                timing.wait_s += time.perf_counter() - waited
        finally:
            with self._lock:
                spare = self.config.buffers_in_flight * 2 - len(self._buffers)
                self._buffers.extend(buffer for buffer, _ in list(in_flight)[: max(0, spare)])
        return timing

    def _buffer(self) -> bytearray:
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
        return bytearray(CHUNK_BYTES)


def _receive_into(conn: socket.socket, assembly: Assembly, lane: int) -> LaneTiming:
    """Read one lane's chunks straight into the push's receive area, each
    hashed on other threads while the next is read."""
    push, area = assembly.push, assembly.area
    assert area is not None
    lane_total = lane_bytes(lane, push.lanes, push.weights_bytes)
    timing = LaneTiming()
    hashed: list[Future[Any]] = []
    received = 0
    for index in lane_chunks(lane, push.lanes, push.weights_bytes):
        assembly.raise_if_failed()
        start, length = chunk_span(index, push.weights_bytes)
        view = area.view[start : start + length]
        began = time.perf_counter()
        _recv_exactly(conn, view, received, lane_total)
        timing.recv_s += time.perf_counter() - began
        received += length
        assembly.landed(index, view)
        hashed.append(assembly.digest.add(view, index))
    waited = time.perf_counter()
    for future in hashed:
        future.result()
    timing.wait_s += time.perf_counter() - waited
    return timing


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


async def load_opened(
    engine: GatedEngine, push: OpenedPush, receipt: Receipt, via: str = "stream"
) -> AdapterInfo:
    """The :data:`Finish` of a server: check the push's fields as an HTTP
    push's are checked, stage it while its bytes arrive, and install it as
    the adapter's next version once they all came and their digest matched.

    A push naming the current version is compared by its weights, so that
    one waits for all of them first. ``via``: how the bytes came, as
    ``skyrl_pushed_bytes_total`` counts them (a peer's lent area loads
    the same way, :mod:`.push_shared`).
    """
    fields = {**push.fields, "lora_name": push.lora_name}
    pushed = checked_push(fields, push.folder, "", weights_written=False)
    registry = engine.registry

    async def prepare(replaces: int | None) -> PreparedVersion | AdapterRecord:
        head = await receipt.head()
        if head is None:  # a header past the first chunk: checked in the whole file
            await receipt.digest()
            check_safetensors(receipt.weights)
        else:
            check_safetensors_head(head, push.weights_bytes)
        if registry.repeats(pushed.lora_name, pushed.version):  # compared by the whole file
            await receipt.digest()
        prepared = await registry.prepare_owned(
            pushed.lora_name,
            pushed.folder,
            STREAMED_PREFIX + "arriving",
            pushed.version,
            replaces,
            receipt.weights_fd,
        )
        if isinstance(prepared, AdapterRecord):
            return prepared
        try:
            digest = await receipt.digest()
        except BaseException:
            await registry.abandon(prepared)
            raise
        PUSHED_BYTES.labels(via=via).inc(push.weights_bytes)
        return dataclasses.replace(prepared, source_path=STREAMED_PREFIX + digest)

    applied = await load_pushed(engine, pushed, prepare)
    return engine.adapter_info(push.lora_name, applied=applied)
