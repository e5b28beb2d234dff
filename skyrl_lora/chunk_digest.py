"""The digest a streamed push is checked by: sha256 over the xxh3-128 of each chunk.

Every byte of a push is hashed at both ends, on the host whose cores the
engine's step loop shares. sha256 ran at 1.4 GB/s a core on the 2-core CPU
machine (2026-11-28): 0.24 s of CPU at each end for the 8B model's 336 MB
rank-64 adapter, whose bytes take about 0.08 s over four lanes on the H100
machine's host, so several cores busy hashing while other tenants' tokens
are due. xxh3-128 does the same bytes at 23 GB/s a core (the same CPU
machine), 15 ms at each end.

The digest is not a signature: it finds bytes that a lane or the assembly
got wrong, and tells a repeated push of the same weights (an idempotent
no-op). Neither needs a cryptographic hash. A tenant reaches only its own
adapters, so a crafted collision could only make its own repeat a no-op.
The outer sha256 runs over 16 bytes a chunk, nothing.

The digest of ``data``: ``sha256(xxh3_128(c_0) || xxh3_128(c_1) || ...)``
over the pieces ``c_i = data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]``
(each chunk digest in xxhash's canonical big-endian bytes); the sha256 of no
chunks for empty data. The chunks' digests are independent, so each end
hashes its chunks on threads of their own (``xxhash`` lets the GIL go)
while the bytes move, and the digest is ready when the last chunk is. Both
ends cut the stream at the same offsets, so chunks are added whole: in
order, or by index where the total size is known (a push's lanes carry
every ``lanes``-th chunk each, see :func:`lane_chunks`). Pure computation,
no I/O: the client (:mod:`skyrl_lora.client.push_stream`) and the server
share it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Final

import xxhash

#: Bytes of every chunk but the last.
CHUNK_BYTES: Final = 8 << 20
#: How the digest is named where it is recorded (a version's ``lora_path``).
NAME: Final = "xxh3_128-chunked-8MiB"


def chunk_count(total_bytes: int) -> int:
    """How many chunks ``total_bytes`` are cut into."""
    return -(-total_bytes // CHUNK_BYTES)


def chunk_span(index: int, total_bytes: int) -> tuple[int, int]:
    """Where chunk ``index`` of ``total_bytes`` starts, and its length."""
    start = index * CHUNK_BYTES
    if index < 0 or start >= total_bytes:
        raise ValueError(f"{total_bytes} bytes have no chunk {index}")
    return start, min(CHUNK_BYTES, total_bytes - start)


def lane_chunks(lane: int, lanes: int, total_bytes: int) -> range:
    """The chunks lane ``lane`` of ``lanes`` carries: every ``lanes``-th from
    its own index, so the lanes together fill the file from its start."""
    return range(lane, chunk_count(total_bytes), lanes)


def lane_bytes(lane: int, lanes: int, total_bytes: int) -> int:
    """The bytes lane ``lane`` of ``lanes`` carries."""
    return sum(chunk_span(i, total_bytes)[1] for i in lane_chunks(lane, lanes, total_bytes))


def combine(chunk_digests: Iterable[bytes]) -> str:
    """The hex digest from the chunks' raw digests, in order."""
    outer = hashlib.sha256()
    for digest in chunk_digests:
        outer.update(digest)
    return outer.hexdigest()


def digest_of(data: bytes | memoryview) -> str:
    """The digest of bytes in memory, on this thread (for checks and tests)."""
    view = memoryview(data)
    chunks = (view[i : i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES))
    return combine(chunk_digest(chunk) for chunk in chunks)


def chunk_digest(chunk: bytes | memoryview) -> bytes:
    """One chunk's raw digest: its xxh3-128, 16 bytes."""
    return xxhash.xxh3_128_digest(chunk)


def _digest_read(read: Callable[[], bytes], index: int, length: int) -> bytes:
    chunk = read()
    _check_length(chunk, index, length)
    return chunk_digest(chunk)


def _check_length(chunk: bytes | memoryview, index: int, length: int) -> None:
    if len(chunk) != length:
        raise ValueError(f"chunk {index} holds {length} bytes, not {len(chunk)}")


class ChunkedDigest:
    """Hashes chunks on a pool of threads as they are added; :meth:`hexdigest` waits.

    Chunks come in order, or, with ``total_bytes`` given, by index from any
    number of threads (a push's lanes). The caller keeps a chunk's memory
    unchanged until the future that :meth:`add` returned is done (a
    receiver reuses its buffer after that). ``pool``: threads to hash on,
    kept by the caller across digests (starting threads for each one cost
    a busy receiver milliseconds); else the digest starts its own.
    """

    def __init__(
        self,
        threads: int | None = None,
        total_bytes: int | None = None,
        pool: Executor | None = None,
    ) -> None:
        count = threads if threads is not None else min(8, os.cpu_count() or 1)
        self._owned = pool is None
        self._pool = pool or ThreadPoolExecutor(
            max(1, count), thread_name_prefix="skyrl-chunk-hash"
        )
        self._total = total_bytes
        self._lock = threading.Lock()
        self._parts: dict[int, Future[bytes]] = {}
        self._last_short = False

    def add(self, chunk: bytes | memoryview, index: int | None = None) -> Future[bytes]:
        """Hash the next chunk (:data:`CHUNK_BYTES` long, except the last one),
        or chunk ``index`` of ``total_bytes`` (exactly its length)."""
        with self._lock:
            if index is None:
                if self._last_short:
                    raise ValueError("a chunk shorter than CHUNK_BYTES must be the last one")
                if len(chunk) > CHUNK_BYTES or not len(chunk):
                    raise ValueError(f"a chunk holds 1 to {CHUNK_BYTES} bytes, not {len(chunk)}")
                self._last_short = len(chunk) < CHUNK_BYTES
                index = len(self._parts)
            else:
                _check_length(chunk, index, self._new_chunk_length(index))
            future = self._pool.submit(chunk_digest, chunk)
            self._parts[index] = future
        return future

    def add_read(self, index: int, read: Callable[[], bytes]) -> Future[bytes]:
        """Hash chunk ``index`` of ``total_bytes`` as ``read`` returns it, on
        the hashing threads: a sender that hands its bytes to the kernel
        (``sendfile``) never holds them, so the copy hashed is read there,
        beside the send. An error of ``read``, or bytes not of the chunk's
        length, fails the digest (:meth:`hexdigest` raises it)."""
        with self._lock:
            length = self._new_chunk_length(index)
            future = self._pool.submit(_digest_read, read, index, length)
            self._parts[index] = future
        return future

    def _new_chunk_length(self, index: int) -> int:
        """The length of chunk ``index`` of ``total_bytes``, not added yet (lock held)."""
        if self._total is None:
            raise ValueError("chunks are added by index only where total_bytes is known")
        if index in self._parts:
            raise ValueError(f"chunk {index} was added already")
        return chunk_span(index, self._total)[1]

    def hexdigest(self) -> str:
        """The digest of every chunk added, once each is hashed."""
        with self._lock:
            count = len(self._parts) if self._total is None else chunk_count(self._total)
            missing = [i for i in range(count) if i not in self._parts]
            if missing:
                raise ValueError(f"chunks {missing[:5]} of {count} were never added")
            parts = [self._parts[i] for i in range(count)]
        return combine(part.result() for part in parts)

    def close(self) -> None:
        """Stop the threads (chunks not yet hashed are dropped)."""
        for part in self._parts.values():
            part.cancel()
        if self._owned:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> ChunkedDigest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
