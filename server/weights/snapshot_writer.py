"""Write a handed-over adapter's snapshot file after its swap, not during it.

Every loaded version keeps an immutable snapshot folder: vLLM reads it again
if it evicts the version from its CPU cache, and a replica that restarts is
given its files (:func:`skyrl_lora.server.cluster.replay.snapshot_files`).
A hand-over brings no file, so the engine writes one. Written by
safetensors on the staging thread, that took 18-22 ms of a rank-16 swap on
an H100, with the GIL held while safetensors laid the file out, and an
8B model's rank-64 adapter is 17 times the bytes.

Here the file is laid out from the hand-over's description (a header, then
each tensor's bytes: the buffer's alignment gaps are left out, as the format
requires) and written with ``os.writev`` (a few system calls for the whole
adapter, the GIL released in each) on a thread of its own, after the swap.
Until it is in place the folder still holds its ``handover.json``: whoever
needs the file waits for that to go (:meth:`SnapshotWriter.wait` in the
engine process, :func:`.handover.wait_for_weights` elsewhere).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skyrl_lora.types import HANDOVER_ITEM_BYTES

from ..observability import log_engine_event

logger = logging.getLogger("vllm.skyrl_lora.snapshot_writer")

#: safetensors' names of the dtypes a hand-over carries.
SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def safetensors_layout(tensors: list[dict[str, Any]]) -> tuple[bytes, list[tuple[int, int]]]:
    """The file's head (length and JSON header) and, per tensor in file
    order, the byte span of the buffer it is copied from."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    spans = []
    position = 0
    for tensor in tensors:
        nbytes = HANDOVER_ITEM_BYTES[tensor["dtype"]] * math.prod(tensor["shape"])
        header[tensor["name"]] = {
            "dtype": SAFETENSORS_DTYPES[tensor["dtype"]],
            "shape": list(tensor["shape"]),
            "data_offsets": [position, position + nbytes],
        }
        spans.append((tensor["offset"], tensor["offset"] + nbytes))
        position += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned
    return struct.pack("<Q", len(text)) + text, spans


def write_safetensors(path: Path, buffer: Any, tensors: list[dict[str, Any]]) -> None:
    """Write the tensors described by ``tensors`` (hand-over entries) from
    ``buffer`` (a uint8 host tensor) as a safetensors file, in place at once."""
    head, spans = safetensors_layout(tensors)
    view = memoryview(buffer.numpy()).cast("B")
    chunks: list[Any] = [head, *(view[start:end] for start, end in spans)]
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, chunks)
    finally:
        os.close(fd)
    os.replace(partial, path)


def _write_all(fd: int, chunks: list[Any]) -> None:
    """``os.writev`` until every chunk is written (a call may write less, or
    take at most ``IOV_MAX`` chunks)."""
    most = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    while chunks:
        written = os.writev(fd, chunks[:most])
        while chunks and written >= len(chunks[0]):
            written -= len(chunks[0])
            chunks.pop(0)
        if written:
            chunks[0] = memoryview(chunks[0])[written:]


class SnapshotWriter:
    """One thread that writes hand-overs' snapshot files, one after another."""

    def __init__(self, weights_file: str, handover_file: str) -> None:
        self._weights_file = weights_file
        self._handover_file = handover_file
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="skyrl-lora-snapshot"
        )
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[None]] = {}

    def submit(
        self, folder: Path, buffer: Any | Callable[[], Any], tensors: list[dict[str, Any]]
    ) -> None:
        """Write ``folder``'s weights file from ``buffer`` (kept until written),
        then remove its hand-over description.

        ``buffer`` may be a function that returns it, run on the writer's
        thread first: a hand-over staged on the GPU copies its host buffers
        there, after the swap (:mod:`.staging`), and whoever waits for the
        file waits for that too.
        """
        key = str(folder)
        future = self._pool.submit(self._write, folder, buffer, tensors)
        with self._lock:
            self._pending[key] = future
        future.add_done_callback(lambda done: self._forget(key, done))

    def wait(self, folder: str | Path) -> None:
        """Return once ``folder``'s file is written (at once if none is pending)."""
        with self._lock:
            future = self._pending.get(str(folder))
        if future is not None:
            concurrent.futures.wait([future])

    def _forget(self, key: str, done: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._pending.get(key) is done:
                del self._pending[key]

    def _write(
        self, folder: Path, buffer: Any | Callable[[], Any], tensors: list[dict[str, Any]]
    ) -> None:
        started = time.perf_counter()
        if callable(buffer):
            buffer = buffer()
        try:
            write_safetensors(folder / self._weights_file, buffer, tensors)
            (folder / self._handover_file).unlink(missing_ok=True)
        except FileNotFoundError:
            if folder.exists():
                raise
            return  # the version was retired and its folder removed first
        except Exception:
            logger.exception("skyrl-lora could not write the snapshot of %s", folder)
            raise
        log_engine_event(
            "snapshot_written",
            folder=folder.name,
            bytes=buffer.numel(),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
