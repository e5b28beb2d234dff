"""Write a version's snapshot weights file after its swap, not during it.

Every loaded version keeps an immutable snapshot folder: vLLM reads it again
if it evicts the version from its CPU cache, and a replica that restarts is
given its files (:func:`skyrl_lora.server.cluster.replay.snapshot_files`).
A hand-over brings no file, so the engine writes one. Written by
safetensors on the staging thread, that took 18-22 ms of a rank-16 swap on
an H100, with the GIL held while safetensors laid the file out, and an
8B model's rank-64 adapter is 17 times the bytes.

Here the file is laid out from the hand-over's description (a header, then
each tensor's bytes: the buffer's alignment gaps are left out, as the format
requires) and written with ``os.writev`` (a few system calls for the whole
adapter, the GIL released in each) on a thread of its own, after the swap.
Until it is in place the folder still holds its ``handover.json``: whoever
needs the file waits for that to go (:meth:`SnapshotWriter.wait` in the
engine process, :func:`wait_for_weights` elsewhere).

A path load works the same way where the API server can send the worker
the weights file it opened (:mod:`.stage_channel`): the registry copies
the rest of the folder, leaves :data:`PENDING_FILE` where the weights
will be, and the worker writes them from the bytes it read and staged
(the file's own header, then its data). Copied by the registry first, the
rank-64 adapter of the 8B model spent 100-190 ms of a 195 ms path load in
that copy on an H100 (823f7b7). Where the worker cannot build from what it
read, it copies the file into place before vLLM's loader opens it
(:func:`write_weights_from`).
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skyrl_lora.types import HANDOVER_ITEM_BYTES

from ..telemetry.observability import log_engine_event
from .arrival import MARKER as ARRIVING_FILE
from .arrival import wait_whole_file

logger = logging.getLogger("vllm.skyrl_lora.snapshot_writer")

#: In a snapshot folder whose weights file the engine writes later (a path
#: load's): whoever needs the file waits while it is there.
PENDING_FILE = "weights.pending"
#: In a push folder instead of the weights file: where a hand-over's weights
#: are (:func:`.handover.write_handover`).
HANDOVER_FILE = "handover.json"
#: Any in a snapshot folder says its weights file is not written yet (or,
#: for a streamed push's, not whole yet: :mod:`.arrival`).
SNAPSHOT_MARKERS = (HANDOVER_FILE, PENDING_FILE, ARRIVING_FILE)

#: A weights file to write: its head (length and JSON header), then, in
#: order, these byte spans of one buffer.
SnapshotLayout = tuple[bytes, list[tuple[int, int]]]

#: safetensors' names of the dtypes a hand-over carries.
SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def wait_for_weights(folder: Path, timeout_s: float = 120.0) -> None:
    """Wait while ``folder``'s weights file is still to be written by the
    engine, after a hand-over's or a path load's swap; at once for a folder
    whose files are all there."""
    deadline = time.monotonic() + timeout_s
    while any((folder / marker).exists() for marker in SNAPSHOT_MARKERS):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the snapshot of {folder.name} was not written in {timeout_s} s")
        time.sleep(0.01)


def safetensors_layout(tensors: list[dict[str, Any]]) -> SnapshotLayout:
    """The file's head (length and JSON header) and, per tensor in file
    order, the byte span of the buffer it is copied from."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    spans = []
    position = 0
    for tensor in tensors:
        nbytes = HANDOVER_ITEM_BYTES[tensor["dtype"]] * math.prod(tensor["shape"])
        header[tensor["name"]] = {
            "dtype": SAFETENSORS_DTYPES[tensor["dtype"]],
            "shape": list(tensor["shape"]),
            "data_offsets": [position, position + nbytes],
        }
        spans.append((tensor["offset"], tensor["offset"] + nbytes))
        position += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned
    return struct.pack("<Q", len(text)) + text, spans


def file_layout(head: bytes, nbytes: int) -> SnapshotLayout:
    """A file read whole: its own head, then its ``nbytes`` of data as read."""
    return head, [(0, nbytes)]


def write_snapshot_file(path: Path, buffer: Any, layout: SnapshotLayout) -> None:
    """Write ``layout`` from ``buffer`` (a uint8 host tensor) at ``path``, in place at once.

    The partial file is this thread's own: the workers of one engine (tensor
    parallel) each write the same snapshot, and the last rename wins.
    """
    head, spans = layout
    view = memoryview(buffer.numpy()).cast("B")
    chunks: list[Any] = [head, *(view[start:end] for start, end in spans)]
    with _partial(path) as fd:
        write_all(fd, chunks)


def write_weights_from(fd: int, folder: Path, name: str) -> None:
    """Copy the file open at ``fd`` (from its start, whatever its position)
    to ``folder / name`` and clear :data:`PENDING_FILE`: the snapshot's
    weights for a reader that needs the file itself. A file still arriving
    (:mod:`.arrival`) is copied once it is whole."""
    wait_whole_file(f"/proc/self/fd/{fd}")
    with _partial(folder / name) as out:
        copy_to_end(fd, out)
    (folder / PENDING_FILE).unlink(missing_ok=True)


class _partial:
    """A descriptor of ``path``'s partial file, renamed into place on success."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")

    def __enter__(self) -> int:
        self._fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        return self._fd

    def __exit__(self, kind: object, *rest: object) -> None:
        os.close(self._fd)
        if kind is None:
            os.replace(self._partial, self._path)
        else:
            self._partial.unlink(missing_ok=True)


def copy_to_end(src: int, dst: int) -> None:
    """``sendfile`` from ``src``'s start to its end, reading at explicit
    offsets (``src`` may be shared with another reader); a buffered copy on a
    file system or platform without it.

    The copy runs on a worker thread of the API server (a snapshot) or beside
    the engine's step loop (a held file), both busy with the GIL under load:
    a buffered copy gives the GIL back on every 1 MiB read and write and
    waits up to the switch interval (5 ms) to get it back each time. A 37 MB
    rank-16 adapter took 420 ms that way against a busy thread, and 45 ms
    with ``sendfile`` (one call per GiB).
    """
    offset = 0
    try:
        while sent := os.sendfile(dst, src, offset, 1 << 30):
            offset += sent
        return
    except (OSError, AttributeError) as exc:
        if offset or (isinstance(exc, OSError) and exc.errno not in _NO_SENDFILE):
            raise
    while chunk := os.pread(src, 1 << 20, offset):
        offset += len(chunk)
        write_all(dst, [chunk])


_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.ENOTSUP, errno.EOPNOTSUPP}


def write_all(fd: int, chunks: list[Any]) -> None:
    """``os.writev`` until every chunk is written (a call may write less, or
    take at most ``IOV_MAX`` chunks)."""
    most = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    while chunks:
        written = os.writev(fd, chunks[:most])
        while chunks and written >= len(chunks[0]):
            written -= len(chunks[0])
            chunks.pop(0)
        if written:
            chunks[0] = memoryview(chunks[0])[written:]


class SnapshotWriter:
    """One thread that writes snapshot weights files, one after another,
    each then clearing its folder's ``markers`` (a hand-over's description,
    :data:`PENDING_FILE`)."""

    def __init__(self, weights_file: str, markers: tuple[str, ...]) -> None:
        self._weights_file = weights_file
        self._markers = markers
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="skyrl-lora-snapshot"
        )
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[None]] = {}

    def submit(
        self,
        folder: Path,
        buffer: Any | Callable[[], Any],
        layout: Callable[[], SnapshotLayout],
    ) -> None:
        """Write ``folder``'s weights file from ``buffer`` (kept until written)
        as ``layout()`` says (worked out on the writer's thread), then clear
        its markers.

        ``buffer`` may be a function that returns it, run on the writer's
        thread first: a hand-over staged on the GPU copies its host buffers
        there, after the swap (:mod:`.staging`), and whoever waits for the
        file waits for that too.
        """
        key = str(folder)
        future = self._pool.submit(self._write, folder, buffer, layout)
        with self._lock:
            self._pending[key] = future
        future.add_done_callback(lambda done: self._forget(key, done))

    def later(self, work: Callable[[], object]) -> None:
        """Run ``work`` on the writer's thread after the writes submitted so
        far: work that must not hold up a swap (it is logged if it fails)."""
        self._pool.submit(self._logged, work)

    @staticmethod
    def _logged(work: Callable[[], object]) -> None:
        try:
            work()
        except Exception:
            logger.exception("skyrl-lora could not run %r after a swap", work)

    @property
    def busy(self) -> bool:
        """Whether a snapshot is being written or waits to be."""
        return bool(self._pending)

    def wait(self, folder: str | Path) -> None:
        """Return once ``folder``'s file is written (at once if none is pending)."""
        with self._lock:
            future = self._pending.get(str(folder))
        if future is not None:
            concurrent.futures.wait([future])

    def _forget(self, key: str, done: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._pending.get(key) is done:
                del self._pending[key]

    def _write(
        self,
        folder: Path,
        buffer: Any | Callable[[], Any],
        layout: Callable[[], SnapshotLayout],
    ) -> None:
        started = time.perf_counter()
        if callable(buffer):
            buffer = buffer()
        try:
            write_snapshot_file(folder / self._weights_file, buffer, layout())
            for marker in self._markers:
                (folder / marker).unlink(missing_ok=True)
        except FileNotFoundError:
            if folder.exists():
                raise
            return  # the version was retired and its folder removed first
        except Exception:
            logger.exception("skyrl-lora could not write the snapshot of %s", folder)
            raise
        log_engine_event(
            "snapshot_written",
            folder=folder.name,
            bytes=buffer.numel(),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
