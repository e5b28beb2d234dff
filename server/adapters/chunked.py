"""Read a file into a buffer exactly, a large read in a few chunks at once.

One thread moves bytes out of the page cache at a few GB/s, so a 336 MB
adapter took tens of milliseconds to read. The system call that moves the
bytes (``preadv``) lets the GIL go, so a few threads of one process run
side by side; the chunks are split evenly, one per thread. (Writing one
file in parallel chunks gains nothing: the file system serialises writers
of one file, and a parallel snapshot copy measured no faster than one
``sendfile``.)

The adapter file's one-call read (:mod:`.adapter_file`), the reader
process's buffer (:mod:`.tensor_pickle`) and a host hand-over's copy
(:mod:`.handover`) all read through :func:`read_exactly`.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import threading
from collections.abc import Callable
from typing import Any

#: Jobs this large are split (:func:`large`).
PARALLEL_BYTES = 32 << 20
THREADS = 4

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def large(nbytes: int) -> bool:
    """Whether a job of ``nbytes`` is worth splitting."""
    return nbytes >= PARALLEL_BYTES


def run_in_chunks(nbytes: int, move: Callable[[int, int], None]) -> None:
    """``move(begin, end)`` for :data:`THREADS` even chunks of ``range(nbytes)``
    at once; returns when all are done, raising the first chunk's error."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                THREADS, thread_name_prefix="skyrl-lora-chunk"
            )
    step = -(-nbytes // THREADS)
    begins = range(0, nbytes, step)
    for _ in _pool.map(lambda begin: move(begin, min(begin + step, nbytes)), begins):
        pass


def read_exactly(
    file: io.RawIOBase | io.BufferedIOBase, buffer: Any, nbytes: int, path: str
) -> None:
    """Fill the first ``nbytes`` of ``buffer`` (a uint8 tensor) from ``file``'s position.

    ``readinto`` releases the GIL for the whole read, so the engine's step
    loop is not kept waiting by the copy. A large read from a file with a
    descriptor goes in a few chunks at once (``os.preadv``, the GIL released
    too, :func:`run_in_chunks`): one thread copies out of the page cache at a few
    GB/s, so a rank-64 adapter of an 8B model (336 MB) took tens of
    milliseconds to read. Leaves the file's position after the read. Raises
    EOFError if the file ends first.
    """
    if nbytes == 0:
        return
    view = memoryview(buffer.numpy()).cast("B")
    if large(nbytes):
        try:
            fd, start = file.fileno(), file.tell()
        except (OSError, io.UnsupportedOperation):
            fd = None
        if fd is not None:
            _read_in_chunks(fd, view, start, nbytes, path)
            file.seek(start + nbytes)
            return
    done = 0
    while done < nbytes:
        read = file.readinto(view[done:nbytes])
        if not read:
            raise EOFError(f"{path} ended after {done} of {nbytes} bytes")
        done += read


def pread_exactly(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (``preadv`` may read less per
    call); EOFError if the file ends first."""
    done = 0
    while done < len(view):
        read = os.preadv(fd, [view[done:]], offset + done)
        if not read:
            raise EOFError(f"{path} ended before byte {offset + len(view)} of the read")
        done += read


def _read_in_chunks(fd: int, view: memoryview, start: int, nbytes: int, path: str) -> None:
    """``nbytes`` from ``fd`` at ``start`` into ``view``, in chunks at once."""

    def read_chunk(begin: int, end: int) -> None:
        pread_exactly(fd, view[begin:end], start + begin, path)

    run_in_chunks(nbytes, read_chunk)
