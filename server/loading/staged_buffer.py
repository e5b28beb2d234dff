"""A staging's bytes as one flat buffer: taken from a hand-over or a file,
on the host or the GPU, and moved to the host after the swap.

A hand-over (:mod:`.handover`) and an adapter file read in one call
(:mod:`.adapter_file`) are both one buffer whose layout (each tensor's
name, dtype, shape and offset) is known before a byte is read, so the
staging (:mod:`.staging`) builds either the same way: the first buffer of a
layout by vLLM's loader from views of it, every later one from the
layout's template (:mod:`.handover_template`).

On a GPU worker, a hand-over from GPU memory whose layout has a template is
copied device to device, so its model is built, folded and written into
its engine slot there. vLLM's CPU cache and the snapshot file need host
copies; :meth:`BufferSource.settle_on_host` makes them after the swap.
Copied to the host first, the rank-128 adapter of the 8B model spent 44 of
its 100 ms of staging in two device-to-host copies and 17 ms copying back
into the slot (H100, 08cfe58).

A file is built in host memory, as vLLM builds it: it is read into host
memory whatever happens next. Built on the GPU (copied up after its read,
moved back after the swap), path reloads at 8 tenants of the 8B model
stretched the other tenants' longest gap between two tokens during swaps
to 186 ms p99, against 98 ms built on the host and 54-58 ms without swaps
(H100, cc51ce4, one run of each); the swapping tenant's reload gained
little, since the bytes cross to the GPU either way.

The exception is a streamed push's receive area, once registered for DMA
(:mod:`.area_upload`), of a layout with a template: its bytes go to the
GPU as they land, with no copy on the host at all, and its model is built
there as a GPU hand-over's is.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..adapters.adapter_file import (
    PARSED_HEADERS,
    FileHeader,
    OneBufferFile,
    UnsupportedFile,
    opened_for_reading,
    slice_follower,
)
from ..adapters.cuda_streams import AFTER_SWAP, side_stream
from ..adapters.registry import adapter_of
from ..adapters.snapshot_writer import (
    SnapshotLayout,
    file_layout,
    safetensors_layout,
    write_weights_from,
)
from ..telemetry.observability import log_engine_event
from ..transfer import handover
from ..transfer.area_upload import CudaPinning, RegisteredAreas, copy_up
from ..transfer.handover_template import HandoverTemplate, HandoverTemplates, layout_key
from ..transfer.host_pool import HostBufferPool
from ..transfer.open_shares import OpenShares


@dataclass(frozen=True)
class TakenBuffer:
    """A staging's bytes: the model's copy, the copy its snapshot's weights
    file is written from after the swap, and what its build depends on."""

    folder: Path
    description: dict[str, Any]
    model_buffer: Any
    #: None where the snapshot's weights file is there already (a file the
    #: registry copied): nothing to write.
    snapshot_buffer: Any
    layout: str
    is_handover: bool = False
    #: A file's first bytes (its header), written before its data as read.
    file_head: bytes = b""
    #: Time spent allocating its host buffers (pinned ones cost a driver call).
    alloc_ms: float = 0.0
    #: A CUDA hand-over's copy out, in parts (:func:`.handover.copy_out`'s ``times``).
    copy_parts: dict[str, float] = field(default_factory=dict)

    @property
    def on_device(self) -> bool:
        return bool(self.model_buffer.is_cuda)

    @property
    def writes_snapshot(self) -> bool:
        return self.snapshot_buffer is not None

    def snapshot_layout(self) -> SnapshotLayout:
        """What the snapshot's weights file holds of :attr:`snapshot_buffer`:
        a hand-over's tensors as safetensors, or a file as it was."""
        if self.is_handover:
            return safetensors_layout(self.description["tensors"])
        return file_layout(self.file_head, int(self.snapshot_buffer.numel()))


class BufferSource:
    """One worker's way to its stagings' buffers: host memory (pinned where
    vLLM pins), and its GPU's memory where it has one."""

    def __init__(
        self,
        host_buffers: Callable[[int], Any],
        device: Any,
        templates: HandoverTemplates,
        shares: OpenShares | None = None,
    ) -> None:
        self._host_buffers = self._timed(host_buffers)
        #: The trainers' CUDA shares, kept open between hand-overs (:mod:`.open_shares`).
        self.shares = OpenShares(0) if shares is None else shares
        self._device = device
        self._device_buffers = device_buffers(device)
        #: Push receive areas registered for DMA (:mod:`.area_upload`), on a GPU worker.
        self.areas = (
            RegisteredAreas(CudaPinning(device)) if self._device_buffers is not None else None
        )
        self._templates = templates
        #: Snapshots' copies, which no GPU copy reads: kept and reused (:mod:`.host_pool`).
        self.snapshot_buffers = HostBufferPool(host_buffers)
        self._snapshot_buffers = self._timed(self.snapshot_buffers.take)
        #: Per thread, seconds spent allocating host buffers since the last
        #: take (the snapshot writer's thread allocates too, after a swap).
        self._alloc_clock = threading.local()

    def _timed(self, allocate: Callable[[int], Any]) -> Callable[[int], Any]:
        def timed(nbytes: int) -> Any:
            started = time.perf_counter()
            try:
                return allocate(nbytes)
            finally:
                clock = self._alloc_clock
                clock.spent_s = getattr(clock, "spent_s", 0.0) + time.perf_counter() - started

        return timed

    def _alloc_ms(self) -> float:
        """This thread's allocation time since its last call, in ms."""
        spent = getattr(self._alloc_clock, "spent_s", 0.0)
        self._alloc_clock.spent_s = 0.0
        return round(spent * 1000, 2)

    @property
    def on_gpu(self) -> bool:
        """Whether GPU hand-overs of a known layout are taken into GPU memory
        (a GPU worker, not turned off); files always stay on the host."""
        return self._device_buffers is not None

    def take_handover(self, lora_request: Any) -> TakenBuffer | None:
        """A hand-over's buffer, copied out of the trainer's memory twice (the
        model's copy and the snapshot's); None for an adapter of files.

        From GPU memory to a GPU worker, a layout with a template is copied
        device to device.
        """
        folder = Path(lora_request.lora_path)
        description = handover.take_handover(folder)
        if description is None:
            return None
        config = (folder / handover.CONFIG_FILE).read_text()
        layout = layout_key(description, config, request_extra(lora_request))
        on_device = (
            description["buffer"]["kind"] == "cuda_ipc"
            and self._device_buffers is not None
            and self._templates.get(layout) is not None
        )
        allocate = self._device_buffers if on_device else self._host_buffers
        assert allocate is not None
        self._alloc_ms()
        parts: dict[str, float] = {}
        model_buffer, snapshot_buffer = handover.copy_out(
            description,
            allocate,
            handover.cuda_device_index,
            copies=2,
            times=parts,
            open_share=functools.partial(
                self.shares.open, adapter_of(lora_request.lora_name), lora_request.lora_int_id
            ),
        )
        return TakenBuffer(
            folder,
            description,
            model_buffer,
            snapshot_buffer,
            layout,
            is_handover=True,
            alloc_ms=self._alloc_ms(),
            copy_parts=parts,
        )

    def take_file(self, lora_request: Any, weights_fd: int | None = None) -> TakenBuffer | None:
        """An adapter file read into one host buffer, to be built like a
        hand-over; None for a file that reader leaves to safetensors (vLLM's
        loader then reads it).

        ``weights_fd``: the weights file, opened by the API server in place
        of the snapshot's copy (:func:`.registry.snapshot_adapter_dir`). It is
        opened again through ``/proc/self/fd`` (an offset of this reader's
        own: each worker of the engine reads it), and the snapshot's copy is
        written from the data as read, after the swap; the model is built
        from a copy of it, since the build folds scalings in place.

        Through vLLM's loader the rank-64 adapter of the 8B model took 241 ms
        to load by path on an idle H100 (08cfe58).
        """
        folder = Path(lora_request.lora_path)
        weights = folder / handover.WEIGHTS_FILE
        if weights_fd is not None:
            weights = Path(f"/proc/self/fd/{weights_fd}")
            uploaded = self.take_area(lora_request, weights_fd)
            if uploaded is not None:
                return uploaded
        # Held open, the file is read into the snapshot's copy, which no GPU
        # copy reads: a pooled buffer; the model is built from a copy of it.
        read_into = self._host_buffers if weights_fd is None else self._snapshot_buffers
        self._alloc_ms()
        try:
            config = (folder / handover.CONFIG_FILE).read_text()
            opened: OneBufferFile | None = OneBufferFile(str(weights), read_into)
        except (OSError, UnsupportedFile):
            opened = None
        description = None if opened is None else opened.layout()
        if opened is None or description is None:
            if weights_fd is not None:  # vLLM's loader reads the snapshot: write it first
                write_weights_from(weights_fd, folder, handover.WEIGHTS_FILE)
            return None
        layout = file_layout_key(opened.header, config, request_extra(lora_request))
        as_read = opened.buffer
        if weights_fd is None:
            return TakenBuffer(
                folder, description, as_read, None, layout, alloc_ms=self._alloc_ms()
            )
        model_buffer = self._host_buffers(as_read.numel())
        model_buffer.copy_(as_read)
        return TakenBuffer(
            folder,
            description,
            model_buffer,
            as_read,
            layout,
            file_head=opened.head,
            alloc_ms=self._alloc_ms(),
        )

    def take_area(self, lora_request: Any, weights_fd: int) -> TakenBuffer | None:
        """A streamed push's receive area, copied to the GPU as its bytes land
        (:mod:`.area_upload`); None where it goes the host way: off a GPU, a
        file that is no area in shared memory, an area not registered yet,
        or a layout with no template."""
        weights = f"/proc/self/fd/{weights_fd}"
        if self.areas is None or not in_shared_memory(weights):
            return None
        folder = Path(lora_request.lora_path)
        with self.areas.borrowed(weights_fd) as host:
            if host is None:
                return None
            config = (folder / handover.CONFIG_FILE).read_text()
            with opened_for_reading(weights) as (file, size):
                try:
                    header = FileHeader.read(weights, file, size)
                except UnsupportedFile:
                    return None
                description = header.layout()
                if description is None or len(header.head) + header.data_bytes > host.numel():
                    return None
                layout = file_layout_key(header, config, request_extra(lora_request))
                if not self._templates.known(layout):
                    return None
                assert self._device_buffers is not None
                model_buffer, as_read = copy_up(
                    host,
                    len(header.head),
                    header.data_bytes,
                    self._device_buffers,
                    side_stream(self._device),
                    slice_follower(file, header.data_bytes),
                )
        return TakenBuffer(
            folder, description, model_buffer, as_read, layout, file_head=header.head
        )

    def settle_on_host(self, model: Any, template: HandoverTemplate, taken: TakenBuffer) -> Any:
        """After the swap of a hand-over staged on the GPU: copy its model
        and its snapshot's buffer to the host, point the model at its host
        copy, and let the GPU copies go; returns the snapshot's host copy.

        The copies run on a stream of their own (:data:`.cuda_streams.AFTER_SWAP`):
        the next swap's copies do not queue behind them. The step loop may
        have read the model's GPU tensors meanwhile (an install with no slot
        written copies from them on the engine's stream), so the device is
        synchronized before the GPU memory goes back to torch's allocator.
        """
        started = time.perf_counter()
        nbytes = taken.model_buffer.numel()
        host_model = self._host_buffers(nbytes)
        host_snapshot = self.snapshot_buffers.take(nbytes)
        device = taken.model_buffer.device
        stream = side_stream(device, AFTER_SWAP)
        with torch.cuda.stream(stream):
            host_model.copy_(taken.model_buffer, non_blocking=host_model.is_pinned())
            host_snapshot.copy_(taken.snapshot_buffer, non_blocking=host_snapshot.is_pinned())
        stream.synchronize()
        template.repoint(model, host_model)
        torch.cuda.synchronize(device)
        log_engine_event(
            "handover_settled",
            folder=taken.folder.name,
            bytes=nbytes,
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        return host_snapshot


def in_shared_memory(path: str) -> bool:
    """Whether ``path`` (a link followed) is a file in ``/dev/shm``, where
    receive areas live: a file on disk is never mapped and pinned."""
    return os.path.realpath(path).startswith(f"{handover.SHM_DIR}/")


def request_extra(lora_request: Any) -> tuple[Any, ...]:
    """What a request adds to its model's build besides the files."""
    return (
        getattr(lora_request, "is_3d_lora_weight", None),
        getattr(lora_request, "tensorizer_config_dict", None),
    )


def file_layout_key(header: FileHeader, config: str, extra: tuple[Any, ...]) -> str:
    """:func:`.handover_template.layout_key` of a file's header (one with a
    layout), worked out once per header, config and extra: the key is a
    JSON dump and a digest of every tensor's place, GIL-held Python on the
    staging thread (see :class:`.adapter_file.FileHeader`)."""
    try:
        hash(extra)
    except TypeError:  # a tensorizer config's dict: keyed each time
        return _layout_key_of(header, config, extra)
    return _file_layout_key(header, config, extra)


def _layout_key_of(header: FileHeader, config: str, extra: tuple[Any, ...]) -> str:
    description = header.layout()
    assert description is not None, "a file with no layout has no layout key"
    return layout_key(description, config, extra)


_file_layout_key = functools.lru_cache(maxsize=PARSED_HEADERS)(_layout_key_of)


def device_buffers(device: Any) -> Callable[[int], Any] | None:
    """An ``allocate(nbytes)`` of uint8 tensors on ``device``; None off a GPU."""
    if device is None or torch.device(device).type != "cuda":
        return None

    def allocate(nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    return allocate
