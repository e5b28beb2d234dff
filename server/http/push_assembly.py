"""One streamed push on its way in: the weights file its lanes write, the
digest they feed, the arrival marker that lets its staging follow the
bytes, the receipt its load awaits, and the one answer every lane gives.

The listener (:mod:`.push_stream`) owns the sockets and the tickets; an
:class:`Assembly` owns what a push writes and decides, so that its lanes
(threads of their own) and its load (a coroutine on the event loop) meet
in one place, under one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_lora.chunk_digest import CHUNK_BYTES, ChunkedDigest
from skyrl_lora.chunk_digest import NAME as DIGEST_NAME
from skyrl_lora.errors import (
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    ServerError,
)
from skyrl_lora.types import AdapterInfo

from ..adapters.arrival import MARKER, ArrivalWriter
from ..telemetry.observability import log_event
from .push import WEIGHTS_FILE
from .receive_area import ReceiveArea, ReceiveAreas, close_area

logger = logging.getLogger(__name__)


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
    #: The name its receive area is lent under to ``share_peers`` servers on
    #: this host (:meth:`.receive_area.ReceiveArea.lend`); None: not lent.
    share: str | None = None
    share_peers: int = 0


class Receipt:
    """Where a push's bytes land and how far they came, as its load awaits
    it on the event loop.

    ``weights``: the weights file, whole once :meth:`digest` answers;
    ``weights_fd``: a descriptor of it where it is not in the push's folder
    but in a receive area (:mod:`.receive_area`): the load hands it to the
    engine, which writes the snapshot's copy (see
    :meth:`~skyrl_lora.server.adapters.registry.AdapterRegistry.prepare_owned`).
    Each step raises the stream's error instead if the push failed first.
    """

    def __init__(self, weights: Path, weights_fd: int | None = None) -> None:
        self.weights = weights
        self.weights_fd = weights_fd
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
#: <skyrl_lora.server.adapters.arrival>` marker), and must install nothing
#: before :meth:`Receipt.digest` answers.
Finish = Callable[[OpenedPush, Receipt], Coroutine[Any, Any, AdapterInfo]]


@dataclass
class LaneTiming:
    """Where one lane's receive spent its time: reading its socket, and
    waiting for its earlier chunks' writes and hashes to free a buffer.
    A lane that mostly waits is held by the writes or the hashes; one that
    mostly reads, by the sender or the network."""

    recv_s: float = 0.0
    wait_s: float = 0.0


#: What a lane with a ticket the listener does not take (or no longer) is told.
UNKNOWN_TICKET = "unknown push stream ticket (used already, expired, or never issued)"


class Answered(Exception):
    """A lane of a push that is over: it answers what the push answered."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(reply)
        self.reply = reply


class Assembly:
    """One push on its way in over its lanes: the file they write, the digest
    they feed, the load that follows them, and the one answer all lanes give."""

    def __init__(
        self,
        push: OpenedPush,
        join_timeout_s: float,
        area: ReceiveArea | None = None,
        areas: ReceiveAreas | None = None,
        pool: Executor | None = None,
    ) -> None:
        self.push = push
        self.started = self._prefix_at = time.perf_counter()
        #: Where the lanes receive: an area's map (given back to ``areas``
        #: after the push), else the folder's file (``fd``).
        self.area = area
        self._areas = areas
        self._pool = pool
        self.fd: int | None = None
        if self.area is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            self.fd = os.open(push.folder / WEIGHTS_FILE, flags, 0o600)
            lands_in = push.folder
        else:
            lands_in = self.area.folder
        self._dir = os.open(lands_in, os.O_RDONLY | os.O_DIRECTORY)  # kept across its move
        self.arrival = ArrivalWriter(lands_in, push.weights_bytes)
        if self.area is not None and push.share is not None:
            try:  # with its marker in it: a peer that finds it can follow the bytes
                lands_in = self.area.lend(push.share, push.share_peers)
            except BaseException:
                self.arrival.close()
                os.close(self._dir)
                raise
        self.digest = ChunkedDigest(total_bytes=push.weights_bytes, pool=pool)
        self.receipt = Receipt(lands_in / WEIGHTS_FILE, None if self.area is None else self.area.fd)
        self._area_holds = 2  # the lanes and the load: the last to finish gives it back
        self.digests_said: list[str] = []
        self.lane_timings: list[LaneTiming] = []
        self._write_s = 0.0  # summed over the writer threads
        self._join_deadline = time.monotonic() + join_timeout_s
        self._lock = threading.Lock()
        self._joined: set[int] = set()
        self._inside = 0
        #: When every lane that joined had left: lanes that come later are
        #: answered, not taken (:meth:`join`).
        self.closed_at: float | None = None
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
        self._release_area()

    def _release_area(self) -> None:
        """Once the lanes and the load are both done with the area: back to
        the pool after a push that installed, else removed (a failed push's
        readers may still be at its file)."""
        with self._lock:
            self._area_holds -= 1
            if self._area_holds or self.area is None:
                return
            area, installed = self.area, self._reply is not None and self._reply["status"] == 200
        if installed and self._areas is not None:
            self._areas.give_back(area)  # at once: the trainer's next push may follow now
        else:  # unmapping and removing 336 MB is not for the event loop's thread
            close_area(area, self._pool)

    def join(self, lane: int) -> None:
        """Lane ``lane`` connected (called under the listener's lock). A lane
        that never came before, after every other one left (the push failed
        first), gets the push's answer (:class:`Answered`); one sent again
        is refused as its ticket is."""
        with self._lock:
            check_lane(lane, self.push.lanes)
            if self.closed_at is not None and lane in self._joined:
                raise AuthenticationError(UNKNOWN_TICKET)
            if self.closed_at is not None:
                assert self._reply is not None  # closed only once answered
                raise Answered(self._reply)
            if lane in self._joined:
                raise BadRequestError(f"lane {lane} of the push is connected already")
            self._joined.add(lane)
            self._inside += 1

    def leave(self) -> None:
        """A lane's thread is out; the last one closes the push's files."""
        with self._lock:
            self._inside -= 1
            last = self._inside == 0 and self.closed_at is None
            if last:
                self.closed_at = time.monotonic()
        if last:  # the folder went into its snapshot, or goes now
            self.digest.close()
            for fd in (self.fd, self._dir):
                if fd is not None:
                    os.close(fd)
            self.arrival.close()
            shutil.rmtree(self.push.folder, ignore_errors=True)
            self._release_area()

    def write(self, index: int, view: memoryview, offset: int) -> None:
        """Write chunk ``index`` at ``offset`` of the folder's file; then as
        :meth:`landed`."""
        assert self.fd is not None, "a push received into an area writes no file"
        began = time.perf_counter()
        _write_at(self.fd, view, offset)
        took = time.perf_counter() - began
        with self._lock:
            self._write_s += took
        self.landed(index, view)

    def landed(self, index: int, view: memoryview) -> None:
        """Chunk ``index`` is in place: tell readers how far the weights are
        there from their start."""
        with self._lock:
            if index == 0:
                end = head_end(view)
                self._head = bytes(view[:end]) if end <= len(view) else None
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
                self._prefix_at = time.perf_counter()

    def lane_done(self, digest_said: str, timing: LaneTiming) -> bool:
        """A lane's bytes and digest are in; True for the push's last lane."""
        with self._lock:
            self.digests_said.append(digest_said)
            self.lane_timings.append(timing)
            return len(self.digests_said) == self.push.lanes

    def check(self) -> None:
        """Every lane is in: check the digest; the load may install now."""
        push = self.push
        lanes_in = time.perf_counter()
        digest = self.digest.hexdigest()
        digest_wait_s = time.perf_counter() - lanes_in
        for said in self.digests_said:
            if said != digest:
                raise BadRequestError(
                    f"{WEIGHTS_FILE} has {DIGEST_NAME} digest {digest}, the stream said "
                    f"{said}: the bytes were damaged"
                )
        if self.area is not None:
            self.area.settled(digest)
        self.arrival.complete()
        with contextlib.suppress(FileNotFoundError):  # the folder may be a snapshot by now
            os.unlink(MARKER, dir_fd=self._dir)
        log_event(
            "push_stream_received",
            lora_name=push.lora_name,
            bytes=push.weights_bytes,
            lanes=push.lanes,
            into="file" if self.area is None else "area",
            ms=_ms(time.perf_counter() - self.started),
            # when the readers following the bytes were told the last were there
            whole_ms=_ms(self._prefix_at - self.started),
            recv_ms=[_ms(t.recv_s) for t in self.lane_timings],
            wait_ms=[_ms(t.wait_s) for t in self.lane_timings],
            write_ms=_ms(self._write_s),
            digest_wait_ms=_ms(digest_wait_s),
        )
        self.receipt.received(digest)

    def raise_if_failed(self) -> None:
        """Stop a lane's receive once the push failed elsewhere."""
        reply = self._reply
        if reply is not None and reply["status"] != 200:
            raise BadRequestError("another lane of the push, or its load, failed")

    def fail(self, exc: ServerError) -> dict[str, Any]:
        """Fail the push (unless it was answered already); its answer. The
        answer is settled before the folder goes, so a load that fails for
        want of it (a race) cannot answer first."""
        reply = error_reply(exc)
        with self._lock:
            first = self._reply is None
            if first:
                self._reply = reply
                self.arrival.fail()
        self.receipt.failed(exc)
        if first:
            shutil.rmtree(self.push.folder, ignore_errors=True)
        return self._settle(reply)

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


def head_end(first: bytes | memoryview) -> int:
    """Where a safetensors file's header ends, from its first bytes: the
    header's length in 8 bytes, then the header (a file shorter than 8
    bytes: its end, and its check refuses it)."""
    return 8 + int.from_bytes(first[:8], "little") if len(first) >= 8 else len(first)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def check_lane(lane: int, lanes: int) -> None:
    if lane >= lanes:
        raise BadRequestError(f"the push has lanes 0 to {lanes - 1}, not {lane}")


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``view`` is at ``offset``."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def error_reply(exc: ServerError) -> dict[str, Any]:
    return {"status": exc.status, "error": {"type": exc.error_type, "message": exc.message}}
