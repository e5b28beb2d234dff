"""A weights file that is still arriving: how its writer says how much of it
is there, and how a reader waits for the bytes it needs.

Why: a pushed adapter's staging (reading the file, building the model,
writing the engine slot) used to start only once the push stream had
received every byte, so a push cost its transfer plus a whole path load.
The stream now starts the load when the push's first lane connects
(:mod:`skyrl_lora.server.http.push_stream`), and the worker's read of the
file (:class:`~skyrl_lora.server.adapters.adapter_file.OneBufferFile`)
follows the bytes as they land. What is checked stays as strict: the
version is installed only after the whole file's digest matched, and a
push that fails part-way fails its staging here.

The marker is a small file beside the weights (:data:`MARKER`), three
little-endian 64-bit fields: the file's final size, how many bytes from its
start are written, and a state (receiving, complete, failed). The writer
(the API server's stream, whose lanes write their chunks at their offsets)
updates it as chunks land; a reader (a worker of the engine, another
process) polls it. Once the digest matched, the state says complete and the
marker goes. A file without a marker is whole.

Tried and taken out again: each lane writing a part file of its own,
copied into the weights file after the digest (writers of one file queue on
its lock, so four threads wrote 336 MB into one file no faster than one on
the 2-core CPU machine). On the H100 machine the rank-64 push of the 8B
model then took 180 ms idle against 144 ms with one file (main dc11f19
against 719f52f, 2026-11-25): the lanes' receive did not get faster, and the
copy of the parts ran beside the staging.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: The marker's name, beside the weights file it describes.
MARKER = ".arriving"
_RECORD = struct.Struct("<QQQ")  # total bytes, bytes ready from the start, state
RECEIVING, COMPLETE, FAILED = 0, 1, 2
#: A reader's poll interval: the staging thread sleeps (the GIL free) between looks.
POLL_S = 0.001


class ArrivalFailed(Exception):
    """The push that was writing the file failed (or stalled past the reader's
    timeout); the file is not to be used. Not an ``OSError``: no reader may
    take it for a file to read another way."""


@dataclass(frozen=True)
class FollowedRead:
    """How a read that followed an arriving file to its end spent its time."""

    #: waiting for bytes not yet written (near 0: the read ran behind the bytes)
    waited_ms: float
    #: reading after its wait for the last slice: where it had caught up with
    #: the bytes, what the follow adds to the receive; else its last slice alone
    after_last_ms: float


_followed = threading.local()


def note_followed(read: FollowedRead) -> None:
    """A read on this thread followed an arriving file to its end."""
    _followed.last = read


def take_followed() -> FollowedRead | None:
    """The last read on this thread that followed an arriving file since the
    last call, if any (a staging takes it before and after its read)."""
    read: FollowedRead | None = getattr(_followed, "last", None)
    _followed.last = None
    return read


class ArrivalWriter:
    """The writer's side: created with the weights file, before any reader looks."""

    def __init__(self, folder: Path, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self._fd = os.open(folder / MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._write(0, RECEIVING)

    def ready(self, nbytes: int) -> None:
        """The file's first ``nbytes`` are written."""
        self._write(nbytes, RECEIVING)

    def complete(self) -> None:
        """The weights file is whole, and its digest matched."""
        self._write(self.total_bytes, COMPLETE)

    def fail(self) -> None:
        """The push failed: readers waiting for bytes give up."""
        self._write(0, FAILED)

    def close(self) -> None:
        os.close(self._fd)

    def _write(self, ready: int, state: int) -> None:
        os.pwrite(self._fd, _RECORD.pack(self.total_bytes, ready, state), 0)


class ArrivalStalled(ArrivalFailed):
    """No byte came for longer than the reader waits without one: its writer
    is gone without a word, or as good as gone."""


class Arrival:
    """The reader's side, for a weights file whose marker is beside it.

    ``dir_fd``: the folder the ``marker`` (then a name) is in, opened.
    ``stop``: a waiting reader gives up (:class:`ArrivalFailed`) once it is
    set; ``stall_s``: once no byte came for that long (:class:`ArrivalStalled`).
    """

    def __init__(
        self,
        marker: Path | str,
        timeout_s: float,
        dir_fd: int | None = None,
        stop: threading.Event | None = None,
        stall_s: float | None = None,
    ) -> None:
        self._fd = os.open(marker, os.O_RDONLY, dir_fd=dir_fd)
        self._timeout_s = timeout_s
        self._stop = stop
        self._stall_s = stall_s
        self.total_bytes, _, _ = self._read()

    @classmethod
    def beside(cls, weights_path: str | Path, timeout_s: float = 300.0) -> Arrival | None:
        """The arrival of ``weights_path`` (the marker in its folder; a link,
        such as a descriptor's ``/proc/self/fd/N``, is followed first); None
        for a whole file (no marker)."""
        try:
            return cls(_marker_of(weights_path), timeout_s)
        except FileNotFoundError:
            return None

    def wait_for(self, nbytes: int) -> None:
        """Return once the file's first ``nbytes`` are written; raises
        :class:`ArrivalFailed` if the push fails, or after the timeout."""
        self._wait(lambda ready, state: state == COMPLETE or ready >= nbytes, nbytes)

    def wait_whole(self) -> None:
        """Return once the weights file is whole and its digest matched."""
        self._wait(lambda ready, state: state == COMPLETE, self.total_bytes)

    def _wait(self, done: Callable[[int, int], bool], nbytes: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        seen, moved_at = -1, time.monotonic()
        while True:
            _, ready, state = self._read()
            if state == FAILED:
                raise ArrivalFailed("the push writing this adapter's weights failed")
            if done(ready, state):
                return
            now = time.monotonic()
            if now > deadline:
                raise ArrivalFailed(
                    f"{ready} of the {nbytes} bytes needed arrived in {self._timeout_s} s"
                )
            if ready != seen:
                seen, moved_at = ready, now
            elif self._stall_s is not None and now - moved_at > self._stall_s:
                raise ArrivalStalled(f"no byte came for {self._stall_s:g} s ({ready} in)")
            if self._stop is not None and self._stop.is_set():
                raise ArrivalFailed("the reader stopped waiting")
            time.sleep(POLL_S)

    def abandon(self) -> None:
        """Mark the arrival failed, for every reader: its writer is gone
        (:class:`ArrivalStalled`), and will not say so itself."""
        fd = os.open(f"/proc/self/fd/{self._fd}", os.O_WRONLY)
        try:
            os.pwrite(fd, _RECORD.pack(self.total_bytes, 0, FAILED), 0)
        finally:
            os.close(fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> tuple[int, int, int]:
        """The record, read until two reads agree (a write may land mid-read)."""
        while True:
            first = os.pread(self._fd, _RECORD.size, 0)
            if len(first) == _RECORD.size and first == os.pread(self._fd, _RECORD.size, 0):
                total, ready, state = _RECORD.unpack(first)
                return total, ready, state


def _marker_of(weights_path: str | Path) -> Path:
    return Path(os.path.realpath(weights_path)).parent / MARKER


def arriving_file(weights_path: str | Path) -> bool:
    """Whether ``weights_path`` (a link followed) has a marker beside it."""
    return _marker_of(weights_path).exists()


def arriving(folder: str | Path) -> bool:
    """Whether the weights file in the adapter's ``folder`` has a marker (it
    arrives, or arrived and its push has not yet installed it)."""
    return (Path(folder) / MARKER).exists()


def wait_whole(folder: str | Path) -> None:
    """For readers that cannot follow the bytes: wait until the weights file
    in the adapter's ``folder`` is whole (at once if nothing arrives there)."""
    wait_whole_file(Path(folder) / "weights")


def wait_whole_file(weights_path: str | Path) -> None:
    """:func:`wait_whole` for the weights file at ``weights_path`` (a link,
    such as a descriptor's ``/proc/self/fd/N``, followed)."""
    arrival = Arrival.beside(weights_path)
    if arrival is not None:
        with arrival:
            arrival.wait_whole()
