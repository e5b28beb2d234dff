"""Read an adapter's safetensors file with one call into one buffer.

vLLM's loader opens ``adapter_model.safetensors`` with ``safetensors.safe_open``
and takes the tensors out one ``get_tensor`` at a time (a copy out of the
memory map each), then, on a GPU machine, pins every one of them with its own
``pin_memory`` call (a pinned allocation and a second copy each): 224 of each
for a rank-16 adapter of a 16-layer model, on the staging thread, which
shares the engine process's GIL with the step loop. :class:`OneBufferFile`
answers the same calls from one buffer filled by one ``readinto`` (which
lets the GIL go for the whole read): ``get_tensor`` returns a view. Where
the buffer is pinned, vLLM's ``tensor.to(dtype)`` (same dtype) and
``pin_memory()`` then return the view as it is, so the whole read is one
allocation and one copy.

The views share the buffer, so the buffer lives as long as any tensor of
the adapter; vLLM's packing keeps every tensor (it lists q/k/v and
gate/up, it does not concatenate them), so nothing is held that vLLM's own
read would have freed, bar the odd tensor vLLM skips. Unlike a memory map,
the buffer is private: vLLM's in-place scaling fold cannot reach the file.

Only what the loader uses is offered (``keys``, ``get_tensor``,
``metadata``, the context manager). A file this reader cannot map exactly
(a dtype torch lacks, a tensor not aligned for its dtype, a header that
does not add up) raises :class:`UnsupportedFile`, and the caller opens it
with safetensors as before.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from skyrl_lora.types import HANDOVER_ITEM_BYTES

from .arrival import Arrival, FollowedRead, note_followed
from .chunked import pread_exactly, read_exactly

#: safetensors' dtype names -> torch's (those torch has on every build we run).
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}

#: A header larger than this is not an adapter's (safetensors' own cap is 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class UnsupportedFile(Exception):
    """This file is left to safetensors' own reader (see the module's docstring)."""


class _ArrivingBytes:
    """An arriving file read by its offsets, each read once the writer says
    its bytes are there."""

    def __init__(self, path: str, fd: int, arrival: Arrival) -> None:
        self.path = path
        self._fd = fd
        self._arrival = arrival
        self.position = 0

    def read(self, nbytes: int) -> bytes:
        """``nbytes`` from :attr:`position` on, as a file's ``read`` (for the header)."""
        nbytes = max(0, min(nbytes, self._arrival.total_bytes - self.position))
        out = bytearray(nbytes)
        self.readinto(memoryview(out), self.position)
        self.position += nbytes
        return bytes(out)

    def tell(self) -> int:
        return self.position

    def fileno(self) -> int:
        return self._fd

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset``, once they are written."""
        self.wait_for(offset + len(view))
        pread_exactly(self._fd, view, offset, self.path)

    def wait_for(self, end: int) -> None:
        """Return once the file's bytes up to ``end`` are written."""
        self._arrival.wait_for(end)


#: A following read takes the bytes in slices of this size as they land.
FOLLOW_BYTES = 8 << 20


def follow_slices(
    source: _ArrivingBytes, nbytes: int, copy: Callable[[int, int], None]
) -> FollowedRead:
    """Call ``copy(begin, end)`` for ``nbytes`` from the source's position on,
    slice by slice, each once the writer says its bytes are there (``begin``
    and ``end`` count from that position); say how long it waited for bytes
    and how long it copied after its wait for the last slice."""
    start = source.tell()
    waited, there = 0.0, time.perf_counter()
    for begin in range(0, nbytes, FOLLOW_BYTES):
        end = min(begin + FOLLOW_BYTES, nbytes)
        asked = time.perf_counter()
        source.wait_for(start + end)
        there = time.perf_counter()
        waited += there - asked
        copy(begin, end)
    done = time.perf_counter()
    followed = FollowedRead(round(waited * 1000, 2), round((done - there) * 1000, 2))
    note_followed(followed)
    return followed


def slice_follower(
    file: io.FileIO | _ArrivingBytes, nbytes: int
) -> Callable[[Callable[[int, int], None]], FollowedRead] | None:
    """For a file still arriving (from :func:`opened_for_reading`, at its
    data): :func:`follow_slices` over its next ``nbytes``; None for a whole file."""
    if not isinstance(file, _ArrivingBytes):
        return None
    return lambda copy: follow_slices(file, nbytes, copy)


def _read_following(source: _ArrivingBytes, buffer: Any, nbytes: int) -> None:
    """Fill ``buffer`` with ``nbytes`` from the source's position, as they land."""
    view = memoryview(buffer.numpy()).cast("B")
    start = source.tell()

    def read(begin: int, end: int) -> None:
        pread_exactly(source.fileno(), view[begin:end], start + begin, source.path)

    follow_slices(source, nbytes, read)


def _entry(name: str, info: Any, data_bytes: int, torch: Any) -> tuple[Any, list[int], int, int]:
    """One header entry as ``(dtype, shape, begin, end)``, checked against the data's size."""
    try:
        dtype = getattr(torch, _DTYPES[info["dtype"]])
        shape = [int(size) for size in info["shape"]]
        begin, end = (int(offset) for offset in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedFile(f"tensor {name!r}: {exc!r} in {info!r}") from exc
    if not 0 <= begin <= end <= data_bytes or end - begin != math.prod(shape) * dtype.itemsize:
        raise UnsupportedFile(f"tensor {name!r}: offsets {begin}-{end} do not fit {info!r}")
    if begin % dtype.itemsize:
        raise UnsupportedFile(f"tensor {name!r} is not aligned for {info['dtype']}")
    return dtype, shape, begin, end


class Readable(Protocol):
    """What :func:`read_header` reads from: a file, or bytes still arriving."""

    def read(self, nbytes: int, /) -> bytes: ...


def read_header(file: Readable, size: int) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (a JSON object) and the size of the data after it.

    ``file`` is at its start and ``size`` bytes long. Raises ValueError, in
    words a user can act on, for a file too short or a header that is not
    there; the entries themselves are the caller's to check.
    """
    head, data_bytes = read_head(file, size)
    return parse_header(head), data_bytes


def read_head(file: Readable, size: int) -> tuple[bytes, int]:
    """A safetensors file's first bytes, up to its data (the header's length
    and the header), and the size of the data after them; ValueError as
    :func:`read_header` says."""
    prefix = file.read(8)
    if len(prefix) < 8:
        raise ValueError(f"truncated: {size} bytes")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
        raise ValueError("truncated or corrupt: bad header length")
    return prefix + file.read(header_bytes), size - 8 - header_bytes


def parse_header(head: bytes) -> dict[str, Any]:
    """The JSON object of a file's first bytes (from :func:`read_head`)."""
    try:
        header = json.loads(head[8:])
    except ValueError as exc:
        raise ValueError(f"corrupt: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError("corrupt: its header is not a JSON object")
    return header


#: Headers kept parsed, by their bytes (:meth:`FileHeader.read`).
PARSED_HEADERS = 8


@dataclass(frozen=True, eq=False)
class FileHeader:
    """A safetensors file's header, checked: each tensor's place in the data
    that follows it.

    One instance per header's bytes (:meth:`read` keeps the last
    :data:`PARSED_HEADERS`), shared by every reader of such a file: nothing
    changes it, and a cache may key on it (it compares and hashes by
    identity). Why: an RL trainer pushes one layout every step, and the
    parse ran on the staging thread, in the engine's process, holding the
    GIL the step loop needs. Parsing the header of the 8B model's rank-64
    adapter (448 tensors, 65 kB of JSON) and keying its layout was about
    4 ms of each staging's 10 ms of GIL-held Python on an H100 (py-spy
    ``--gil``, 89c5198, ``docs/gpu/push_process_e2ba6a6/``).
    """

    #: The file's first bytes, up to its data.
    head: bytes
    metadata: dict[str, str] | None
    #: By name: ``(dtype, shape, begin, end)``, offsets into the data.
    entries: dict[str, tuple[Any, list[int], int, int]]
    data_bytes: int
    #: :meth:`layout`'s answer, worked out once.
    description: dict[str, Any] | None = None

    @classmethod
    def read(cls, path: str, file: io.FileIO | _ArrivingBytes, size: int) -> FileHeader:
        """The header of ``file`` (at its start, ``size`` bytes long), which is
        left at its data; :class:`UnsupportedFile` where this reader cannot
        map it exactly."""
        try:
            head, data_bytes = read_head(file, size)
            return _parsed(head, data_bytes)
        except (ValueError, UnsupportedFile) as exc:
            raise UnsupportedFile(f"{path}: {exc}") from exc

    @classmethod
    def parse(cls, head: bytes, data_bytes: int) -> FileHeader:
        """The header of a file whose first bytes are ``head`` (from
        :func:`read_head`), followed by ``data_bytes`` of data; ValueError
        for a header that is not JSON, :class:`UnsupportedFile` for one
        this reader cannot map exactly."""
        import torch

        header = parse_header(head)
        metadata: dict[str, str] | None = header.pop("__metadata__", None)
        entries = {name: _entry(name, info, data_bytes, torch) for name, info in header.items()}
        return cls(head, metadata, entries, data_bytes, _description(entries, data_bytes))

    def layout(self) -> dict[str, Any] | None:
        """The tensors' places in the data in a hand-over's terms
        (:class:`skyrl_lora.types.HandoverTensor` fields), so a file's model
        can be built like a hand-over's (:mod:`.handover_template`); None
        for a file with a tensor a hand-over cannot carry (another dtype,
        a scalar, an empty dimension). Shared: not to be changed."""
        return self.description


@functools.lru_cache(maxsize=PARSED_HEADERS)
def _parsed(head: bytes, data_bytes: int) -> FileHeader:
    return FileHeader.parse(head, data_bytes)


def _description(
    entries: dict[str, tuple[Any, list[int], int, int]], data_bytes: int
) -> dict[str, Any] | None:
    """:meth:`FileHeader.layout` of ``entries``."""
    tensors = []
    for name, (dtype, shape, begin, _) in entries.items():
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in HANDOVER_ITEM_BYTES or not shape or min(shape) < 1:
            return None
        tensors.append({"name": name, "dtype": dtype_name, "shape": shape, "offset": begin})
    return {"buffer": {"nbytes": data_bytes}, "tensors": tensors}


@contextlib.contextmanager
def opened_for_reading(path: str) -> Iterator[tuple[io.FileIO | _ArrivingBytes, int]]:
    """``path`` open at its start, and its size: a whole file as it is, one
    still arriving (:mod:`.arrival`) as bytes read once they are there."""
    with open(path, "rb", buffering=0) as opened:
        arrival = Arrival.beside(path)
        if arrival is None:
            yield opened, os.fstat(opened.fileno()).st_size
            return
        with arrival:
            yield _ArrivingBytes(path, opened.fileno(), arrival), arrival.total_bytes


class OneBufferFile:
    """What vLLM's loader uses of ``safetensors.safe_open(path, framework="pt")``,
    read in one call into ``allocate(nbytes)`` (a uint8 tensor); a file still
    arriving (:mod:`.arrival`) is read as its bytes land. That one's failure
    is :class:`~.arrival.ArrivalFailed`, never :class:`UnsupportedFile`: its
    bytes are not to be read by anything else either."""

    def __init__(self, path: str, allocate: Callable[[int], Any]) -> None:
        with opened_for_reading(path) as (file, size):
            self.header = FileHeader.read(path, file, size)
            self._buffer = allocate(self.header.data_bytes)
            try:
                if isinstance(file, _ArrivingBytes):
                    _read_following(file, self._buffer, self.header.data_bytes)
                else:
                    read_exactly(file, self._buffer, self.header.data_bytes, path)
            except EOFError as exc:
                raise UnsupportedFile(str(exc)) from exc

    @property
    def head(self) -> bytes:
        """The file's first bytes, up to its data: with :attr:`buffer`, the file again."""
        return self.header.head

    @property
    def buffer(self) -> Any:
        """The file's data (everything after the header), as read."""
        return self._buffer

    def layout(self) -> dict[str, Any] | None:
        """:meth:`FileHeader.layout`, for this buffer."""
        return self.header.layout()

    def keys(self) -> list[str]:
        """The tensor names, sorted, as safetensors lists them."""
        return sorted(self.header.entries)

    def get_tensor(self, name: str) -> Any:
        """A view of the buffer; it keeps the whole buffer alive."""
        dtype, shape, begin, end = self.header.entries[name]
        return self._buffer[begin:end].view(dtype).view(shape)

    def metadata(self) -> dict[str, str] | None:
        return self.header.metadata

    def __enter__(self) -> OneBufferFile:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
