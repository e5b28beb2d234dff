"""Trainers' CUDA shares kept open from one hand-over to the next.

A trainer hands over the same GPU buffer each time
(:class:`skyrl_lora.client.handover.AdapterHandover` keeps it while the
adapter's layout holds). Opened and closed for every hand-over, its CUDA IPC
mapping cost a loaded staging on an H100 1.1 ms to open and 6.2 ms median
(18 ms p90) to close, the close (``cudaIpcCloseMemHandle``, run as the last
tensor of the share is freed) spinning on the staging thread (8B shape, rank
64, 3e3b49d). Kept open, the next hand-over of the same buffer finds the
mapping in torch's cache of opened handles, and nothing is closed.

A share is closed when its adapter hands over another buffer (the trainer
made a new one), when the version it was opened for is removed with no newer
one opened since (the adapter was unloaded, or a version loaded another way,
by path or push, replaced it), or when more adapters than
``limit`` hold one (least recently used first). Closes run after the swap,
on a thread that does not stage (:meth:`OpenShares.close_retired`).

What it costs: the trainer's buffer stays mapped here until then. A trainer
that frees it (or exits) meanwhile leaves its memory allocated (torch keeps
such a block until every consumer let go) and torch warns at its exit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .handover import open_cuda_ipc, wait_for_trainer

#: Adapters whose trainer's share stays open, at most, by default.
DEFAULT_OPEN_SHARES = 32

#: What identifies one trainer buffer: its handle, where in the handle's
#: allocation it starts, its size, and this process's device number.
ShareKey = tuple[str, int, int, int]


def share_key(buffer: dict[str, Any], index: int) -> ShareKey:
    return (
        str(buffer["handle"]),
        int(buffer["storage_offset_bytes"]),
        int(buffer["nbytes"]),
        index,
    )


@dataclass(frozen=True)
class _Held:
    key: ShareKey
    tensor: Any
    #: The engine's id of the version it was last opened for.
    lora_int_id: int


class OpenShares:
    """The shares this worker keeps open, one per adapter, and those to close.

    ``limit`` 0 keeps nothing open: every share closes when its copy is
    done. ``open_share(buffer, index)`` opens a share without waiting for
    the trainer's event (:func:`.handover.open_cuda_ipc`): :meth:`open`
    waits for it, for a share opened afresh and one found open alike.
    """

    def __init__(
        self,
        limit: int = DEFAULT_OPEN_SHARES,
        open_share: Callable[[dict[str, Any], int], Any] = open_cuda_ipc,
    ) -> None:
        if limit < 0:
            raise ValueError(f"a share limit is 0 or more, got {limit}")
        self._open_share = open_share
        self.limit = limit
        self._lock = threading.Lock()
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._retired: list[Any] = []

    def open(self, adapter: str, lora_int_id: int, buffer: dict[str, Any], index: int) -> Any:
        """``buffer`` as a tensor of this process, opened for version
        ``lora_int_id`` of ``adapter``; the current CUDA stream waits for
        the trainer's event, if it sent one.

        Opened even where it is held: torch then finds the held mapping by
        its handle and only lets go of the trainer's count for this share
        (each share the trainer makes counts one reader, and its buffer's
        memory is freed only once every count went).
        """
        tensor = self._open_share(buffer, index)
        wait_for_trainer(buffer, index)
        if self.limit:
            self._hold(adapter, _Held(share_key(buffer, index), tensor, lora_int_id))
        return tensor

    def _hold(self, adapter: str, held: _Held) -> None:
        with self._lock:
            last = self._held.pop(adapter, None)
            if last is not None and last.key != held.key:
                self._retired.append(last.tensor)
            self._held[adapter] = held
            while len(self._held) > self.limit:
                _, oldest = self._held.popitem(last=False)
                self._retired.append(oldest.tensor)

    def forget(self, lora_int_id: int) -> bool:
        """Retire the share last opened for ``lora_int_id`` (that version is
        removed, and no newer one of its adapter was handed over since);
        whether one was."""
        with self._lock:
            for adapter, held in self._held.items():
                if held.lora_int_id == lora_int_id:
                    del self._held[adapter]
                    self._retired.append(held.tensor)
                    return True
        return False

    @property
    def retired(self) -> int:
        """Shares waiting to be closed."""
        with self._lock:
            return len(self._retired)

    def held(self) -> dict[str, ShareKey]:
        """Each adapter's open share."""
        with self._lock:
            return {adapter: held.key for adapter, held in self._held.items()}

    def close_retired(self) -> int:
        """Close the retired shares (their last references go); how many.

        Closed on the caller's current CUDA stream: torch synchronizes it
        first (on the default stream, that waits for the engine's step).
        """
        with self._lock:
            closing, self._retired = self._retired, []
        count = len(closing)
        closing.clear()
        return count
