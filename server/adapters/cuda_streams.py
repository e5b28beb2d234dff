"""CUDA side streams per device for the staging's copies and folds.

On the engine's stream (the legacy default one, where vLLM's step loop
queues its kernels) a staging's copy would wait behind a whole step's
kernels, and a wait for it would wait for the engine's work too. A side
stream (torch makes them non-blocking) runs beside the engine, and a wait
covers the staging's own work alone.

Work that runs after a swap (the host copies of a model staged on the GPU)
has a stream of its own (:data:`AFTER_SWAP`): on the staging's stream the
next swap's copies queued behind the last one's device-to-host copies (two
of 336 MB, about 27 ms, for the 8B model's rank-64 adapter).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

#: The two purposes a stream serves: the swap itself, and what follows it.
STAGING = "staging"
AFTER_SWAP = "after_swap"

_streams: dict[tuple[Any, str], Any] = {}
_lock = threading.Lock()


def side_stream(device: Any, purpose: str = STAGING) -> Any:
    """The side stream of ``device`` (a CUDA device) for ``purpose``, made once."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, purpose)
    with _lock:
        if key not in _streams:
            _streams[key] = torch.cuda.Stream(device=device)
        return _streams[key]
