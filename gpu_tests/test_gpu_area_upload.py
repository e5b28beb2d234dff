"""A streamed push's receive area, copied to the GPU as its bytes land.

The area is a ``/dev/shm`` file handed to the worker open, as the push
stream hands it (:mod:`skyrl_lora.server.http.receive_area`). The first
push into it is read the host way and the area registered for DMA after
it; the next push's bytes, written slice by slice behind an arrival marker,
go straight into GPU memory (:mod:`skyrl_lora.server.transfer.area_upload`).
Its model, built on the GPU from the layout's template, must equal vLLM's
own build of the file, and its snapshot (copied to the host after the swap)
the file, byte for byte. No server; seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save

from skyrl_lora.server.adapters import adapter_file, snapshot_writer
from skyrl_lora.server.adapters.arrival import ArrivalWriter, take_followed
from skyrl_lora.server.loading.staged_buffer import BufferSource
from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.handover_template import HandoverTemplates
from skyrl_lora.server.transfer.tensor_pickle import host_buffers
from tests.test_handover_template import CONFIG, adapter_tensors, flat, vllm_build


@dataclass(frozen=True)
class _Request:
    lora_int_id: int
    lora_path: str


def _version(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / handover.CONFIG_FILE).write_text(json.dumps(CONFIG))
    return folder


def _push(area: Path, fd: int, data: bytes, piece: int) -> threading.Thread:
    """Write ``data`` into the area in pieces, the marker saying how far, as a push's lanes do."""
    writer = ArrivalWriter(area.parent, len(data))

    def write() -> None:
        try:
            for start in range(0, len(data), piece):
                time.sleep(0.002)
                os.pwrite(fd, data[start : start + piece], start)
                writer.ready(min(start + piece, len(data)))
            writer.complete()
        finally:
            writer.close()

    return threading.Thread(target=write)


def test_a_pushed_area_goes_up_as_it_lands_and_builds_what_vllm_builds(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(adapter_file, "FOLLOW_BYTES", 2048)
    templates = HandoverTemplates()
    source = BufferSource(host_buffers(True), "cuda:0", templates)
    assert source.areas is not None
    first_bytes = save(adapter_tensors(0))
    second_bytes = save(adapter_tensors(1))
    assert len(first_bytes) == len(second_bytes)  # one area serves both pushes
    shm = Path(tempfile.mkdtemp(prefix="skyrl-push-test-", dir="/dev/shm"))
    area = shm / handover.WEIGHTS_FILE
    fd = os.open(area, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(first_bytes))
        os.pwrite(fd, first_bytes, 0)
        first = source.take_file(_Request(1, str(_version(tmp_path, "a"))), fd)
        assert first is not None and not first.on_device  # not registered yet: the host way
        model, folded = vllm_build(first.description, first.model_buffer, lora_id=1)
        templates.learn(first.layout, model, first.model_buffer, folded)
        source.areas.settled()
        assert source.areas.registered() == 1
        with source.areas.borrowed(fd) as host:  # copied by DMA, not staged by the driver
            assert host is not None and host.is_pinned()

        folder = _version(tmp_path, "b")
        writing = _push(area, fd, second_bytes, piece=1500)
        writing.start()
        try:
            second = source.take_file(_Request(7, str(folder)), fd)
        finally:
            writing.join()
        followed = take_followed()
        assert followed is not None and followed.waited_ms > 0  # it followed the lanes
        assert second is not None and second.on_device and second.writes_snapshot
        template = templates.get(second.layout)
        assert template is not None
        expected, _ = vllm_build(
            second.description, second.snapshot_buffer.cpu().clone(), lora_id=7
        )
        built = template.instantiate(second.model_buffer, lora_model_id=7, device="cuda:0").model
        torch.cuda.synchronize()
        for name, weights in expected.loras.items():
            for got, want in zip(flat(built.loras[name]), flat(weights), strict=True):
                assert got.is_cuda, name
                assert torch.equal(got.cpu(), want), name
        snapshot = source.settle_on_host(built, template, second)  # after the swap
        snapshot_writer.write_snapshot_file(
            folder / handover.WEIGHTS_FILE, snapshot, second.snapshot_layout()
        )
        assert (folder / handover.WEIGHTS_FILE).read_bytes() == second_bytes
    finally:
        os.close(fd)
        shutil.rmtree(shm)
        source.areas.settled()
        source.areas.close()
    assert source.areas.registered() == 0  # the removed area was let go
