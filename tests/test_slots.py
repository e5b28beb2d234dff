"""Slot writes off the step loop (``skyrl_lora.server.loading.slots``), on a stand-in manager.

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

from skyrl_lora.server.loading.slots import SlotPrefill


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


def test_every_slot_in_use_a_removed_version_leaves_its_slot_to_be_written(
    manager: _Manager,
) -> None:
    """A paused tenant's reload with every slot active: its old version is
    removed first, so its successor is written into that slot off the loop."""
    prefill = SlotPrefill(manager)
    for lora_id in (1, 2):
        manager.register(lora_id)
        manager.activate_adapter(lora_id)

    def remove(lora_id: int) -> bool:
        manager.deactivate_adapter(lora_id)
        return True

    assert prefill.remove_adapter(remove, 1)
    assert _write_off_thread(prefill, manager.register(3))
    copies = manager.copies
    assert manager.activate_adapter(3) is True
    assert manager.copies == copies and manager.lora_index_to_id == [3, 2]
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


class _HeldWrite:
    """A slot write on its own thread, held inside its copy until ``finish``."""

    def __init__(self, prefill: SlotPrefill, manager: _Manager, model: _Model) -> None:
        self.entered = threading.Event()
        self._go = threading.Event()
        layer = manager.modules["qkv"]
        real = layer.set_lora

        def held(index: int, a: str, b: str) -> None:
            if threading.current_thread() is self._thread:  # the step loop's copies go through
                self.entered.set()
                assert self._go.wait(5)
            real(index, a, b)

        layer.set_lora = held  # type: ignore[method-assign]
        self.result: list[bool] = []
        self._thread = threading.Thread(target=lambda: self.result.append(prefill.write(model)))
        self._thread.start()
        assert self.entered.wait(5)

    def finish(self) -> bool:
        self._go.set()
        self._thread.join(5)
        return self.result[0]


def _activate_on_thread(manager: _Manager, lora_id: int) -> threading.Thread:
    thread = threading.Thread(target=manager.activate_adapter, args=(lora_id,))
    thread.start()
    return thread


def test_an_activation_into_another_free_slot_does_not_wait_for_a_write() -> None:
    manager = _Manager(slots=3)
    prefill = SlotPrefill(manager)
    write = _HeldWrite(prefill, manager, manager.register(7))  # slot 0, held mid-copy
    manager.register(1)
    activation = _activate_on_thread(manager, 1)
    activation.join(2)
    assert not activation.is_alive()  # went ahead while the write is held
    assert manager.lora_index_to_id == [-7, 1, None]
    assert write.finish()
    assert manager.activate_adapter(7) is True and manager.lora_index_to_id == [7, 1, None]
    manager.assert_consistent()


def test_an_activation_that_needs_the_slot_being_written_waits_for_it() -> None:
    manager = _Manager(slots=2)
    prefill = SlotPrefill(manager)
    manager.register(1)
    manager.activate_adapter(1)
    write = _HeldWrite(prefill, manager, manager.register(2))  # the last free slot
    manager.register(3)
    activation = _activate_on_thread(manager, 3)  # needs a slot: must not take it mid-copy
    activation.join(0.2)
    assert activation.is_alive()
    assert write.finish()
    activation.join(5)
    assert not activation.is_alive()
    assert manager.lora_index_to_id == [1, 3] and not prefill.reserved(2)  # gave way
    manager.assert_consistent()


def test_a_release_during_the_write_frees_the_slot_when_it_ends() -> None:
    manager = _Manager(slots=2)
    prefill = SlotPrefill(manager)
    write = _HeldWrite(prefill, manager, manager.register(5))
    prefill.release(5)  # the staging was discarded meanwhile: returns at once
    assert manager.lora_index_to_id == [-5, None]  # still the writer's until it ends
    assert write.finish() is False
    assert manager.lora_index_to_id == [None, None] and not prefill.reserved(5)
    manager.activate_adapter(5)  # the usual way, copies and all
    manager.assert_consistent()


def test_a_replaced_slot_table_makes_an_activation_wait_for_the_write() -> None:
    manager = _Manager(slots=2)
    prefill = SlotPrefill(manager)
    write = _HeldWrite(prefill, manager, manager.register(5))  # slot 0
    manager.lora_index_to_id = [None, None]  # vLLM's remove_all_adapters
    manager.register(6)
    activation = _activate_on_thread(manager, 6)  # vLLM would pick slot 0, being written
    activation.join(0.2)
    assert activation.is_alive()
    assert write.finish()
    activation.join(5)
    assert manager.lora_index_to_id == [6, None]
    manager.assert_consistent()
    copies = manager.copies
    manager.activate_adapter(5)  # its reservation is void: copied the usual way
    assert manager.copies == copies + 2 and manager.lora_index_to_id == [6, 5]
    manager.assert_consistent()


def test_a_checked_write_of_non_finite_weights_resets_and_frees_its_slot(
    manager: _Manager,
) -> None:
    import torch

    from skyrl_lora.server.adapters.finite_check import NonFiniteWeights

    prefill = SlotPrefill(manager)
    fine = _Model(5, {"qkv": _Weights(torch.ones(2), torch.ones(2))})  # type: ignore[arg-type]
    assert prefill.write(fine, check_finite=True)
    broken = torch.ones(2)
    broken[1] = float("nan")
    bad = _Model(6, {"qkv": _Weights(torch.ones(2), broken)})  # type: ignore[arg-type]
    with pytest.raises(NonFiniteWeights):
        prefill.write(bad, check_finite=True)
    index = 1  # the free slot the bad write took
    assert manager.modules["qkv"].slots[index] is None, "a refused slot keeps no weights"
    assert manager.lora_index_to_id[index] is None, "and is free again"
    assert not prefill.reserved(6)
