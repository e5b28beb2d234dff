"""Run a large byte-range job (a file read) in a few chunks at once.

One thread moves bytes out of the page cache at a few GB/s, so a 336 MB
adapter took tens of milliseconds to read. The system call that moves the
bytes (``preadv``) lets the GIL go, so a few threads of one process run
side by side; the chunks are split evenly, one per thread. (Writing one
file in parallel chunks gains nothing: the file system serialises writers
of one file, and a parallel snapshot copy measured no faster than one
``sendfile``.)
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

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
