"""Receive areas mapped and registered for DMA, and copied up as their bytes
land (:mod:`skyrl_lora.server.transfer.area_upload`).

The registrations' bookkeeping runs here against a recording stand-in for
CUDA's ``cudaHostRegister``; the copy runs into host buffers, slice by
slice as an arriving file's writer says its bytes are there. The same copy
into GPU memory, from a registered area, is ``gpu_tests/test_gpu_area_upload.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from skyrl_lora.server.adapters import adapter_file  # noqa: E402
from skyrl_lora.server.adapters.adapter_file import opened_for_reading, slice_follower  # noqa: E402
from skyrl_lora.server.adapters.arrival import ArrivalFailed, ArrivalWriter, take_followed  # noqa: E402
from skyrl_lora.server.loading.staged_buffer import BufferSource, in_shared_memory  # noqa: E402
from skyrl_lora.server.transfer.area_upload import RegisteredAreas, copy_up  # noqa: E402
from skyrl_lora.server.transfer.tensor_pickle import host_buffers  # noqa: E402

_HOST = host_buffers(pin_memory=False)


class RecordingPinning:
    """Registers what it is asked to, or refuses with ``refuse`` (read-only
    mappings only, ``writable_only``); records both."""

    def __init__(self, refuse: str | None = None, writable_only: bool = False) -> None:
        self.refuse = refuse
        self.writable_only = writable_only
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.asked = 0

    def register(self, address: int, nbytes: int, read_only: bool) -> str | None:
        self.asked += 1
        if self.writable_only and read_only:
            return "read-only registration is not supported"
        if self.refuse is None:
            self.registered[address] = nbytes
        return self.refuse

    def unregister(self, address: int) -> None:
        assert address in self.registered
        del self.registered[address]
        self.unregistered.append(address)


@pytest.fixture
def area(tmp_path: Path) -> Iterator[Callable[[str, bytes], int]]:
    """``area(name, data)``: a file of ``data`` open as the API server hands
    an area over (closed after the test)."""
    opened: list[int] = []

    def make(name: str, data: bytes) -> int:
        (tmp_path / name).write_bytes(data)
        opened.append(os.open(tmp_path / name, os.O_RDWR))
        return opened[-1]

    yield make
    for fd in opened:
        os.close(fd)


def _look(areas: RegisteredAreas, *fds: int) -> None:
    """Borrow each area once, as a staging would, and let the area thread catch up."""
    for fd in fds:
        with areas.borrowed(fd):
            pass
    areas.settled()


@pytest.fixture
def pinning() -> RecordingPinning:
    return RecordingPinning()


@pytest.fixture
def areas(pinning: RecordingPinning) -> RegisteredAreas:
    made = RegisteredAreas(pinning, max_areas=2)
    yield made
    made.close()


Area = Callable[[str, bytes], int]


def test_an_area_is_registered_after_its_first_look_and_copied_from_after(
    area: Area, areas: RegisteredAreas, pinning: RecordingPinning
) -> None:
    data = bytes(range(256)) * 64
    fd = area("a", data)
    with areas.borrowed(fd) as host:
        assert host is None  # the first push reads it the host way
    areas.settled()
    assert list(pinning.registered.values()) == [len(data)]
    with areas.borrowed(fd) as host:
        assert host is not None and host.data_ptr() in pinning.registered
        assert bytes(host.numpy()) == data
    _look(areas, fd)
    assert pinning.asked == 1  # once only


def test_a_removed_area_is_unregistered_but_not_while_a_staging_copies_from_it(
    tmp_path: Path, area: Area, areas: RegisteredAreas, pinning: RecordingPinning
) -> None:
    first, second = (area(name, name.encode() * 1000) for name in "ab")
    _look(areas, first, second)
    assert areas.registered() == 2
    with areas.borrowed(first) as host:
        assert host is not None
        (tmp_path / "a").unlink()  # the API server closed it (a failed push)
        _look(areas, second)
        assert areas.registered() == 2 and not pinning.unregistered  # in use
        assert bytes(host[:3].numpy()) == b"aaa"
    _look(areas, second)  # the next look prunes it
    assert areas.registered() == 1 and len(pinning.unregistered) == 1


def test_the_least_recently_used_area_goes_beyond_the_cap(
    area: Area, areas: RegisteredAreas, pinning: RecordingPinning
) -> None:
    a, b, c = (area(name, name.encode() * 100) for name in "abc")
    _look(areas, a, b)
    with areas.borrowed(a) as first:  # a used again: b is now the oldest
        assert first is not None
        kept = first.data_ptr()
    _look(areas, c)
    assert areas.registered() == 2 and len(pinning.unregistered) == 1
    assert kept in pinning.registered
    with areas.borrowed(b) as again:
        assert again is None  # registered again, later


@pytest.mark.parametrize(
    ("pinning", "asked", "registered"),
    [
        # refused either way: read the host way, and the driver not asked again
        (RecordingPinning(refuse="operation not supported"), 2, 0),
        # no read-only registration: mapped for writing too (nothing writes)
        (RecordingPinning(writable_only=True), 2, 1),
    ],
    ids=["refused", "writable_only"],
)
def test_what_the_driver_refuses(
    area: Area, pinning: RecordingPinning, asked: int, registered: int
) -> None:
    areas = RegisteredAreas(pinning)
    fd = area("a", b"y" * 4096)
    try:
        _look(areas, fd, fd, fd)
        with areas.borrowed(fd) as host:
            assert (host is not None) == bool(registered)
            assert host is None or bytes(host[:2].numpy()) == b"yy"
        assert pinning.asked == asked and areas.registered() == registered
    finally:
        areas.close()
    assert not pinning.registered  # closing let go of it


def _arriving(tmp_path: Path, data: bytes) -> tuple[Path, int, ArrivalWriter]:
    folder = tmp_path / "push"
    folder.mkdir()
    target = folder / "adapter_model.safetensors"
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, len(data))
    return target, fd, ArrivalWriter(folder, len(data))


def test_copy_up_follows_an_arriving_area_and_makes_two_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter_file, "FOLLOW_BYTES", 4096)
    header = b"0123456789"
    data = header + os.urandom(50_000)
    target, fd, writer = _arriving(tmp_path, data)
    area = torch.from_file(str(target), shared=True, size=len(data), dtype=torch.uint8)
    copied: list[float] = []
    finished: list[float] = []

    def write() -> None:
        for start in range(0, len(data), 10_000):
            time.sleep(0.01)
            os.pwrite(fd, data[start : start + 10_000], start)
            writer.ready(min(start + 10_000, len(data)))
        finished.append(time.monotonic())
        writer.complete()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        with opened_for_reading(str(target)) as (file, size):
            assert file.read(len(header)) == header and size == len(data)
            follow = slice_follower(file, size - len(header))
            assert follow is not None

            def timed(copy):  # type: ignore[no-untyped-def]
                def each(begin: int, end: int) -> None:
                    copied.append(time.monotonic())
                    copy(begin, end)

                return follow(each)

            model, as_read = copy_up(area, len(header), size - len(header), _HOST, follow=timed)
    finally:
        thread.join()
        os.close(fd)
        writer.close()
    assert bytes(as_read.numpy()) == bytes(model.numpy()) == data[len(header) :]
    assert model.data_ptr() != as_read.data_ptr()  # the model's copy is folded in place later
    assert len(copied) > 3 and copied[0] < finished[0]  # it followed the bytes
    followed = take_followed()
    assert followed is not None and followed.waited_ms > 0


def test_copy_up_of_a_failed_push_raises(tmp_path: Path) -> None:
    data = os.urandom(20_000)
    target, fd, writer = _arriving(tmp_path, data)
    area = torch.from_file(str(target), shared=True, size=len(data), dtype=torch.uint8)
    writer.ready(5_000)
    threading.Timer(0.05, writer.fail).start()
    try:
        with opened_for_reading(str(target)) as (file, size):
            with pytest.raises(ArrivalFailed):
                copy_up(area, 0, size, _HOST, follow=slice_follower(file, size))
    finally:
        os.close(fd)
        writer.close()


def test_a_whole_file_is_copied_at_once(tmp_path: Path) -> None:
    data = os.urandom(9_000)
    path = tmp_path / "whole"
    path.write_bytes(data)
    with opened_for_reading(str(path)) as (file, size):
        assert slice_follower(file, size) is None
    area = torch.from_file(str(path), shared=False, size=len(data), dtype=torch.uint8)
    model, as_read = copy_up(area, 1_000, 8_000, _HOST)
    assert bytes(model.numpy()) == bytes(as_read.numpy()) == data[1_000:]


def test_only_files_in_shared_memory_are_areas_and_a_cpu_worker_takes_none(
    tmp_path: Path,
) -> None:
    on_disk = tmp_path / "weights"
    on_disk.write_bytes(b"x")
    fd = os.open(on_disk, os.O_RDONLY)
    try:
        assert not in_shared_memory(f"/proc/self/fd/{fd}")
        source = BufferSource(_HOST, None, templates=None)  # type: ignore[arg-type]
        assert source.areas is None
        assert source.take_area(object(), fd) is None
    finally:
        os.close(fd)
    if Path("/dev/shm").is_dir():
        shm = Path("/dev/shm") / f"skyrl-test-{os.getpid()}"
        shm.write_bytes(b"x")
        try:
            fd = os.open(shm, os.O_RDONLY)
            try:
                assert in_shared_memory(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
        finally:
            shm.unlink()
