"""A weights file read while it arrives (:mod:`skyrl_lora.server.adapters.arrival`):
the worker's one-buffer read follows the writer's marker, never reads bytes
not yet written, and gives up when the push fails."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

from skyrl_lora.server.adapters import adapter_file  # noqa: E402
from skyrl_lora.server.adapters.adapter_file import OneBufferFile  # noqa: E402
from skyrl_lora.server.adapters.arrival import (  # noqa: E402
    MARKER,
    Arrival,
    ArrivalFailed,
    ArrivalWriter,
    take_followed,
    wait_whole,
)
from skyrl_lora.server.transfer import tensor_pickle  # noqa: E402

_HOST = tensor_pickle.host_buffers(pin_memory=False)
PIECE = 10_000


def _adapter_bytes(tmp_path: Path) -> tuple[bytes, dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"layer{i}.lora_{ab}.weight": torch.randn(16, 64, generator=generator)
        for i in range(4)
        for ab in "AB"
    }
    source = tmp_path / "source.safetensors"
    save_file(tensors, str(source))
    return source.read_bytes(), tensors


def _arriving(tmp_path: Path, total: int) -> tuple[Path, int, ArrivalWriter]:
    folder = tmp_path / "adapter"
    folder.mkdir()
    target = folder / "adapter_model.safetensors"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    return target, fd, ArrivalWriter(folder, total)


def test_a_file_still_arriving_is_read_as_its_bytes_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, tensors = _adapter_bytes(tmp_path)
    target, fd, writer = _arriving(tmp_path, len(data))
    monkeypatch.setattr(adapter_file, "FOLLOW_BYTES", 4096)
    reads: list[float] = []
    preadv = os.preadv

    def timed_preadv(*args: Any) -> int:
        reads.append(time.monotonic())
        return preadv(*args)

    monkeypatch.setattr(os, "preadv", timed_preadv)
    finished: list[float] = []

    def write() -> None:
        for start in range(0, len(data), PIECE):
            time.sleep(0.01)
            os.pwrite(fd, data[start : start + PIECE], start)
            writer.ready(min(start + PIECE, len(data)))
        finished.append(time.monotonic())
        writer.complete()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        with OneBufferFile(str(target), _HOST) as ours:
            for name, tensor in tensors.items():
                assert torch.equal(ours.get_tensor(name), tensor), name
    finally:
        thread.join()
        os.close(fd)
        writer.close()
    # It read slices while the writer still wrote: it followed, it did not wait for the end.
    assert len(reads) > 3 and reads[0] < finished[0]
    followed = take_followed()  # and said how long it waited for the bytes
    assert followed is not None and followed.waited_ms > 0 and take_followed() is None


def test_a_push_that_fails_fails_the_read_and_nothing_reads_it_after(tmp_path: Path) -> None:
    data, _ = _adapter_bytes(tmp_path)
    target, fd, writer = _arriving(tmp_path, len(data))
    os.pwrite(fd, data[:PIECE], 0)
    writer.ready(PIECE)
    threading.Timer(0.05, writer.fail).start()
    try:
        with pytest.raises(ArrivalFailed):
            OneBufferFile(str(target), _HOST)
        with pytest.raises(ArrivalFailed):  # the fallback readers wait for the whole file
            wait_whole(target.parent)
    finally:
        os.close(fd)
        writer.close()


def test_a_whole_file_is_not_waited_for_and_a_stalled_one_times_out(tmp_path: Path) -> None:
    data, tensors = _adapter_bytes(tmp_path)
    wait_whole(tmp_path)  # no marker: whole
    target, fd, writer = _arriving(tmp_path, len(data))
    try:
        with Arrival(target.parent / MARKER, timeout_s=0.05) as arrival:
            assert arrival.total_bytes == len(data)
            with pytest.raises(ArrivalFailed, match=f"0 of the {len(data)} bytes"):
                arrival.wait_whole()
            os.pwrite(fd, data, 0)
            writer.ready(len(data))
            with pytest.raises(ArrivalFailed):  # written, but its digest not yet checked
                arrival.wait_whole()
            writer.complete()
            arrival.wait_whole()
        with OneBufferFile(str(target), _HOST) as ours:
            assert all(torch.equal(ours.get_tensor(n), t) for n, t in tensors.items())
    finally:
        os.close(fd)
        writer.close()


def test_a_descriptor_is_followed_and_copied_only_once_whole(tmp_path: Path) -> None:
    """The engine is handed a push's receive area open: ``/proc/self/fd/N``
    finds the marker beside the file, and the snapshot's copy waits for it."""
    from skyrl_lora.server.adapters.snapshot_writer import PENDING_FILE, write_weights_from

    data, _ = _adapter_bytes(tmp_path)
    target, fd, writer = _arriving(tmp_path, len(data))
    held = os.open(target, os.O_RDONLY)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / PENDING_FILE).touch()

    def write() -> None:
        for start in range(0, len(data), PIECE):
            time.sleep(0.01)
            os.pwrite(fd, data[start : start + PIECE], start)
            writer.ready(min(start + PIECE, len(data)))
        writer.complete()

    thread = threading.Thread(target=write)
    try:
        arrival = Arrival.beside(f"/proc/self/fd/{held}")
        assert arrival is not None and arrival.total_bytes == len(data)
        arrival.close()
        thread.start()
        write_weights_from(held, snapshot, "adapter_model.safetensors")
        assert (snapshot / "adapter_model.safetensors").read_bytes() == data
        assert not (snapshot / PENDING_FILE).exists()
    finally:
        thread.join()
        for opened in (fd, held):
            os.close(opened)
        writer.close()
