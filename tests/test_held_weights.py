"""A path load's weights file handed to the engine open, not copied first.

The registry opens the weights file by the snapshot's rules and leaves a
marker where its copy goes (``registry.snapshot_adapter_dir(held=...)``);
the stage channel carries the descriptor with its request line; the worker
reads the file once, builds from a copy of what it read and writes the
snapshot's weights file from the bytes as read, after the swap. A file the
worker cannot build from is copied into the snapshot before vLLM's loader
opens it. The real engine takes every path load this way in the engine
tests (``test_group_engine.py`` builds from templates; the session server's
reader process reads the snapshot the worker copied).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from skyrl_lora.errors import BadRequestError
from skyrl_lora.server.adapters import registry, snapshot_writer
from skyrl_lora.server.loading.stage_channel import StageChannel, StageListener, socket_path
from skyrl_lora.server.loading.staged_buffer import BufferSource
from skyrl_lora.server.loading.staging import _WorkerStaging
from skyrl_lora.server.loading.staging_status import READY
from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.handover_template import HandoverTemplates
from skyrl_lora.server.transfer.tensor_pickle import host_buffers
from tests.test_staging import _Manager, _Request, _wait

WEIGHTS = handover.WEIGHTS_FILE


def _adapter(folder: Path, dtype: torch.dtype = torch.bfloat16) -> bytes:
    folder.mkdir(parents=True)
    (folder / handover.CONFIG_FILE).write_text('{"r": 4, "lora_alpha": 8}')
    generator = torch.Generator().manual_seed(0)
    save_file(
        {
            f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight": torch.randn(
                4, 16, generator=generator
            ).to(dtype)
            for i in range(2)
            for ab in ("A", "B")
        },
        str(folder / WEIGHTS),
    )
    return (folder / WEIGHTS).read_bytes()


def _held_snapshot(source: Path, target: Path) -> int:
    held: dict[str, int] = {}
    registry.snapshot_adapter_dir(str(source), target, None, held)
    assert list(held) == [WEIGHTS]
    return held[WEIGHTS]


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_registry_holds_the_weights_file_open_and_marks_its_place(tmp_path: Path) -> None:
    data = _adapter(tmp_path / "src")
    target = tmp_path / "snap"
    fd = _held_snapshot(tmp_path / "src", target)
    try:
        assert sorted(p.name for p in target.iterdir()) == [
            handover.CONFIG_FILE,
            snapshot_writer.PENDING_FILE,
        ]
        with pytest.raises(TimeoutError):
            snapshot_writer.wait_for_weights(target, timeout_s=0.05)  # not written yet
        (tmp_path / "new").write_bytes(b"a new file put in its place after the check")
        os.replace(tmp_path / "new", tmp_path / "src" / WEIGHTS)
        snapshot_writer.write_weights_from(fd, target, WEIGHTS)
    finally:
        os.close(fd)
    snapshot_writer.wait_for_weights(target, timeout_s=1)
    assert (target / WEIGHTS).read_bytes() == data  # the file that was checked
    assert sorted(p.name for p in target.iterdir()) == [handover.CONFIG_FILE, WEIGHTS]


def test_a_held_snapshot_that_fails_leaves_no_folder_and_no_open_file(tmp_path: Path) -> None:
    _adapter(tmp_path / "src")
    (tmp_path / "src" / handover.CONFIG_FILE).unlink()
    before = _open_fds()
    held: dict[str, int] = {}
    with pytest.raises(BadRequestError, match=r"has no adapter_config\.json"):
        registry.snapshot_adapter_dir(str(tmp_path / "src"), tmp_path / "snap", None, held)
    assert held == {} and _open_fds() == before
    assert not (tmp_path / "snap").exists()


def test_a_weights_link_out_of_the_roots_is_refused_when_held_too(tmp_path: Path) -> None:
    _adapter(tmp_path / "outside")
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "root" / "a" / handover.CONFIG_FILE).write_text("{}")
    (tmp_path / "root" / "a" / WEIGHTS).symlink_to(tmp_path / "outside" / WEIGHTS)
    with pytest.raises(BadRequestError, match="outside the allowed adapter roots"):
        registry.snapshot_adapter_dir(
            str(tmp_path / "root" / "a"), tmp_path / "snap", [tmp_path / "root"], {}
        )


def test_the_channel_hands_each_line_its_own_descriptors(tmp_path: Path) -> None:
    got: list[tuple[int, bytes | None]] = []
    arrived = threading.Event()

    def handle(message: dict[str, Any], fds: list[int]) -> None:
        content = None
        for fd in fds:
            content = os.pread(fd, 100, 0)
            os.close(fd)
        got.append((message["request"]["lora_int_id"], content))
        arrived.set()

    listener = StageListener(socket_path(tmp_path, "w0"), handle)
    channel = StageChannel([listener.path])
    (tmp_path / "f").write_bytes(b"weights")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert channel.send({"request": {"lora_int_id": 1}})
        assert channel.send({"request": {"lora_int_id": 2}}, (fd,))
        assert channel.send({"request": {"lora_int_id": 3}})
    finally:
        os.close(fd)  # the worker has its own copy
    deadline = time.monotonic() + 5
    while len(got) < 3:
        assert time.monotonic() < deadline, got
        arrived.wait(0.1)
    assert got == [(1, None), (2, b"weights"), (3, None)]
    channel.close()
    listener.close()


def test_a_held_file_is_built_from_a_copy_and_written_as_read(tmp_path: Path) -> None:
    data = _adapter(tmp_path / "src")
    target = tmp_path / "snap"
    fd = _held_snapshot(tmp_path / "src", target)
    source = BufferSource(host_buffers(False), None, HandoverTemplates())
    try:
        taken = source.take_file(_Request(7, str(target)), fd)
    finally:
        os.close(fd)
    assert taken is not None and taken.writes_snapshot and not taken.is_handover
    taken.model_buffer.fill_(0)  # what a scaling fold does to the model's copy
    snapshot_writer.write_snapshot_file(
        target / WEIGHTS, taken.snapshot_buffer, taken.snapshot_layout()
    )
    assert (target / WEIGHTS).read_bytes() == data


def test_the_next_held_file_is_read_into_the_last_ones_snapshot_copy(tmp_path: Path) -> None:
    """The snapshot's copy of a file comes from the pool (:mod:`.host_pool`):
    once its snapshot is written and dropped, the next reload reads into the
    same block instead of allocating (pinned, on a GPU worker) again; the
    model's copy is a fresh allocation each time, as vLLM keeps it."""
    data = _adapter(tmp_path / "src")
    source = BufferSource(host_buffers(False), None, HandoverTemplates())
    pointers = []
    for number in range(2):
        target = tmp_path / f"snap{number}"
        fd = _held_snapshot(tmp_path / "src", target)
        try:
            taken = source.take_file(_Request(7 + number, str(target)), fd)
        finally:
            os.close(fd)
        assert taken is not None and taken.alloc_ms >= 0
        pointers.append(taken.snapshot_buffer.data_ptr())
        snapshot_writer.write_snapshot_file(
            target / WEIGHTS, taken.snapshot_buffer, taken.snapshot_layout()
        )
        assert (target / WEIGHTS).read_bytes() == data
        del taken
    assert pointers[0] == pointers[1]
    assert (source.snapshot_buffers.allocated, source.snapshot_buffers.reused) == (1, 1)


def test_a_file_a_hand_over_cannot_carry_is_copied_before_vllm_reads_it(tmp_path: Path) -> None:
    data = _adapter(tmp_path / "src", dtype=torch.float64)  # no hand-over dtype
    target = tmp_path / "snap"
    fd = _held_snapshot(tmp_path / "src", target)
    source = BufferSource(host_buffers(False), None, HandoverTemplates())
    try:
        assert source.take_file(_Request(7, str(target)), fd) is None
    finally:
        os.close(fd)
    assert (target / WEIGHTS).read_bytes() == data
    snapshot_writer.wait_for_weights(target, timeout_s=0.1)  # the marker is gone


def test_a_worker_writes_the_snapshot_of_a_held_file_after_staging_it(tmp_path: Path) -> None:
    """The worker's whole path with vLLM's loader stood in: the file comes
    over the channel, is read and staged, and the snapshot's weights file
    appears with the bytes as read; the descriptor is not kept."""
    data = _adapter(tmp_path / "src")
    target = tmp_path / "snap"
    fd = _held_snapshot(tmp_path / "src", target)
    manager = _Manager()
    staging = _WorkerStaging(manager)
    before = _open_fds()
    staging._take_request(
        {"request": {"lora_int_id": 9, "lora_name": "a@v1", "lora_path": str(target)}},
        [os.dup(fd)],
    )
    os.close(fd)
    assert _wait(staging, 9) == READY
    staging._snapshots.wait(target)
    snapshot_writer.wait_for_weights(target, timeout_s=5)
    assert (target / WEIGHTS).read_bytes() == data
    assert manager.loads == [9]
    assert _open_fds() <= before


def test_a_discarded_staging_closes_the_file_it_held(tmp_path: Path) -> None:
    _adapter(tmp_path / "src")
    fd = _held_snapshot(tmp_path / "src", tmp_path / "snap")
    manager = _Manager()
    manager.gate.clear()  # the staging thread waits in the loader
    staging = _WorkerStaging(manager)
    staging._submit(_Request(1))  # occupies the staging thread
    staging._hold_file(2, fd)
    staging.discard(2)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    manager.gate.set()
    assert _wait(staging, 1) == READY


def test_a_held_file_built_from_its_template_equals_vllms_build_and_the_snapshot_the_file(
    tmp_path: Path,
) -> None:
    """On a CPU worker (and with ``--no-gpu-staging``) the model is built in
    host memory from a copy of the bytes as read: its scalings are folded
    into that copy, and the snapshot is still the file. The GPU twin is
    ``gpu_tests/test_gpu_held_file.py``."""
    import json

    from safetensors.torch import save_file

    from tests.test_handover_template import CONFIG, adapter_tensors, flat, vllm_build

    templates = HandoverTemplates()
    source = BufferSource(host_buffers(False), None, templates)
    taken = []
    for seed, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / handover.CONFIG_FILE).write_text(json.dumps(CONFIG))
        save_file(adapter_tensors(seed), str(tmp_path / name / WEIGHTS))
        fd = _held_snapshot(tmp_path / name, tmp_path / f"snap-{name}")
        try:
            got = source.take_file(_Request(seed + 1, str(tmp_path / f"snap-{name}")), fd)
        finally:
            os.close(fd)
        assert got is not None and not got.on_device
        taken.append(got)
        if seed == 0:
            model, folded = vllm_build(got.description, got.model_buffer, lora_id=1)
            templates.learn(got.layout, model, got.model_buffer, folded)
    second = taken[1]
    template = templates.get(second.layout)
    assert template is not None
    expected, _ = vllm_build(second.description, second.snapshot_buffer.clone(), lora_id=2)
    built = template.instantiate(second.model_buffer, lora_model_id=2, device=None).model
    for name, weights in expected.loras.items():
        for got_tensor, want in zip(flat(built.loras[name]), flat(weights), strict=True):
            assert torch.equal(got_tensor, want), name
    for name, got in zip(("a", "b"), taken, strict=True):
        path = tmp_path / f"snap-{name}" / WEIGHTS
        snapshot_writer.write_snapshot_file(path, got.snapshot_buffer, got.snapshot_layout())
        assert path.read_bytes() == (tmp_path / name / WEIGHTS).read_bytes()


def test_a_request_the_worker_cannot_take_still_closes_its_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"weights")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    staging = _WorkerStaging(_Manager())
    with pytest.raises(TypeError):
        staging._take_request({"request": {"not_a_field": 1}}, [fd])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed, not leaked
