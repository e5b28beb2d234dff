"""A push loaded from another server's receive area on this host (``adapters/push/shared``).

Why: the replicas of a group often share a host (one per GPU). Pushed to
each over a stream of its own, one adapter's bytes crossed the wire and
landed in the host's memory once per replica, and the replicas' receives
competed for the same cores and links: four CPU replicas took 4.4x the
time of one (``docs/benchmarks.md``, weight sync).

How: the trainer streams the push to one server of the host with a
``share`` name and the number of its peers
(:attr:`~skyrl_lora.types.PushStreamRequest.share`); that server lends the
push's receive area under the name (:meth:`.receive_area.ReceiveArea.lend`).
Each peer gets the same request here. It finds the area by its name
(:func:`take_share`: a folder of this server's user, waited for until the
receiver's first lane lent it), holds a shared lock on its weights file
while it reads, and loads the push as the receiver does
(:func:`.push_stream.load_opened`): the engine is handed the file open and
follows its arrival marker, staging while the bytes land, and the version
installs only once the receiver has matched their digest (:func:`follow`).
So every replica of the host stages from the one copy, at once, and a GPU
worker copies it to its GPU by DMA as the receiver's does
(:mod:`..transfer.area_upload`).

A push the receiver fails fails here too (its marker says so); a share that
never appears, or that was taken back already, is answered 422
``push_stream_unavailable``, and the client streams that server a push of
its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from skyrl_lora.chunk_digest import CHUNK_BYTES
from skyrl_lora.errors import BadRequestError, ConflictError, PushStreamUnavailableError
from skyrl_lora.types import AdapterInfo

from ..adapters.arrival import MARKER, Arrival, ArrivalFailed, ArrivalStalled
from ..engine.gated import GatedEngine
from .push import WEIGHTS_FILE
from .push_assembly import OpenedPush, Receipt, head_end
from .push_stream import PushStreamConfig, load_opened
from .receive_area import DIGEST_FILE, SHARE_PREFIX, SHM_ROOT, TAKEN_FILE

#: Seconds a peer waits for the share to appear: the receiver lends its area
#: when its first lane connects, right after the ticket the client waited for.
#: ``SKYRL_PUSH_SHARE_WAIT_S`` sets it for a server no peer shares pushes
#: with: the test suite's session server, where the fuzz's shared pushes
#: name shares nobody lends, and each waited out 30 s (0-3 a run: the fuzz
#: took 1-93 s on the 2-core CPU machine).
SHARE_WAIT_S = float(os.environ.get("SKYRL_PUSH_SHARE_WAIT_S", "30"))
#: Seconds a peer follows the receiver's bytes, at most (as an engine's read does).
FOLLOW_S = 300.0
#: Seconds without a byte after which a peer takes the receiver for gone (it
#: killed, with no word in the marker): twice the wait after which a live
#: receiver fails the push itself (:attr:`PushStreamConfig.idle_timeout_s`).
#: The peer then marks the arrival failed, for its engine's read too.
STALL_S = 2 * PushStreamConfig.idle_timeout_s
_POLL_S = 0.002


@dataclass(frozen=True)
class TakenShare:
    """A lent receive area this server holds (its weights file locked shared)."""

    name: str
    dir_fd: int
    weights_fd: int
    weights: Path

    def close(self) -> None:
        for fd in (self.weights_fd, self.dir_fd):
            os.close(fd)


def take_share(share: str, weights_bytes: int, wait_s: float = SHARE_WAIT_S) -> TakenShare:
    """The area lent under ``share``, held: waited for until it appears,
    checked to be this user's and of the push's size, locked shared so that
    it is not reused under this reader, and counted as taken."""
    path = SHM_ROOT / f"{SHARE_PREFIX}{share}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise PushStreamUnavailableError(
                    f"no server on this host lent push share {share} within {wait_s:g} s: "
                    "stream this server a push of its own"
                ) from None
            time.sleep(_POLL_S)
    try:
        folder = os.fstat(dir_fd)
        if folder.st_uid != os.getuid():
            raise PushStreamUnavailableError(f"push share {share} is not this server's user's")
        weights_fd = os.open(WEIGHTS_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except BaseException:
        os.close(dir_fd)
        raise
    try:
        fcntl.flock(weights_fd, fcntl.LOCK_SH)
        try:  # still lent under that name: not taken back before the lock
            same = os.stat(path).st_ino == folder.st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise PushStreamUnavailableError(f"push share {share} was taken back already")
        size = os.fstat(weights_fd).st_size
        if size != weights_bytes:
            raise BadRequestError(
                f"push share {share} holds {size} bytes, the push says {weights_bytes}"
            )
        taken = os.open(TAKEN_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600, dir_fd=dir_fd)
        try:
            os.write(taken, b"1")
        finally:
            os.close(taken)
    except BaseException:
        os.close(weights_fd)
        os.close(dir_fd)
        raise
    return TakenShare(share, dir_fd, weights_fd, path / WEIGHTS_FILE)


def follow(taken: TakenShare, receipt: Receipt, stop: threading.Event) -> None:
    """Settle ``receipt`` as the receiver's bytes land: the header once the
    first chunk is in, the digest once every byte is and it matched (or
    fail it, with the receiver's push). Returns when it is settled or
    ``stop`` is set."""
    arrival: Arrival | None = None
    try:
        with contextlib.suppress(FileNotFoundError):  # none: the bytes all came (or went)
            arrival = Arrival(MARKER, FOLLOW_S, taken.dir_fd, stop, STALL_S)
        first = min(CHUNK_BYTES, os.fstat(taken.weights_fd).st_size)
        if arrival is not None:
            arrival.wait_for(first)
        end = head_end(os.pread(taken.weights_fd, 8, 0))
        receipt.head_written(os.pread(taken.weights_fd, end, 0) if end <= first else None)
        if arrival is not None:
            arrival.wait_whole()
        try:
            digest = _read_at(taken.dir_fd, DIGEST_FILE)
        except FileNotFoundError:
            raise ArrivalFailed("it was over before its bytes were whole") from None
        receipt.received(digest)
    except (ArrivalFailed, OSError, ValueError) as exc:
        if isinstance(exc, ArrivalStalled) and arrival is not None:
            arrival.abandon()
        receipt.failed(
            ConflictError(f"the push that brought push share {taken.name}'s bytes failed: {exc}")
        )
    finally:
        if arrival is not None:
            arrival.close()


async def load_shared(engine: GatedEngine, push: OpenedPush, share: str) -> AdapterInfo:
    """Load ``push`` from the receive area lent under ``share``: as the
    receiver loads it, while its bytes arrive (see the module's docstring).
    The push's folder (its config) is this call's, removed on failure."""
    try:
        taken = await asyncio.to_thread(take_share, share, push.weights_bytes)
    except BaseException:
        shutil.rmtree(push.folder, ignore_errors=True)
        raise
    receipt = Receipt(taken.weights, taken.weights_fd)
    stop = threading.Event()
    following = asyncio.ensure_future(asyncio.to_thread(follow, taken, receipt, stop))
    try:
        return await load_opened(engine, push, receipt, via="host_share")
    finally:  # the folder went into its snapshot, or goes now
        shutil.rmtree(push.folder, ignore_errors=True)
        stop.set()  # the follower reads through the share's descriptors: closed after it
        following.add_done_callback(lambda _: taken.close())


def _read_at(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        return os.read(fd, 256).decode("ascii").strip()
    finally:
        os.close(fd)
