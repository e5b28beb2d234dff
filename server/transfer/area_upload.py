"""A streamed push's receive area, copied to the GPU as its bytes land.

Why: a streamed push's bytes land in an *area*, a ``/dev/shm`` file the API
server keeps for the next push of the same size
(:mod:`skyrl_lora.server.http.receive_area`). The worker used to read them
into a pinned buffer (the snapshot's copy), copy that into the model's
pinned buffer, and copy the model into its engine slot. On an H100 the
rank-64 push of the 8B model (336 MB) spent 103-135 ms in the first of those
copies, CPU-bound at about 3 GB/s, which ended about 45 ms after the last
byte had landed; the slot write added 10-12 ms, and the push's sync took
2.0-2.3x a path load's (main e303c3b, 2026-11-27).

Here the worker maps the area's file itself and registers the mapping with
CUDA once (``cudaHostRegister``): each slice then goes to the GPU by DMA as
soon as it lands, with no CPU copy (:func:`copy_up`), and the model is built
from its layout's template on the GPU and written into its slot there, as a
GPU hand-over's is (:mod:`.staged_buffer`); its host copies are made after
the swap.

Registering pins every page of the area and takes the driver's lock: a
pinned allocation of that size stalled the engine's step loop for 314 ms on
an H200 (:mod:`.pinned_reserve`). So an area is registered once, on a
thread of its own, after the push that first brought it, whose staging
read it the host way; every later push into it goes up directly. An RL
trainer pushes one size every step, so that is every push but the first.
A failed registration leaves the CUDA runtime's last error on the thread
that tried it, and that thread does nothing else with CUDA.

An area the API server removed (its file unlinked) is unregistered and
unmapped on the next look, and so is the least recently used one beyond
:data:`MAX_AREAS`; never one a staging is copying from.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import mmap
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..adapters.arrival import FollowedRead
from ..telemetry.observability import log_engine_event

logger = logging.getLogger("vllm.skyrl_lora.area_upload")

#: Areas kept registered at most: the API server keeps two idle ones by
#: default (``PushStreamConfig.idle_areas``), plus those of pushes in flight.
MAX_AREAS = 4

#: ``cudaHostRegister`` flags: pinned for every context of the process, and
#: read only (the worker maps the area for reading; the device never writes it).
_PORTABLE = 0x01
_READ_ONLY = 0x08

_Key = tuple[int, int]


class Pinning(Protocol):
    """How host memory is registered with the GPU's driver (CUDA's, or a test's)."""

    def register(self, address: int, nbytes: int, read_only: bool) -> str | None:
        """Register ``nbytes`` at ``address`` for DMA (a mapping the process
        may not write, ``read_only``); None, or why it failed."""

    def unregister(self, address: int) -> None: ...


class CudaPinning:
    """``cudaHostRegister`` and ``cudaHostUnregister`` through torch's bindings
    (they let the GIL go)."""

    def __init__(self, device: Any) -> None:
        self._device = device

    def register(self, address: int, nbytes: int, read_only: bool) -> str | None:
        import torch

        torch.cuda.set_device(self._device)
        cudart = torch.cuda.cudart()
        flags = _PORTABLE | (_READ_ONLY if read_only else 0)
        error = cudart.cudaHostRegister(address, nbytes, flags)
        if int(error) == 0:
            return None
        return str(cudart.cudaGetErrorString(error))

    def unregister(self, address: int) -> None:
        import torch

        torch.cuda.set_device(self._device)
        torch.cuda.cudart().cudaHostUnregister(address)


@dataclass
class _Area:
    """One area's file as this worker maps it, registered for DMA."""

    #: This worker's own descriptor of the file: it tells when the file is unlinked.
    fd: int
    mapping: mmap.mmap
    #: The mapping as a uint8 tensor (what copies read from).
    host: Any
    #: Mapped for reading only (else for writing too, where the driver
    #: registers no read-only memory; nothing writes to it).
    read_only: bool
    #: Stagings copying from it now: it is not unregistered under them.
    users: int = 0

    @property
    def address(self) -> int:
        return int(self.host.data_ptr())


class RegisteredAreas:
    """Receive areas mapped and registered for DMA, by file (see the module's docstring)."""

    def __init__(self, pinning: Pinning, max_areas: int = MAX_AREAS) -> None:
        self._pinning = pinning
        self._max_areas = max_areas
        self._lock = threading.Lock()
        self._areas: OrderedDict[_Key, _Area] = OrderedDict()
        #: Files being registered, and those whose registration failed (read
        #: the host way from then on).
        self._pending: set[_Key] = set()
        self._refused: set[_Key] = set()
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="skyrl-lora-area-pin"
        )

    @contextlib.contextmanager
    def borrowed(self, fd: int) -> Iterator[Any | None]:
        """The registered mapping of ``fd``'s file (a uint8 tensor of the whole
        file), kept registered until the block ends; None for a file not
        registered yet, which is then registered on the area thread."""
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        with self._lock:
            area = self._areas.get(key)
            if area is not None:
                area.users += 1
                self._areas.move_to_end(key)
            elif key not in self._pending and key not in self._refused:
                self._pending.add(key)
                self._submit(self._register, key, os.dup(fd), stat.st_size)
        self._submit(self._prune)
        try:
            yield None if area is None else area.host
        finally:
            if area is not None:
                with self._lock:
                    area.users -= 1

    def registered(self) -> int:
        """How many areas are registered now."""
        with self._lock:
            return len(self._areas)

    def settled(self) -> None:
        """Return once the registrations and prunes asked for so far are done."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        """Unregister and unmap every area not in use, and stop the thread."""
        self._thread.submit(self._prune, True).result()
        self._thread.shutdown()

    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # closed: nothing more to register
            self._thread.submit(self._logged, work, *args)

    @staticmethod
    def _logged(work: Callable[..., None], *args: Any) -> None:
        try:
            work(*args)
        except Exception:
            logger.exception("skyrl-lora: receive area work %r failed", work)

    def _register(self, key: _Key, fd: int, nbytes: int) -> None:
        """Map ``fd``'s file and register it (on the area thread; ``fd`` is
        this call's to close). Mapped for reading where the driver registers
        read-only memory, else for reading and writing (nothing writes)."""
        started = time.perf_counter()
        why: str | None = "not tried"
        area = None
        try:
            for read_only in (True, False):
                area = _mapped(fd, nbytes, read_only)
                why = self._pinning.register(area.address, nbytes, read_only)
                if why is None:
                    break
                _unmap(area)
                area = None
        except Exception as exc:  # the area is read the host way: nothing is lost
            why = repr(exc)
            if area is not None:
                _unmap(area)
                area = None
        finally:
            os.close(fd)
        with self._lock:
            self._pending.discard(key)
            if area is not None:
                self._areas[key] = area
            else:
                self._refused.add(key)
        if area is None:
            logger.warning("skyrl-lora reads this receive area the host way: %s", why)
        log_engine_event(
            "receive_area_registered",
            bytes=nbytes,
            ms=round((time.perf_counter() - started) * 1000, 2),
            failed=None if area is not None else why,
            read_only=None if area is None else area.read_only,
            pinned=None if area is None else bool(area.host.is_pinned()),
        )
        self._prune()

    def _prune(self, everything: bool = False) -> None:
        """Unregister areas whose file is gone, and the oldest beyond
        :data:`MAX_AREAS` (all of them, ``everything``); none in use."""
        with self._lock:
            gone = [key for key, area in self._areas.items() if _unlinked(area.fd)]
            kept = [key for key in self._areas if key not in gone]
            extra = len(kept) if everything else max(0, len(kept) - self._max_areas)
            dropping = [key for key in [*gone, *kept[:extra]] if self._areas[key].users == 0]
            areas = [self._areas.pop(key) for key in dropping]
        for area in areas:
            self._pinning.unregister(area.address)
            _unmap(area)


def _mapped(fd: int, nbytes: int, read_only: bool) -> _Area:
    """The first ``nbytes`` of ``fd``'s file mapped (for reading only, or
    for writing too) as a uint8 tensor, through a descriptor of its own."""
    import numpy
    import torch

    own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY if read_only else os.O_RDWR)
    try:
        prot = mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
        mapping = mmap.mmap(own, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    except BaseException:
        os.close(own)
        raise
    with warnings.catch_warnings():  # read only, as meant: nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        host = torch.from_numpy(numpy.frombuffer(mapping, dtype=numpy.uint8))
    return _Area(own, mapping, host, read_only)


def _unmap(area: _Area) -> None:
    area.host = None
    with contextlib.suppress(BufferError):  # a view still exported: unmapped at exit
        area.mapping.close()
    os.close(area.fd)


def _unlinked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def copy_up(
    host: Any,
    start: int,
    nbytes: int,
    allocate: Callable[[int], Any],
    stream: Any = None,
    follow: Callable[[Callable[[int, int], None]], FollowedRead] | None = None,
) -> tuple[Any, Any]:
    """Two copies of ``host[start:start + nbytes]`` in ``allocate(nbytes)``
    buffers: the bytes as they are (the snapshot's) and the model's (its
    build folds scalings into it in place).

    The first is copied slice by slice as ``follow(copy)`` hands the slices
    out (:func:`.adapter_file.slice_follower`, for an area still arriving),
    or whole; the second from the first. On ``stream`` (a CUDA side
    stream): the buffers are allocated on the stream that writes them (see
    :func:`.handover.copies_on_stream`), and the stream is synchronized
    before this returns or raises, so no copy reads the area afterwards.
    """
    entered = contextlib.nullcontext() if stream is None else _on_stream(stream)
    with entered:
        try:
            raw = allocate(nbytes)
            non_blocking = bool(raw.is_cuda)

            def copy(begin: int, end: int) -> None:
                raw[begin:end].copy_(host[start + begin : start + end], non_blocking=non_blocking)

            if follow is None:
                copy(0, nbytes)
            else:
                follow(copy)
            model = allocate(nbytes)
            model.copy_(raw, non_blocking=non_blocking)
        finally:
            if stream is not None:
                stream.synchronize()
    return model, raw


def _on_stream(stream: Any) -> Any:
    import torch

    return torch.cuda.stream(stream)
