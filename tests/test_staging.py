"""Worker-side adapter staging (``skyrl_lora.server.staging``) on its own.

The loader is a stand-in for vLLM's ``_load_adapter``: what is tested here is
our bookkeeping (staged models are handed out once, failures carry the
loader's message, unknown ids fall back to reading the files). That staging
is live in a real server is checked in ``test_server_engine.py``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from skyrl_lora.server.staging import FAILED, PENDING, READY, UNKNOWN, _WorkerStaging


@dataclass(frozen=True)
class _Request:
    lora_int_id: int
    lora_path: str = "p"
    lora_name: str = "adapter"


class _Manager:
    """Counts loads; ``gate`` lets a test hold a load in progress."""

    def __init__(self) -> None:
        self.loads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def add_adapter(self, model: Any) -> bool:  # vLLM's install, wrapped for timing
        return True

    def list_adapters(self) -> set[int]:
        return set()

    def _load_adapter(self, request: Any) -> Any:
        self.gate.wait(5)
        if request.lora_path == "corrupt":
            raise ValueError("bad safetensors header")
        self.loads.append(request.lora_int_id)
        return ("model", request.lora_int_id)


def _wait(staging: _WorkerStaging, lora_id: int) -> str:
    for _ in range(500):
        status = staging.status(lora_id)
        if status != PENDING:
            return status
        time.sleep(0.01)
    raise AssertionError("staging never finished")


def test_staged_model_is_installed_without_a_second_read() -> None:
    manager = _Manager()
    staging = _WorkerStaging(manager)
    manager.gate.clear()
    staging.stage(_Request(7))
    assert staging.status(7) == PENDING
    manager.gate.set()
    assert _wait(staging, 7) == READY
    assert manager._load_adapter(_Request(7)) == ("model", 7)  # the wrapped loader
    assert manager.loads == [7]  # read once, on the staging thread
    assert staging.status(7) == UNKNOWN  # handed out once


def test_unstaged_adapter_is_read_in_place() -> None:
    manager = _Manager()
    _WorkerStaging(manager)
    assert manager._load_adapter(_Request(3)) == ("model", 3)
    assert manager.loads == [3]


def test_failure_carries_the_loaders_message_and_is_forgotten() -> None:
    manager = _Manager()
    staging = _WorkerStaging(manager)
    staging.stage(_Request(5, "corrupt"))
    status = _wait(staging, 5)
    assert status.startswith(FAILED) and "bad safetensors header" in status
    assert staging.status(5) == UNKNOWN
    with pytest.raises(ValueError, match="bad safetensors"):
        manager._load_adapter(_Request(5, "corrupt"))


def test_discarded_staging_is_not_installed() -> None:
    manager = _Manager()
    staging = _WorkerStaging(manager)
    staging.stage(_Request(9))
    assert _wait(staging, 9) == READY
    staging.discard(9)
    manager._load_adapter(_Request(9))
    assert manager.loads == [9, 9]  # read again: the discarded model was dropped
