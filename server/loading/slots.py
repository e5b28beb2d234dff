"""Copy a staged adapter into a free engine LoRA slot beside the step loop.

Installing an adapter in vLLM ends with ``activate_adapter``: the model
manager takes the first free slot of its stacked LoRA tensors and copies
every layer's A and B into it (for the perf model's rank-16 adapter, 224
``copy_`` and 64 ``reset_lora`` calls: 7-15 ms on an H100), inside the
engine's step loop, where no tenant gets a token meanwhile. No request reads
a slot until an adapter is active in it, so the copy itself can run on the
staging thread while the engine keeps stepping; the step loop then only
records the adapter as active in the slot already written.

:class:`SlotPrefill` does that with vLLM's own pieces:

* :meth:`SlotPrefill.write` (staging thread) reserves the first free slot by
  putting a placeholder id in ``lora_index_to_id`` (so vLLM's first-free
  search skips it), writes the model with each layer's own ``set_lora`` /
  ``reset_lora``, their tensor calls batched into two
  (:mod:`skyrl_lora.server.loading.slot_batch`), and waits for the copies to land.
* The manager's ``activate_adapter`` is wrapped. For an adapter with a
  written slot it clears the placeholder and calls vLLM's own
  ``activate_adapter`` with the layer table swapped out for an empty one,
  so vLLM's bookkeeping (LRU order, slot table) runs and its copies do not.
  It claims the slot only when vLLM's first-free search lands on it and
  nothing needs evicting; otherwise it gives the slot up and lets vLLM
  activate the usual way, copies and all.
* A reserved slot never starves vLLM: when an adapter needs a slot and none
  is free, every reservation is given up first (waiting for a half-written
  one), and vLLM proceeds as it would have.
* The lock guards the slot table only, never a copy: an activation waits for
  a slot write in progress only when it needs that very slot (the write's
  slot is vLLM's first free one, or no slot is free at all). Any other
  activation, such as an evicted adapter coming back into a free slot, goes
  ahead while the staging thread writes (it waited for the whole write
  before: 8-19 ms on an idle H100, up to 72 ms under load).

Every path that does not claim a written slot ends in vLLM's unmodified
activation, so the worst case is the old cost, never wrong weights.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..adapters.finite_check import NonFiniteWeights, ensure_finite, parts
from .slot_batch import BatchedSlotWriter, WriteCounts

logger = logging.getLogger("vllm.skyrl_lora.slots")


@dataclass
class _Reservation:
    index: int
    #: The manager's slot table when the slot was reserved: vLLM replaces
    #: the list on ``remove_all_adapters``, which voids the reservation.
    slots: list[int | None]
    written: bool = False
    #: Released while being written: the writer lets the slot go when done.
    cancelled: bool = False
    #: Set when the write ended, either way; until then only the writer
    #: touches the slot, and nothing may give it to vLLM.
    done: threading.Event = field(default_factory=threading.Event)


def _placeholder(lora_id: int) -> int:
    """Marks a reserved slot; request ids are positive, so no request maps to it."""
    return -lora_id


class SlotPrefill:
    """Slot writes off the step loop for one worker's ``LoRAModelManager``."""

    def __init__(self, model_manager: Any, device: Any = None) -> None:
        self._manager = model_manager
        #: Our own reference: a claim swaps the manager's table out briefly.
        self._modules = dict(model_manager.modules)
        self._writer = BatchedSlotWriter(self._modules)
        self._device = device
        self._stream: Any = None
        self._activate = model_manager.activate_adapter
        self._lock = threading.Lock()
        self._reserved: dict[int, _Reservation] = {}
        model_manager.activate_adapter = self._activate_adapter

    @staticmethod
    def supports(model_manager: Any) -> bool:
        """Whether this manager has the parts the prefill relies on.

        Classification heads carry extra per-slot state that only vLLM's own
        activation writes, so a model with one keeps vLLM's activation.
        """
        needed = ("modules", "lora_index_to_id", "_active_adapters", "lora_slots")
        if not all(hasattr(model_manager, name) for name in needed):
            return False
        if not hasattr(model_manager, "_get_lora_layer_weights"):
            return False
        return all(
            hasattr(m, "set_lora")
            and hasattr(m, "reset_lora")
            and not hasattr(m, "set_module_to_save")
            for m in model_manager.modules.values()
        )

    # -- staging thread ------------------------------------------------------
    def write(self, model: Any, check_finite: bool = False) -> bool:
        """Reserve a free slot and copy ``model`` into it; False when none is spare.

        ``check_finite``: check what the slot now holds for NaNs and
        infinities (:mod:`.finite_check`), on the slot's device, where a
        host model's check would cost a CPU pass over every byte; a slot
        that fails is zeroed, released, and :class:`NonFiniteWeights` raised.

        A slot is spare only if vLLM could activate the model without evicting
        an active adapter. The lock is held to reserve and to finish, not while
        copying: the reservation's ``done`` event is what a step-loop caller
        that needs this very slot waits for.
        """
        manager = self._manager
        with self._lock:
            slots = manager.lora_index_to_id
            if len(manager._active_adapters) + len(self._reserved) >= manager.lora_slots:
                return False
            if None not in slots or model.id in self._reserved:
                return False
            index = slots.index(None)
            slots[index] = _placeholder(model.id)
            reservation = self._reserved[model.id] = _Reservation(index, slots)
        copied = False
        try:
            with self._copy_stream() as stream:
                counts = self._writer.write(index, self._layer_weights(model))
                if check_finite:
                    self._check_finite(index, counts, model)
            if stream is not None:
                stream.synchronize()
            copied = True
        finally:
            with self._lock:  # ends under the lock: a release sees written or dropped
                if copied and not reservation.cancelled:
                    reservation.written = True
                else:
                    self._drop_locked(model.id)
                reservation.done.set()
        return reservation.written

    def _check_finite(self, index: int, counts: WriteCounts, model: Any) -> None:
        """The slot's copies where they cover every weight of ``model`` (as
        many elements), its own tensors otherwise."""
        checked = [*counts.written, *counts.eager_sources]
        sources = [t for _, a, b in self._layer_weights(model) for t in parts(a) + parts(b)]
        if sum(t.numel() for t in checked) < sum(t.numel() for t in sources):
            checked = sources
        try:
            ensure_finite(checked, f"adapter {model.id}")
        except NonFiniteWeights:
            # reset every layer's slot: a free slot keeps nothing a batch could multiply
            self._writer.write(index, ((name, None, None) for name in self._modules))
            raise

    def _layer_weights(self, model: Any) -> Iterator[tuple[str, Any, Any]]:
        """Every layer's A and B in ``model``, as vLLM's activation writes
        them; None for a layer the adapter has no weights for (a reset)."""
        for name in self._modules:
            weights = self._manager._get_lora_layer_weights(model, name)
            if weights is None:
                yield name, None, None
            else:
                yield name, weights.lora_a, weights.lora_b

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[Any]:
        """On a GPU, a CUDA stream of the prefill's own for the slot copies.

        ``set_lora`` copies asynchronously from pinned memory. On the current
        (default) stream they would queue behind every kernel the step loop
        has launched, and waiting for them would wait for the engine's work
        too (a rank-16 write took up to 72 ms under load). On a side stream
        they run beside the engine's kernels, and the wait covers them alone.
        No kernel reads the slot meanwhile: it is reserved, not active. On a
        CPU the copies are synchronous; yields None.
        """
        import torch

        device = self._device
        if device is None or torch.device(device).type != "cuda":
            yield None
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self._stream):
            yield self._stream

    # -- either thread -------------------------------------------------------
    def release(self, lora_id: int) -> None:
        """Give up the slot reserved for ``lora_id`` (a staging not installed)."""
        with self._lock:
            self._release_locked(lora_id)

    def reserved(self, lora_id: int) -> bool:
        return lora_id in self._reserved

    def remove_adapter(self, remove: Callable[[int], bool], lora_id: int) -> bool:
        """Run vLLM's removal of ``lora_id`` (step loop) under the slot table's lock.

        The removal frees the adapter's slot; under the lock, a staging
        thread reserving a slot sees the table before or after, never half-way.
        """
        with self._lock:
            return remove(lora_id)

    def _release_locked(self, lora_id: int) -> None:
        """Drop a finished reservation; one still being written is dropped by its writer."""
        reservation = self._reserved.get(lora_id)
        if reservation is None:
            return
        if reservation.done.is_set():
            self._drop_locked(lora_id)
        else:
            reservation.cancelled = True

    def _drop_locked(self, lora_id: int) -> None:
        reservation = self._reserved.pop(lora_id, None)
        if reservation is not None and self._holds_slot(lora_id, reservation):
            reservation.slots[reservation.index] = None

    def _holds_slot(self, lora_id: int, reservation: _Reservation) -> bool:
        """Whether the placeholder still stands in the manager's current slot table."""
        slots = reservation.slots
        return slots is self._manager.lora_index_to_id and slots[reservation.index] == _placeholder(
            lora_id
        )

    # -- step loop -----------------------------------------------------------
    def _activate_adapter(self, lora_id: int) -> bool:
        """vLLM's ``activate_adapter``, claiming a slot written off the loop.

        vLLM calls it for every active adapter on every step (a touch of its
        LRU order), so an active adapter goes straight through. Any other
        activation runs under the lock, so no reservation can take the slot
        vLLM is about to pick; it first waits for a slot write in progress
        only if that write is in its way (:meth:`_in_the_way_locked`).
        """
        if lora_id in self._manager._active_adapters:
            return bool(self._activate(lora_id))
        while True:
            with self._lock:
                busy = self._in_the_way_locked(lora_id)
                if busy is None:
                    return self._activate_locked(lora_id)
            busy.done.wait()

    def _in_the_way_locked(self, lora_id: int) -> _Reservation | None:
        """A reservation still being written that this activation must wait for.

        Its own (not normally: an adapter is installed after its staging);
        the one whose slot vLLM's first-free search would pick (its table
        was replaced under it); or any, when no slot is free and vLLM needs
        one given up.
        """
        own = self._reserved.get(lora_id)
        if own is not None and not own.done.is_set():
            return own
        busy = [r for r in self._reserved.values() if not r.done.is_set()]
        if not busy:
            return None
        slots = self._manager.lora_index_to_id
        if None not in slots:
            return busy[0]
        first_free = slots.index(None)
        return next((r for r in busy if r.index == first_free), None)

    def _activate_locked(self, lora_id: int) -> bool:
        manager = self._manager
        if lora_id in self._reserved:
            claimed = self._claim_locked(lora_id)
            if claimed is not None:
                return claimed
        if self._reserved and None not in manager.lora_index_to_id:
            for reserved_id in list(self._reserved):  # vLLM needs a slot: give way
                self._release_locked(reserved_id)
        return bool(self._activate(lora_id))

    def _claim_locked(self, lora_id: int) -> bool | None:
        """Activate ``lora_id`` in its written slot; None when it must be copied again."""
        manager = self._manager
        reservation = self._reserved[lora_id]
        usable = (
            reservation.written
            and self._holds_slot(lora_id, reservation)
            and None not in reservation.slots[: reservation.index]
            and len(manager._active_adapters) < manager.lora_slots
        )
        self._release_locked(lora_id)
        if not usable:
            return None
        modules = manager.modules
        manager.modules = {}
        try:
            activated = bool(self._activate(lora_id))
        finally:
            manager.modules = modules
        if manager.lora_index_to_id[reservation.index] == lora_id:
            return activated
        # vLLM chose another slot after all: undo, and activate with copies.
        logger.warning("skyrl-lora: adapter %d landed outside its written slot", lora_id)
        manager.deactivate_adapter(lora_id)
        return None
