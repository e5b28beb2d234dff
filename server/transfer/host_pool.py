"""Host buffers kept for the next staging instead of allocated afresh.

A reload by path or push reads the adapter's file into host memory twice
over: once as read (what its snapshot's weights file is written from, after
the swap) and once as the copy its model is built from (the build folds
scalings in place). Both were fresh ``torch.empty(pin_memory=True)`` calls:
on an H100 with the 8B model those allocations were 45% of the staging
thread's wall time across the rank 8-128 swap-cost curve (11.9 of 26.2 s,
py-spy at main ca0af75, 2026-11-25, ``docs/gpu/pyspy_staging_ca0af75.txt``),
more than the reads themselves. Pinning pages is a driver call that also
takes the time of touching every page.

:class:`HostBufferPool` keeps the blocks it handed out and hands a block out
again once nothing but the pool holds its storage: no release call to
forget, so a staging that fails half-way loses nothing. That test (the
storage's use count) says nothing of copies still queued on a GPU stream,
so the pool is only for buffers no GPU copy reads from once they are
dropped: the snapshot's copy of a file (written to disk, never to a GPU)
and a hand-over's host snapshot (a device-to-host copy the writer waits
for). A model's buffer is left to torch's own caching allocator, which
records the streams that copy from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: Idle blocks kept at most (bytes); beyond that the largest idle ones go back to torch.
DEFAULT_MAX_IDLE_BYTES = 4 << 30
#: A block at most this many times the size asked for is handed out (no 1 GB block for 40 MB).
MAX_WASTE_FACTOR = 2


def _use_counter() -> Callable[[int], int] | None:
    """torch's count of a storage's holders (a private function, present
    since torch 2.0); None where this torch lacks it."""
    import torch

    return getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(tensor: Any) -> int:
    """How many holders ``tensor``'s storage has (views, numpy arrays, the tensor itself)."""
    counter = _use_counter()
    assert counter is not None
    return int(counter(tensor.untyped_storage()._cdata))


class HostBufferPool:
    """uint8 host buffers by size, reused once nobody holds them (see the module's docstring)."""

    def __init__(
        self,
        allocate: Callable[[int], Any],
        max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES,
    ) -> None:
        self._allocate = allocate
        self._max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        #: Every block kept, with its storage's use count when only the pool holds it.
        self._blocks: list[tuple[Any, int]] = []
        #: Off where torch cannot count a storage's holders: every take allocates.
        self.enabled = _use_counter() is not None
        self.reused = 0
        self.allocated = 0
        #: Seconds spent in fresh allocations (a reuse costs next to nothing).
        self.allocate_s = 0.0

    def take(self, nbytes: int) -> Any:
        """A uint8 buffer of ``nbytes``: an idle block's first bytes, or a new block."""
        if self.enabled:
            with self._lock:
                block = self._idle_block(nbytes)
                if block is not None:
                    self.reused += 1
                    return block[:nbytes]
        started = time.perf_counter()
        block = self._allocate(nbytes)
        with self._lock:
            self.allocate_s += time.perf_counter() - started
            self.allocated += 1
            if not self.enabled:
                return block
            self._blocks.append((block, storage_use_count(block)))
            self._trim()
        return block[:nbytes]

    def _idle(self) -> list[Any]:
        return [block for block, alone in self._blocks if storage_use_count(block) == alone]

    def _idle_block(self, nbytes: int) -> Any | None:
        """The smallest idle block that fits ``nbytes`` without much waste."""
        fitting = [
            block
            for block in self._idle()
            if nbytes <= block.numel() <= max(nbytes * MAX_WASTE_FACTOR, 1)
        ]
        return min(fitting, key=lambda block: block.numel(), default=None)

    def _trim(self) -> None:
        """Let the largest idle blocks go while more than the cap is idle."""
        idle = sorted(self._idle(), key=lambda block: block.numel())
        idle_bytes = sum(block.numel() for block in idle)
        while idle and idle_bytes > self._max_idle_bytes:
            dropped = idle.pop()
            idle_bytes -= dropped.numel()
            self._blocks = [entry for entry in self._blocks if entry[0] is not dropped]

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(block.numel() for block in self._idle())
