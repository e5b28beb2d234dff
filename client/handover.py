"""Adapter weights handed to a server on the same host, without serialising them.

A trainer colocated with its server pays, for an HTTP push, a copy from the
GPU to host memory, a safetensors file, the upload, the server's parse and
write, and the server's read back and copy to the GPU. :class:`AdapterHandover`
instead packs the adapter's tensors into one flat buffer it keeps (on the
tensors' GPU, or in a shared-memory file for host tensors) and sends the
server a handle to it (CUDA IPC, spelled out as plain fields: no pickle
crosses the wire). The server copies the buffer out before it answers.

Torch is imported only here and only when a hand-over is made: the client
itself installs without it. Where a server cannot open the memory (another
host or GPU, hand-overs off), :meth:`RemoteInferenceClient.push_lora_adapter
<skyrl_lora.client.RemoteInferenceClient.push_lora_adapter>` pushes the bytes
instead (:meth:`AdapterHandover.to_memory`).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skyrl_lora.client.push import InMemoryAdapter
from skyrl_lora.types import HANDOVER_ITEM_BYTES, HandoverTensor

SHM_DIR = Path("/dev/shm")
#: Each tensor starts at a multiple of this many bytes (any element size divides it).
ALIGN = 64


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


class AdapterHandover:
    """One trainer's adapter, shared with servers on its host by handle.

    Call :meth:`update` with the adapter's tensors (PEFT's naming, all on
    one device: one CUDA GPU, or the CPU) each time before a push; the
    tensors are copied into the buffer, so the trainer may keep training
    its own. The buffer is kept and reused while the layout stays the same.
    :meth:`close` frees it (a shared-memory file is removed).

    ``dtype`` (``"bfloat16"``, ``"float16"`` or ``"float32"``): the buffer
    holds every tensor in it, cast by the copy into the buffer; None keeps
    each tensor's own. A trainer that trains in float32 can then hand its
    parameters over as they are: casting each first (224 small kernels and
    allocations for a rank-16 adapter of a 0.8B model) took most of a
    learner's 20-25 ms to get its adapter's state on an H100 (369e2bc).
    """

    def __init__(self, config: Mapping[str, Any] | bytes, dtype: str | None = None) -> None:
        if dtype is not None and dtype not in HANDOVER_ITEM_BYTES:
            raise ValueError(f"a hand-over holds {sorted(HANDOVER_ITEM_BYTES)}, not {dtype!r}")
        self.config: dict[str, Any] = dict(
            json.loads(config) if isinstance(config, bytes) else config
        )
        self.dtype = dtype
        self._buffer: Any = None
        self._layout: list[HandoverTensor] = []
        #: Each layout entry's view of the buffer, in layout order.
        self._views: list[Any] = []
        self._shm: Path | None = None
        #: The CUDA stream the last :meth:`update` queued its copy on.
        self._stream: Any = None
        #: (name, dtype, shape, device) of each tensor the layout was planned for.
        self._signature: list[tuple[str, Any, Any, Any]] = []
        #: The layout as the request body carries it.
        self._described: list[dict[str, Any]] = []

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel())

    def update(self, tensors: Mapping[str, Any]) -> None:
        """Copy ``tensors`` into the buffer, cast to :attr:`dtype` where set.

        On a GPU the copy is queued on the current CUDA stream and not
        waited for: :meth:`request`'s share carries an event recorded on
        that stream after it, and the server's copy waits for that event on
        the GPU, so the trainer's thread does not. The trainer may go on
        writing its own tensors on the same stream, which runs after the
        copy; as for any torch operation, tensors made on another stream
        must outlive the copy there (``Tensor.record_stream``).
        """
        import torch

        if not tensors:
            raise ValueError("an adapter needs at least one tensor")
        # What the layout depends on, compared before any layout is planned:
        # planning validates one model per tensor, 3 of the 3.5 ms an update
        # of 448 tensors took on an H200 (scripts/probes/handover_update.py),
        # for a layout that a trainer's every update after the first keeps.
        signature = [(name, t.dtype, t.shape, t.device) for name, t in tensors.items()]
        if signature != self._signature:
            devices = {device for *_, device in signature}
            if len(devices) != 1:
                raise ValueError(
                    f"hand over tensors of one device, got {sorted(map(str, devices))}"
                )
            device = devices.pop()
            layout = self._plan(tensors)
            if layout != self._layout or self._buffer is None or self._buffer.device != device:
                self._allocate(layout, device)
            self._signature = signature
        device = signature[0][3]
        with torch.no_grad():
            # One call for every tensor: 448 ``copy_`` calls (the rank-64
            # adapter of an 8B model) took 13.5 ms on an H100 (cc51ce4),
            # launch overhead for what is a 0.4 ms copy. The layout is in the
            # tensors' order (the signature says it is theirs).
            torch._foreach_copy_(self._views, list(tensors.values()))
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def request(self) -> dict[str, Any]:
        """The body fields of ``POST /skyrl/v1/adapters/handover`` but the adapter's name
        and version (a fresh CUDA share each time: its event covers the last update)."""
        if self._buffer is None:
            raise RuntimeError("nothing to hand over yet: call update() first")
        return {"config": self.config, "buffer": self._share(), "tensors": list(self._described)}

    def to_memory(self) -> InMemoryAdapter:
        """The same adapter as bytes, for a push (one device-to-host copy)."""
        if self._buffer is None:
            raise RuntimeError("nothing to hand over yet: call update() first")
        host = self._buffer.cpu()
        tensors = {t.name: self._slice(t, host).clone() for t in self._layout}
        return InMemoryAdapter(weights=tensors, config=self.config)

    def close(self) -> None:
        self._buffer = None
        self._layout = []
        self._views = []
        self._signature = []
        self._described = []
        if self._shm is not None:
            self._shm.unlink(missing_ok=True)
            self._shm = None

    def __enter__(self) -> AdapterHandover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, tensors: Mapping[str, Any]) -> list[HandoverTensor]:
        layout = []
        offset = 0
        for name, tensor in tensors.items():
            dtype = self.dtype or str(tensor.dtype).removeprefix("torch.")
            if dtype not in HANDOVER_ITEM_BYTES:
                raise ValueError(
                    f"tensor {name!r} is {dtype}; a hand-over takes {sorted(HANDOVER_ITEM_BYTES)}"
                )
            entry = HandoverTensor.model_validate(
                {"name": name, "dtype": dtype, "shape": list(tensor.shape), "offset": offset}
            )
            layout.append(entry)
            offset += -(-entry.nbytes // ALIGN) * ALIGN
        return layout

    def _allocate(self, layout: list[HandoverTensor], device: Any) -> None:
        import torch

        self.close()
        nbytes = layout[-1].end
        if device.type == "cuda":
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            path = SHM_DIR / f"skyrl-handover-{secrets.token_hex(16)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            self._shm = path
            self._buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self._layout = layout
        self._views = [self._slice(entry) for entry in layout]
        self._described = [entry.model_dump() for entry in layout]

    def _slice(self, entry: HandoverTensor, buffer: Any = None) -> Any:
        import torch

        buffer = self._buffer if buffer is None else buffer
        flat = buffer[entry.offset : entry.end]
        return flat.view(getattr(torch, entry.dtype)).view(entry.shape)

    def _share(self) -> dict[str, Any]:
        import torch

        nbytes = self.nbytes
        if self._shm is not None:
            return {"kind": "shm", "nbytes": nbytes, "name": self._shm.name}
        (
            _device,
            handle,
            storage_size_bytes,
            storage_offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = self._shared_after_update()
        return {
            "kind": "cuda_ipc",
            "nbytes": nbytes,
            "device_uuid": str(torch.cuda.get_device_properties(self._buffer.device).uuid),
            "handle": _b64(handle),
            "storage_size_bytes": storage_size_bytes,
            "storage_offset_bytes": storage_offset_bytes,
            "ref_counter_handle": _b64(ref_counter_handle),
            "ref_counter_offset": ref_counter_offset,
            "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync_required),
        }

    def _shared_after_update(self) -> tuple[Any, ...]:
        """Torch's share of the buffer, made on the stream of the last
        update's copy: torch records the share's event on the current
        stream, and the event must follow the copy it vouches for."""
        import torch

        storage = self._buffer.untyped_storage()
        if self._stream is None:
            return storage._share_cuda_()
        with torch.cuda.stream(self._stream):
            return storage._share_cuda_()
