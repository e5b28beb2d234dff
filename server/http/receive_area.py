"""Resident shared memory that a streamed push's lanes receive into.

Why: a push's lanes used to read each chunk into a buffer and write it into
the weights file in the push's folder. Writers of one file queue on its
lock, and new page-cache pages cost their allocation: on an H200 machine's
host (16 cores) 336 MB took 116-138 ms to arrive over 4 loopback lanes that
way, against 30-34 ms into memory mapped and touched before
(``scripts/probes/receive_into.py``, 2026-11-26), and in the receive of a
rank-64 push of the 8B model the lanes spent about half their time waiting
for those writes.

So each lane reads its chunks straight into a map of a ``/dev/shm`` file,
an *area* of exactly the push's size. The areas are kept after a push and
handed to the next push of the same size (an RL trainer pushes one size
every step), so their pages are resident and already mapped. The engine's
worker reads the weights from the area's file (its descriptor goes with the
stage request, the push's arrival marker lies beside it), and writes the
snapshot's copy after the swap, as for a path load whose file it was given
open (:mod:`skyrl_lora.server.adapters.snapshot_writer`). An area goes back
to the pool when its push's load is done, before any lane answers.

On two H200 machines of the same kind (vLLM 0.26.0, 8B model, rank 64,
``benchmarks.scale --parts swap_cost``, 2026-11-26), the receive took 78 ms
p50 into areas (main cf489ef) and 121 ms into the folder's file (main
8768209), and the push's swap 142 / 170 ms idle / under load (2.09x /
1.76x the path load in the same run) against 165 / 182 ms (2.64x / 2.35x).

Tried and taken out: the API server writing the snapshot's weights file
from the area after the swap, so that the engine builds from the bytes as
read without a copy (main 366084d). The area was then busy for the write
after the answer, and a push that followed at once found none free and
mapped a new one (about 250 ms): 7 of 19 rank-64 pushes did.

An area is reused only after a push that succeeded: a failed push's
readers may still hold its file, so that one is closed and removed.

**Lent to the host.** Replicas of a group often share a host, and each
receiving the same push over a stream of its own moved the same bytes into
the host once per replica. A push opened with a ``share`` name
(:attr:`~skyrl_lora.types.PushStreamRequest.share`) has its area *lent*:
its folder is renamed ``skyrl-share-`` and the name (32 random hex digits
of the sender's: the capability to read it), and the other servers on the
host load the push from it (:mod:`.push_shared`), following its arrival
marker as this server's own staging does. Each peer holds a shared
``flock`` on the weights file while it reads, and adds a byte to
:data:`TAKEN_FILE` once it holds it; the digest, once matched, is written
to :data:`DIGEST_FILE` for a peer that comes after the marker went. A lent
area is reused only once every peer took it (or :data:`LEND_S` passed) and
none holds its lock, and then under a private name again, so that no peer
of an earlier push finds the next one's bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from skyrl_lora.errors import ConflictError

from ..transfer.handover import SHM_DIR
from .push import WEIGHTS_FILE

#: Where areas live: memory-backed, so their pages never go to disk. The
#: engine maps and pins only files there (:func:`..loading.staged_buffer.in_shared_memory`),
#: so both name the one directory.
SHM_ROOT = SHM_DIR
_PAGE = mmap.PAGESIZE
#: An area's private folder name starts with this.
PRIVATE_PREFIX = "skyrl-push-"
#: A lent area's folder: this, then the share's 32 hex digits.
SHARE_PREFIX = "skyrl-share-"
#: Beside a lent area's weights: the push's digest, once it matched.
DIGEST_FILE = ".digest"
#: Beside a lent area's weights: one byte per peer that took it.
TAKEN_FILE = ".taken"
#: Seconds a lent area waits for peers that have not taken it, at most.
LEND_S = 60.0


@dataclass(frozen=True)
class _Lent:
    peers: int
    since: float  # time.monotonic()


class ReceiveArea:
    """One weights file in shared memory, mapped for writing, of a fixed size."""

    def __init__(self, root: Path, size: int) -> None:
        self.size = size
        self.folder = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=root))
        self.path = self.folder / WEIGHTS_FILE
        self.lent: _Lent | None = None
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            _allocate(self.fd, size)
            self._map = mmap.mmap(self.fd, max(size, 1), flags=mmap.MAP_SHARED)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        _touch(self._map)
        self.view = memoryview(self._map)[:size]

    def lend(self, share: str, peers: int) -> Path:
        """Lend the area to ``peers`` servers on this host under ``share``
        (see the module's docstring); its folder, renamed, is returned."""
        shared = self.folder.parent / f"{SHARE_PREFIX}{share}"
        try:
            os.rename(self.folder, shared)  # only an empty folder of ours could be replaced
        except OSError as exc:
            raise ConflictError(f"push share {share} cannot be lent: {exc.strerror}") from exc
        self._moved(shared)
        self.lent = _Lent(peers, time.monotonic())
        return shared

    def settled(self, digest: str) -> None:
        """The push's bytes are whole and matched ``digest``: peers that come
        after its arrival marker went read the digest here."""
        if self.lent is not None:
            (self.folder / DIGEST_FILE).write_text(digest)

    def reusable(self) -> bool:
        """Whether the next push may write it: every peer it was lent to took
        it (or had :data:`LEND_S` to), and none holds it now."""
        lent = self.lent
        if lent is not None and time.monotonic() - lent.since < LEND_S:
            try:
                taken = os.stat(self.folder / TAKEN_FILE).st_size
            except FileNotFoundError:
                taken = 0
            if taken < lent.peers:
                return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return True

    def reclaim(self) -> None:
        """Take a lent area back for the next push, under a private name."""
        if self.lent is None:
            return
        for name in (DIGEST_FILE, TAKEN_FILE):
            (self.folder / name).unlink(missing_ok=True)
        private = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=self.folder.parent))
        os.rename(self.folder, private)  # onto the empty folder just made for it
        self._moved(private)
        self.lent = None

    def _moved(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / WEIGHTS_FILE

    def close(self) -> None:
        """Unmap and remove it (a reader holding the file keeps its bytes)."""
        self.view.release()
        with contextlib.suppress(BufferError):  # a view still exported: unmapped at exit
            self._map.close()
        os.close(self.fd)
        shutil.rmtree(self.folder, ignore_errors=True)


class ReceiveAreas:
    """Areas for pushes arriving now, and up to ``keep`` idle ones for the next.

    ``closer``: where an area given back beyond ``keep`` is unmapped and
    removed (tens of ms for a large one; the caller may be the event loop).
    """

    def __init__(
        self, root: Path = SHM_ROOT, keep: int = 2, closer: Executor | None = None
    ) -> None:
        self.root = root
        self.keep = keep
        self._closer = closer
        self._lock = threading.Lock()
        self._idle: list[ReceiveArea] = []
        self._closed = False

    @classmethod
    def available(cls, keep: int, closer: Executor | None = None) -> ReceiveAreas | None:
        """Areas in ``/dev/shm``; None where the host has none (pushes then
        write the weights file in their folder)."""
        return cls(SHM_ROOT, keep, closer) if keep > 0 and SHM_ROOT.is_dir() else None

    def take(self, size: int) -> ReceiveArea:
        """An area of ``size`` bytes: an idle one of that size that no peer
        still needs (:meth:`ReceiveArea.reusable`), else a new one."""
        with self._lock:
            for index, area in enumerate(self._idle):
                if area.size == size and area.reusable():
                    taken = self._idle.pop(index)
                    break
            else:
                taken = None
        if taken is None:
            return ReceiveArea(self.root, size)
        try:
            taken.reclaim()
        except BaseException:
            close_area(taken, self._closer)
            raise
        return taken

    def give_back(self, area: ReceiveArea) -> None:
        """``area``'s push installed: keep it for the next (if more than
        ``keep`` would be kept, the oldest goes, one no peer needs first)."""
        with self._lock:
            if not self._closed:
                self._idle.append(area)
                if len(self._idle) <= self.keep:
                    return
                free = [index for index, idle in enumerate(self._idle) if idle.reusable()]
                area = self._idle.pop(free[0] if free else 0)
        close_area(area, self._closer)

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for area in idle:
            area.close()


def close_area(area: ReceiveArea, closer: Executor | None) -> None:
    """Close ``area`` on ``closer``'s threads, or here (no executor, or one shut down)."""
    if closer is not None:
        try:
            closer.submit(area.close)
            return
        except RuntimeError:  # shut down with the listener
            pass
    area.close()


def host_token(root: Path = SHM_ROOT) -> str | None:
    """This host's name for its shared memory as this user sees it (see
    ``ServerInfo.push_share_host``): every server that sees the same
    ``root`` reads the same one, made by the first; None without ``root``,
    or where the name's file is not this user's."""
    if not root.is_dir():
        return None
    path = root / f"skyrl-host-{os.getuid()}"
    if not path.exists():
        made = root / f".skyrl-host-{secrets.token_hex(16)}"
        made.write_text(secrets.token_hex(16))
        try:
            os.link(made, path)  # atomic: of servers starting at once, one name wins
        except FileExistsError:
            pass
        finally:
            made.unlink()
    try:
        if path.stat().st_uid != os.getuid():
            return None
        return path.read_text().strip() or None
    except OSError:
        return None


def _allocate(fd: int, size: int) -> None:
    """Give the file its pages now (``/dev/shm`` allocates on ``fallocate``)."""
    os.ftruncate(fd, size)
    if size:
        with contextlib.suppress(OSError):  # a file system without it faults them in later
            os.posix_fallocate(fd, 0, size)


def _touch(area: mmap.mmap) -> None:
    """Map every page for writing once, so no lane takes a page fault later."""
    populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
    if populate is not None:
        with contextlib.suppress(OSError):
            area.madvise(populate)
            return
    view = memoryview(area)
    try:
        for offset in range(0, len(area), _PAGE):
            view[offset] = view[offset]
    finally:
        view.release()
