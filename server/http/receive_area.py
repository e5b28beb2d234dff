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
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import Executor
from pathlib import Path

from ..transfer.handover import SHM_DIR
from .push import WEIGHTS_FILE

#: Where areas live: memory-backed, so their pages never go to disk. The
#: engine maps and pins only files there (:func:`..loading.staged_buffer.in_shared_memory`),
#: so both name the one directory.
SHM_ROOT = SHM_DIR
_PAGE = mmap.PAGESIZE


class ReceiveArea:
    """One weights file in shared memory, mapped for writing, of a fixed size."""

    def __init__(self, root: Path, size: int) -> None:
        self.size = size
        self.folder = Path(tempfile.mkdtemp(prefix="skyrl-push-", dir=root))
        self.path = self.folder / WEIGHTS_FILE
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            _allocate(self.fd, size)
            self._map = mmap.mmap(self.fd, max(size, 1), flags=mmap.MAP_SHARED)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        _touch(self._map)
        self.view = memoryview(self._map)[:size]

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
        """An area of ``size`` bytes: an idle one of that size, else a new one."""
        with self._lock:
            for index, area in enumerate(self._idle):
                if area.size == size:
                    return self._idle.pop(index)
        return ReceiveArea(self.root, size)

    def give_back(self, area: ReceiveArea) -> None:
        """``area``'s push installed: keep it for the next (the oldest idle
        one goes if more than ``keep`` would be kept)."""
        with self._lock:
            if not self._closed:
                self._idle.append(area)
                if len(self._idle) <= self.keep:
                    return
                area = self._idle.pop(0)
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
