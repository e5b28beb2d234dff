"""Adapter weights handed over from a trainer's memory on the server's host.

A trainer colocated with the server (same host, often the same GPU) need not
write its adapter to bytes and send them over HTTP: it shares one flat
buffer holding every tensor (CUDA IPC for GPU memory, a shared-memory file
for host memory) and sends a small JSON description of it
(:class:`skyrl_lora.types.HandoverRequest`). The API server writes that
description into the push folder as :data:`HANDOVER_FILE`, beside the
adapter's config, and loads the folder like any push. The engine's staging
thread (:mod:`.staging`) finds the file, copies the buffer in one go into
host memory (pinned where vLLM pins: one device-to-host copy for CUDA),
and gives vLLM's own loader the copied tensors instead of a file (or, for a
layout it has seen, re-points the last model's views, :mod:`.handover_template`).
The adapter's weights file, which vLLM reads again if it ever evicts the
version, is written into the snapshot after the swap (:mod:`.snapshot_writer`).
The trainer's memory is read only before the server answers, so the trainer
may overwrite its buffer as soon as the call returns. A CUDA share stays
mapped until the trainer hands over another buffer (:mod:`.open_shares`):
closing it cost a loaded staging more than the copy did.

Nothing is unpickled: the description carries plain numbers and handles,
checked here (:func:`check_layout`) before any memory is opened.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_lora.errors import BadRequestError, HandoverUnavailableError, PayloadTooLargeError
from skyrl_lora.types import HandoverRequest, HandoverTensor

from ..adapters.chunked import read_exactly
from ..adapters.snapshot_writer import HANDOVER_FILE

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: Where POSIX shared memory lives on Linux (``shm_open`` names).
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class HandoverAccess:
    """Whether this server takes hand-overs, and from which GPUs.

    Off unless ``serve --allow-handover``: a hand-over lets a caller make the
    engine process open memory it names, which only a trainer on the same
    host, trusted as much as the server, should do. It also needs the
    engine's staging thread, which copies the memory out.
    """

    allowed: bool = False
    staging: bool = False
    device_uuids: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        return self.allowed and self.staging

    def check(self, request: HandoverRequest, max_bytes: int) -> None:
        """Refuse what this server cannot or will not open, before anything is opened."""
        if not self.allowed:
            raise HandoverUnavailableError(
                "this server takes no hand-overs (serve --allow-handover): push the weights"
            )
        if not self.staging:
            raise HandoverUnavailableError(
                "hand-overs need adapter staging, which this engine lacks: push the weights"
            )
        check_layout(request, max_bytes)
        check_reachable(request, self.device_uuids)


#: A server that takes none (the default).
NO_HANDOVERS = HandoverAccess()


def check_layout(request: HandoverRequest, max_bytes: int) -> None:
    """Refuse a description whose tensors do not lie inside the buffer, overlap
    badly aligned, or repeat a name, and a buffer above ``--max-adapter-bytes``."""
    nbytes = request.buffer.nbytes
    if nbytes > max_bytes:
        raise PayloadTooLargeError(
            f"the handed-over adapter ({nbytes} bytes) is larger than the server's limit of "
            f"{max_bytes} bytes (--max-adapter-bytes)"
        )
    seen: set[str] = set()
    for tensor in request.tensors:
        if tensor.name in seen:
            raise BadRequestError(f"tensor {tensor.name!r} is described twice")
        seen.add(tensor.name)
        if any(dim < 1 for dim in tensor.shape):
            raise BadRequestError(f"tensor {tensor.name!r} has shape {tensor.shape}")
        item = tensor.item_bytes
        if tensor.offset % item:
            raise BadRequestError(
                f"tensor {tensor.name!r} starts at byte {tensor.offset}, not a multiple of "
                f"its element size {item}"
            )
        if tensor.end > nbytes:
            raise BadRequestError(
                f"tensor {tensor.name!r} ends at byte {tensor.end}, past the buffer's "
                f"{nbytes} bytes"
            )


def check_reachable(request: HandoverRequest, device_uuids: frozenset[str]) -> None:
    """Refuse, as unavailable (the client then pushes bytes), memory this
    server cannot open: another GPU, or a shared-memory file it cannot see."""
    buffer = request.buffer
    if buffer.kind == "cuda_ipc":
        if buffer.device_uuid not in device_uuids:
            raise HandoverUnavailableError(
                f"the trainer's GPU {buffer.device_uuid} is not one of this server's "
                f"({', '.join(sorted(device_uuids)) or 'none'}): push the weights instead"
            )
        return
    path = SHM_DIR / buffer.name
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise HandoverUnavailableError(
            f"shared memory {buffer.name!r} is not on this server's host ({exc.strerror}): "
            "push the weights instead"
        ) from exc
    if size < buffer.nbytes:
        raise BadRequestError(
            f"shared memory {buffer.name!r} holds {size} bytes, the description says "
            f"{buffer.nbytes}"
        )


def write_handover(folder: Path, request: HandoverRequest) -> None:
    """The push folder of a hand-over: the adapter's config and the description."""
    (folder / CONFIG_FILE).write_text(json.dumps(request.config))
    description = {
        "buffer": request.buffer.model_dump(),
        "tensors": [t.model_dump() for t in request.tensors],
    }
    (folder / HANDOVER_FILE).write_text(json.dumps(description))


def take_handover(folder: Path) -> dict[str, Any] | None:
    """The description in a snapshot folder, if it came by hand-over (None for files)."""
    path = folder / HANDOVER_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return dict(json.loads(text))


def copy_out(
    description: dict[str, Any],
    allocate: Callable[[int], Any],
    device_index: Callable[[str], int],
    copies: int = 1,
    times: dict[str, float] | None = None,
    open_share: Callable[[dict[str, Any], int], Any] | None = None,
) -> list[Any]:
    """Copy the shared buffer into ``copies`` fresh ``allocate(nbytes)``
    (``uint8`` tensors, on the host, or on the trainer's GPU for a CUDA
    buffer), each whole, and let go of the shared memory.

    ``device_index`` maps a GPU's UUID to this process's device number. The
    staging takes two: one becomes the model (its B tensors are scaled in
    place), the other the snapshot file, written later as handed over.
    CUDA copies run on a side stream (:mod:`.cuda_streams`): on the
    engine's stream they queued behind a whole step's kernels under load.

    ``open_share(buffer, index)`` opens a CUDA share and makes the current
    stream wait for the trainer's event (default :func:`open_and_wait`: a
    share of its own, closed when the copies are done; a worker keeps its
    trainers' shares open instead, :mod:`.open_shares`).

    ``times``, where given, gets a CUDA share's parts in ms: the open of the
    handle (``open_ms``), the allocations, the copies' launch and the wait
    for them (``copies_ms``), and the close (``close_ms``, next to nothing
    for a share kept open).
    """
    import torch

    from ..adapters.cuda_streams import side_stream

    buffer = description["buffer"]
    nbytes = int(buffer["nbytes"])
    if buffer["kind"] == "shm":
        hosts = [allocate(nbytes) for _ in range(copies)]
        with (SHM_DIR / buffer["name"]).open("rb", buffering=0) as shared:
            read_exactly(shared, hosts[0], nbytes, buffer["name"])
        for host in hosts[1:]:
            host.copy_(hosts[0])
        return hosts
    index = device_index(buffer["device_uuid"])
    stream = side_stream(torch.device("cuda", index))
    marks = [time.perf_counter()]
    with torch.cuda.device(index), torch.cuda.stream(stream):
        shared = (open_share or open_and_wait)(buffer, index)
        marks.append(time.perf_counter())
        hosts = copies_on_stream(shared, allocate, copies, stream)
        marks.append(time.perf_counter())
        del shared  # closes the handle unless it is kept open
    marks.append(time.perf_counter())
    if times is not None:
        for name, (a, b) in zip(("open_ms", "copies_ms", "close_ms"), itertools.pairwise(marks)):
            times[name] = round((b - a) * 1000, 2)
    return hosts


def copies_on_stream(
    source: Any, allocate: Callable[[int], Any], copies: int, stream: Any
) -> list[Any]:
    """``copies`` copies of the CUDA tensor ``source``, allocated and written
    on ``stream`` (a side stream), which is synchronized before they return.

    Allocated on the stream that writes them, not on the caller's: torch's
    caching allocator hands out a block freed on the current stream as soon
    as its tensor is freed, while kernels queued earlier on that stream may
    still write it. Taken on the engine's stream, a staging's buffer could be
    overwritten by the step in flight after the copy into it: on the H100 one
    adapter's slot held activation-like values (largest 70,144, every one
    finite, so the finite check passed), its logits were NaN, and vLLM
    0.26's sampler then picked a token outside the vocabulary, which killed
    the engine (main ca0af75 and 5786b60, 2026-11-25).
    """
    import torch

    with torch.cuda.stream(stream):
        made = [allocate(int(source.numel())) for _ in range(copies)]
        for copy in made:
            copy.copy_(source, non_blocking=copy.is_cuda or copy.is_pinned())
    stream.synchronize()
    return made


def tensor_views(host: Any, description: dict[str, Any]) -> dict[str, Any]:
    """The handed-over tensors as views of ``host`` (a copy of the buffer), by name."""
    tensors = [HandoverTensor(**t) for t in description["tensors"]]
    return {t.name: _view(host, t) for t in tensors}


def cuda_device_index(uuid: str) -> int:
    """This process's number for the GPU with ``uuid`` (as torch prints it)."""
    import torch

    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise HandoverUnavailableError(f"GPU {uuid} is not visible to the engine")


def cuda_device_uuid(device: Any) -> str | None:
    """The UUID of a worker's device, None for a CPU worker."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


class HandedOverFile:
    """What vLLM's loader uses of ``safetensors.safe_open``, answered from
    handed-over tensors (as :class:`.adapter_file.OneBufferFile` answers from one read)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = tensors

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def get_tensor(self, name: str) -> Any:
        return self._tensors[name]

    def metadata(self) -> dict[str, str] | None:
        return {"format": "pt"}

    def __enter__(self) -> HandedOverFile:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _view(host: Any, tensor: HandoverTensor) -> Any:
    import torch

    flat = host[tensor.offset : tensor.end]
    return flat.view(getattr(torch, tensor.dtype)).view(tensor.shape)


def open_and_wait(buffer: dict[str, Any], index: int) -> Any:
    """:func:`open_cuda_ipc`, then the current stream waits for the trainer's event."""
    shared = open_cuda_ipc(buffer, index)
    wait_for_trainer(buffer, index)
    return shared


def open_cuda_ipc(buffer: dict[str, Any], index: int) -> Any:
    """The trainer's buffer as a ``uint8`` CUDA tensor of this process: what
    torch's own ``rebuild_cuda_tensor`` does with the pieces a CUDA tensor
    is pickled into, from checked fields instead of a pickle.

    Torch finds a share this process holds open already by its handle, and
    then waits for no event: the event is left to :func:`wait_for_trainer`,
    for an opened share and a found one alike.
    """
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (int(buffer["nbytes"]),),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        index,
        base64.b64decode(buffer["handle"]),
        int(buffer["storage_size_bytes"]),
        int(buffer["storage_offset_bytes"]),
        False,
        base64.b64decode(buffer["ref_counter_handle"]),
        int(buffer["ref_counter_offset"]),
        # no event (torch's ``_new_shared_cuda`` takes bytes even then: None
        # raised a TypeError on the H100, a080703)
        b"",
        False,
    )


def wait_for_trainer(buffer: dict[str, Any], index: int) -> None:
    """Make the current CUDA stream wait for the trainer's event, if it sent
    one (recorded on its stream when it made the share)."""
    event = buffer.get("event_handle")
    if not event or not buffer.get("event_sync_required"):
        return
    import torch

    torch.cuda.Event.from_ipc_handle(index, base64.b64decode(event)).wait()
