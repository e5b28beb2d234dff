"""Slot writes off the step loop (``skyrl_lora.server.slots``), on a stand-in manager.

``_Manager`` behaves like vLLM's ``LRUCacheLoRAModelManager`` where the
prefill depends on it: first free slot, LRU eviction when every slot is
active, and one ``set_lora`` / ``reset_lora`` per layer on activation. The
invariant every test checks: wherever the slot table says an adapter is
active, every layer holds exactly that adapter's weights. The real vLLM
classes run the same path in the engine tests (a reload changes the output).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest

from skyrl_lora.server.slots import SlotPrefill


@dataclass(frozen=True)
class _Weights:
    lora_a: str
    lora_b: str


@dataclass(frozen=True)
class _Model:
    id: int
    weights: dict[str, _Weights] = field(default_factory=dict)


def _model(lora_id: int) -> _Model:
    # "o" has no weights in the adapter: its slot must be reset, not left stale.
    return _Model(lora_id, {"qkv": _Weights(f"a{lora_id}", f"b{lora_id}")})


class _Layer:
    def __init__(self, manager: _Manager) -> None:
        self.manager = manager
        self.slots: dict[int, tuple[str, str] | None] = {}

    def set_lora(self, index: int, a: str, b: str) -> None:
        self.manager.copies += 1
        self.slots[index] = (a, b)

    def reset_lora(self, index: int) -> None:
        self.manager.copies += 1
        self.slots[index] = None


class _Active(OrderedDict):
    def touch(self, key: int) -> None:
        self.move_to_end(key)

    def remove_oldest(self) -> int:
        key = next(iter(self))
        return key


class _Manager:
    def __init__(self, slots: int = 2) -> None:
        self.lora_slots = slots
        self.lora_index_to_id: list[int | None] = [None] * slots
        self._active_adapters = _Active()
        self.copies = 0
        self.modules = {"qkv": _Layer(self), "o": _Layer(self)}
        self.models: dict[int, _Model] = {}

    def _get_lora_layer_weights(self, model: _Model, name: str) -> _Weights | None:
        return model.weights.get(name)

    def activate_adapter(self, lora_id: int) -> bool:
        if lora_id not in self._active_adapters and len(self._active_adapters) >= self.lora_slots:
            self.deactivate_adapter(self._active_adapters.remove_oldest())
        if lora_id in self._active_adapters:
            self._active_adapters.touch(lora_id)
            return False
        if None not in self.lora_index_to_id:
            raise ValueError("No free lora slots")
        index = self.lora_index_to_id.index(None)
        self._active_adapters[lora_id] = None
        self.lora_index_to_id[index] = lora_id
        for name, layer in self.modules.items():
            weights = self._get_lora_layer_weights(self.models[lora_id], name)
            if weights is None:
                layer.reset_lora(index)
            else:
                layer.set_lora(index, weights.lora_a, weights.lora_b)
        return True

    def deactivate_adapter(self, lora_id: int) -> None:
        self._active_adapters.pop(lora_id, None)
        if lora_id in self.lora_index_to_id:
            self.lora_index_to_id[self.lora_index_to_id.index(lora_id)] = None

    def register(self, lora_id: int) -> _Model:
        model = self.models[lora_id] = _model(lora_id)
        return model

    def assert_consistent(self) -> None:
        for index, lora_id in enumerate(self.lora_index_to_id):
            if lora_id is None or lora_id < 0:
                continue
            weights = self.models[lora_id].weights
            for name, layer in self.modules.items():
                expected = weights.get(name)
                held = layer.slots[index]
                assert held == (None if expected is None else (expected.lora_a, expected.lora_b))
        assert sorted(self._active_adapters) == sorted(
            i for i in self.lora_index_to_id if i is not None and i > 0
        )


def _write_off_thread(prefill: SlotPrefill, model: _Model) -> bool:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(prefill.write(model)))
    thread.start()
    thread.join()
    return result[0]


@pytest.fixture
def manager() -> _Manager:
    return _Manager(slots=2)


def test_a_written_slot_is_claimed_without_copies_in_the_loop(manager: _Manager) -> None:
    prefill = SlotPrefill(manager)
    assert SlotPrefill.supports(manager)
    assert _write_off_thread(prefill, manager.register(7))
    written = manager.copies
    assert written == 2 and manager.lora_index_to_id == [-7, None]  # reserved, not active
    assert manager.activate_adapter(7) is True
    assert manager.copies == written  # the step loop copied nothing
    assert manager.lora_index_to_id == [7, None] and not prefill.reserved(7)
    manager.assert_consistent()
    assert manager.activate_adapter(7) is False  # an active adapter is only touched
    assert manager.copies == written


def test_a_lower_slot_freed_meanwhile_falls_back_to_copying(manager: _Manager) -> None:
    prefill = SlotPrefill(manager)
    manager.register(1)
    manager.activate_adapter(1)  # slot 0
    assert _write_off_thread(prefill, manager.register(2))  # slot 1
    manager.deactivate_adapter(1)  # slot 0 free: vLLM's first-free search would pick it
    copies = manager.copies
    assert manager.activate_adapter(2) is True
    assert manager.lora_index_to_id == [2, None]
    assert manager.copies == copies + 2  # copied in the loop, as vLLM does
    manager.assert_consistent()


def test_a_reservation_gives_way_when_vllm_needs_the_slot(manager: _Manager) -> None:
    prefill = SlotPrefill(manager)
    manager.register(1)
    manager.activate_adapter(1)
    assert _write_off_thread(prefill, manager.register(2))  # takes the last free slot
    manager.register(3)
    assert manager.activate_adapter(3) is True  # no "No free lora slots"
    assert manager.lora_index_to_id == [1, 3] and not prefill.reserved(2)
    manager.assert_consistent()
    manager.activate_adapter(2)  # evicts the oldest and copies, as vLLM does
    assert manager.lora_index_to_id == [2, 3]
    manager.assert_consistent()


def test_no_spare_slot_means_no_write(manager: _Manager) -> None:
    prefill = SlotPrefill(manager)
    for lora_id in (1, 2):
        manager.register(lora_id)
        manager.activate_adapter(lora_id)
    copies = manager.copies
    assert not _write_off_thread(prefill, manager.register(3))
    assert manager.copies == copies and manager.lora_index_to_id == [1, 2]
    manager.activate_adapter(3)
    manager.assert_consistent()


def test_a_released_reservation_frees_its_slot(manager: _Manager) -> None:
    prefill = SlotPrefill(manager)
    assert _write_off_thread(prefill, manager.register(5))
    prefill.release(5)
    assert manager.lora_index_to_id == [None, None] and not prefill.reserved(5)
    manager.activate_adapter(5)  # activated the usual way
    manager.assert_consistent()


def test_a_failed_write_leaves_no_reservation(manager: _Manager) -> None:
    prefill = SlotPrefill(manager)

    def broken(index: int, a: str, b: str) -> None:
        raise RuntimeError("device lost")

    manager.modules["qkv"].set_lora = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device lost"):
        prefill.write(manager.register(4))
    assert manager.lora_index_to_id == [None, None] and not prefill.reserved(4)
