"""Pickle an object whose torch tensors travel out of band, in one flat buffer.

The adapter reader process (:mod:`skyrl_lora.server.transfer.adapter_reader`) hands
vLLM's ``LoRAModel`` to the engine process. Pickling it whole would copy
every tensor through the pipe in small chunks, each chunk taking the engine
process's GIL again; torch's own sharing opens one shared-memory file per
tensor (224 for a rank-16 adapter of a 16-layer model). Here the object
graph is pickled with each tensor replaced by its place in one byte buffer:
the receiver reads the buffer with a single call into memory of its choice
(pinned, on a GPU machine: one allocation instead of one per tensor) and
rebuilds every tensor as a view of it.

Nothing here knows about LoRA or vLLM: whatever classes the object holds are
pickled by reference, as usual, and must be importable on both sides.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from typing import Any, BinaryIO

from ..adapters import chunked

#: Every tensor starts at a multiple of this, so views of any dtype are aligned.
ALIGNMENT = 64


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


class _TensorPickler(pickle.Pickler):
    """Writes each tensor's bytes to ``data`` and pickles ``(offset, dtype, shape)``."""

    def __init__(self, file: BinaryIO, data: BinaryIO) -> None:
        import torch  # here, not per object: persistent_id sees every object pickled

        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._data = data
        self._torch = torch
        self.nbytes = 0

    def persistent_id(self, obj: Any) -> Any:
        torch = self._torch
        if not isinstance(obj, torch.Tensor):
            return None
        if obj.device.type != "cpu":
            raise ValueError(f"only CPU tensors travel out of band, not {obj.device}")
        offset = _aligned(self.nbytes)
        flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
        self._data.write(b"\0" * (offset - self.nbytes))
        self._data.write(flat.numpy().data)
        self.nbytes = offset + flat.numel()
        return ("tensor", offset, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))


def dump(obj: Any, data: BinaryIO) -> tuple[bytes, int]:
    """Pickle ``obj``, writing its tensors' bytes to ``data``.

    Returns the pickle (small: the object graph without tensor data) and how
    many bytes the buffer needs.
    """
    skeleton = io.BytesIO()
    pickler = _TensorPickler(skeleton, data)
    pickler.dump(obj)
    return skeleton.getvalue(), pickler.nbytes


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, buffer: Any) -> None:
        import torch

        super().__init__(file)
        self._buffer = buffer
        self._torch = torch

    def persistent_load(self, pid: Any) -> Any:
        torch = self._torch
        kind, offset, dtype_name, shape = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown out-of-band object {kind!r}")
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        return self._buffer[offset : offset + nbytes].view(dtype).view(shape)


def load(skeleton: bytes, buffer: Any) -> Any:
    """Rebuild what :func:`dump` pickled; its tensors are views of ``buffer`` (uint8)."""
    return _TensorUnpickler(io.BytesIO(skeleton), buffer).load()


def host_buffers(pin_memory: bool) -> Callable[[int], Any]:
    """An ``allocate(nbytes)`` for the readers here: uint8 host memory, pinned if asked
    (one pinned allocation for a whole adapter, where a GPU copies from it)."""
    import torch

    def allocate(nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)

    return allocate


def read_buffer(path: str, nbytes: int, allocate: Callable[[int], Any]) -> Any:
    """Read a buffer file into ``allocate(nbytes)`` (a uint8 tensor) in as few calls as may be."""
    buffer = allocate(nbytes)
    with open(path, "rb", buffering=0) as file:
        chunked.read_exactly(file, buffer, nbytes, path)
    return buffer
