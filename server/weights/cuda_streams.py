"""One CUDA side stream per device for the staging's copies and folds.

On the engine's stream (the legacy default one, where vLLM's step loop
queues its kernels) a staging's copy would wait behind a whole step's
kernels, and a wait for it would wait for the engine's work too. A side
stream (torch makes them non-blocking) runs beside the engine, and a wait
covers the staging's own work alone.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_streams: dict[Any, Any] = {}
_lock = threading.Lock()


def side_stream(device: Any) -> Any:
    """The side stream of ``device`` (a CUDA device), made once."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device=device)
        return _streams[device]
