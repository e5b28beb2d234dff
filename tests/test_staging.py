"""Worker-side adapter staging (``skyrl_lora.server.loading.staging``) on its own.

The loader is a stand-in for vLLM's ``_load_adapter``: what is tested here is
our bookkeeping (staged models are handed out once, failures carry the
loader's message, unknown ids fall back to reading the files). That staging
is live in a real server is checked in ``test_server_engine.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from skyrl_lora.server.loading.staging import STAGING_SWITCH_INTERVAL_S, _WorkerStaging
from skyrl_lora.server.loading.staging_status import FAILED, PENDING, READY, UNKNOWN


@dataclass(frozen=True)
class _Request:
    lora_int_id: int
    lora_path: str = "p"
    lora_name: str = "adapter"


class _Loaded(tuple):
    """A fake loaded model: compares as ``("model", id)``, holds no weights
    (the staging checks a model's weights finite before its slot)."""

    loras: dict[str, Any] = {}


class _Manager:
    """Counts loads; ``gate`` lets a test hold a load in progress."""

    def __init__(self) -> None:
        self.loads: list[int] = []
        self.removed: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def remove_adapter(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    def add_adapter(self, model: Any) -> bool:  # vLLM's install, wrapped for timing
        return True

    def list_adapters(self) -> set[int]:
        return set()

    def _load_adapter(self, request: Any) -> Any:
        self.gate.wait(5)
        if request.lora_path == "corrupt":
            raise ValueError("bad safetensors header")
        self.loads.append(request.lora_int_id)
        return _Loaded(("model", request.lora_int_id))


def _state(staging: _WorkerStaging, lora_id: int) -> str:
    return str(staging.status(lora_id)["state"])


def _wait(staging: _WorkerStaging, lora_id: int) -> str:
    for _ in range(500):
        state = _state(staging, lora_id)
        if state != PENDING:
            return state
        time.sleep(0.01)
    raise AssertionError("staging never finished")


def test_staged_model_is_installed_without_a_second_read() -> None:
    manager = _Manager()
    staging = _WorkerStaging(manager)
    manager.gate.clear()
    staging.stage(_Request(7))
    assert _state(staging, 7) == PENDING
    manager.gate.set()
    assert _wait(staging, 7) == READY
    assert manager._load_adapter(_Request(7)) == ("model", 7)  # the wrapped loader
    assert manager.loads == [7]  # read once, on the staging thread
    assert _state(staging, 7) == UNKNOWN  # handed out once


def test_unstaged_adapter_is_read_in_place() -> None:
    manager = _Manager()
    _WorkerStaging(manager)
    assert manager._load_adapter(_Request(3)) == ("model", 3)
    assert manager.loads == [3]


def test_failure_carries_the_loaders_message_and_is_forgotten() -> None:
    manager = _Manager()
    staging = _WorkerStaging(manager)
    staging.stage(_Request(5, "corrupt"))
    assert _wait(staging, 5) == FAILED
    staging.stage(_Request(5, "corrupt"))
    while (status := staging.status(5))["state"] == PENDING:
        time.sleep(0.01)
    assert status == {"state": FAILED, "error": "ValueError: bad safetensors header"}
    assert _state(staging, 5) == UNKNOWN
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


def test_a_replaced_version_is_removed_before_its_successor_is_read() -> None:
    manager = _Manager()
    manager.gate.clear()  # hold the read: the removal must not wait for it
    staging = _WorkerStaging(manager)
    staging.stage(_Request(11), replaces=10)
    assert manager.removed == [10] and manager.loads == []
    manager.gate.set()
    assert _wait(staging, 11) == READY
    staging.stage(_Request(12))
    assert _wait(staging, 12) == READY
    assert manager.removed == [10]  # nothing named, nothing removed


class _Model:
    """A loaded adapter as the packing sees it (weak-referenceable, like vLLM's)."""

    def __init__(self, lora_id: int) -> None:
        self.id = lora_id
        self.loras: dict[str, Any] = {}  # per-layer weights; the scaling fold walks them


class _ModelManager:
    """vLLM's ``LoRAModelManager`` packing: records which thread packed what."""

    def __init__(self) -> None:
        self.packed_on: list[tuple[int, str]] = []
        self.switch_interval_seen: list[float] = []

    def _create_merged_loras_inplace(self, model: _Model) -> None:
        self.packed_on.append((model.id, threading.current_thread().name))


class _PackingManager(_Manager):
    def __init__(self) -> None:
        super().__init__()
        self._adapter_manager = _ModelManager()

    def _load_adapter(self, request: Any) -> Any:
        self._adapter_manager.switch_interval_seen.append(sys.getswitchinterval())
        self.loads.append(request.lora_int_id)
        return _Model(request.lora_int_id)


def test_staged_model_is_packed_off_the_loop_and_not_again_in_it() -> None:
    manager = _PackingManager()
    models = manager._adapter_manager
    staging = _WorkerStaging(manager)
    staging.stage(_Request(4))
    assert _wait(staging, 4) == READY
    staged = manager._load_adapter(_Request(4))
    models._create_merged_loras_inplace(staged)  # what add_adapter does in the loop
    assert [(i, t.startswith("skyrl-lora-stage")) for i, t in models.packed_on] == [(4, True)]

    unstaged = manager._load_adapter(_Request(6))  # read in the loop: packed there
    models._create_merged_loras_inplace(unstaged)
    assert models.packed_on[1] == (6, threading.current_thread().name)


def test_staging_shortens_the_switch_interval_only_while_it_runs() -> None:
    manager = _PackingManager()
    staging = _WorkerStaging(manager)
    before = sys.getswitchinterval()
    staging.stage(_Request(8))
    assert _wait(staging, 8) == READY
    assert manager._adapter_manager.switch_interval_seen == [STAGING_SWITCH_INTERVAL_S]
    assert sys.getswitchinterval() == before


def test_gpu_staging_follows_the_worker_device_and_can_be_turned_off() -> None:
    assert not _WorkerStaging(_Manager()).gpu_staging  # no device: a CPU worker
    assert _WorkerStaging(_Manager(), device="cuda:0").gpu_staging  # nothing is allocated yet
    assert not _WorkerStaging(_Manager(), device="cuda:0", gpu_staging=False).gpu_staging
