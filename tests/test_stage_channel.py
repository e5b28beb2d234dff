"""Stage requests beside the step loop (``skyrl_lora.server.loading.stage_channel``).

The socket itself, then the worker's half against a stand-in loader: a
request from the channel stages at once, and a staging that needs the
replaced version's slot waits for that version's drop, which only the step
loop does. The real engine takes every load through the channel in the
engine tests (``test_server_engine.py`` checks it is on, and that a paused
reload with every slot in use still writes the freed slot off the loop).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from skyrl_lora.server.loading.stage_channel import StageChannel, StageListener, socket_path
from skyrl_lora.server.loading.staging import _WorkerStaging
from skyrl_lora.server.loading.staging_status import READY
from tests.test_staging import _Manager, _Request, _wait


def _listen(tmp_path: Path) -> tuple[StageListener, list[dict[str, Any]], threading.Event]:
    got: list[dict[str, Any]] = []
    arrived = threading.Event()

    def handle(message: dict[str, Any], fds: list[int]) -> None:
        assert not fds
        if message.get("bad"):
            raise ValueError("not a request")
        got.append(message)
        arrived.set()

    return StageListener(socket_path(tmp_path, "w0"), handle), got, arrived


def test_requests_arrive_in_order_and_a_bad_one_does_not_end_the_channel(tmp_path) -> None:
    listener, got, arrived = _listen(tmp_path)
    channel = StageChannel([listener.path])
    assert channel.open
    assert channel.send({"bad": True})
    for i in range(3):
        assert channel.send({"request": {"lora_int_id": i}, "replaces": None})
    deadline = time.monotonic() + 5
    while len(got) < 3:
        assert time.monotonic() < deadline, got
        arrived.wait(0.1)
    assert [m["request"]["lora_int_id"] for m in got] == [0, 1, 2]
    channel.close()
    listener.close()


def test_a_channel_to_a_gone_worker_reports_failure_so_the_caller_uses_rpc(tmp_path) -> None:
    listener, _, _ = _listen(tmp_path)
    channel = StageChannel([listener.path])
    assert channel.send({"request": {"lora_int_id": 0}, "replaces": None})
    deadline = time.monotonic() + 5
    while not listener._connections:  # taken: the worker's end is open
        assert time.monotonic() < deadline
        time.sleep(0.01)
    listener.close()  # the worker went away
    listener.path.unlink()
    with pytest.raises(OSError):
        StageChannel([listener.path])  # nobody listens: refused at once
    sent = True
    for _ in range(50):  # the peer's end closes; a write then fails
        sent = channel.send({"request": {"lora_int_id": 1}, "replaces": None})
        if not sent:
            break
        time.sleep(0.01)
    assert not sent and not channel.open


class _Slots:
    """A slot table with no free slot until the replaced version is dropped."""

    def __init__(self) -> None:
        self.free = False
        self.written: list[int] = []

    def write(self, model: Any, check_finite: bool = False) -> bool:
        if not self.free:
            return False
        self.written.append(model.id)
        return True

    def remove_adapter(self, remove: Any, lora_id: int) -> bool:
        self.free = True
        return bool(remove(lora_id))

    def release(self, lora_id: int) -> None:
        pass

    def reserved(self, lora_id: int) -> bool:
        return lora_id in self.written


class _Model:
    def __init__(self, lora_id: int) -> None:
        self.id = lora_id
        self.loras: dict[str, Any] = {}  # no weights to check


class _SlotManager(_Manager):
    def _load_adapter(self, request: Any) -> Any:
        super()._load_adapter(request)
        return _Model(request.lora_int_id)


def test_a_staging_from_the_channel_waits_for_the_drop_only_for_its_slot() -> None:
    manager = _SlotManager()
    staging = _WorkerStaging(manager)
    slots = staging._slots = _Slots()  # type: ignore[assignment]
    staging.stage_beside_loop(_Request(21), replaces=20)
    time.sleep(0.2)
    assert manager.removed == [] and slots.written == []  # beside the loop: nothing removed
    staging.drop_replaced(20)  # the step loop's RPC
    assert _wait(staging, 21) == READY
    assert manager.removed == [20] and slots.written == [21]
    assert staging.status(21)["in_slot"] is True

    staging.stage_beside_loop(_Request(22))  # a free slot: no wait, no drop
    assert _wait(staging, 22) == READY and slots.written == [21, 22]
