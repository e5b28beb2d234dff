"""Write a whole adapter into a LoRA slot in two tensor calls, not hundreds.

vLLM writes a slot layer by layer: each layer's ``reset_lora`` zeroes its
stacked A and B at the slot (``stacked[index] = 0``) and ``set_lora`` copies
the adapter's A and B into a view of it. For the perf model's rank-16 adapter
that is 672 tensor calls (224 views, 224 zeroings, 224 copies). Each call
lets go of the GIL and must win it back from the engine's step loop, which
under load holds it in stretches of up to the switch interval, so a slot
write that takes 12 ms on an idle H100 took 39-41 ms under load and stalled
the step loop at every hand-over.

:class:`BatchedSlotWriter` runs each layer's own ``set_lora`` / ``reset_lora``
(so whatever a vLLM version does to slice, split or pad the weights still
happens) under a :class:`torch.overrides.TorchFunctionMode` that *records*
the zeroings and copies into the layer's stacked tensors instead of running
them, and hands out cached views of those tensors instead of indexing them
anew. The recorded writes then run as one ``torch._foreach_zero_`` and one
``torch._foreach_copy_``: two GIL hand-overs per slot write. (Torch function
modes are thread-local: the step loop's own tensor calls are not seen.)

Reordering is sound because each layer writes only its own stacked tensors
and, in every layer vLLM has, zeroes its slot before copying into it; a
layer whose calls do anything else (another in-place op, a zeroing after a
copy, a copy into memory that is not a view of its stacked tensors) is not
recorded but written the usual way, after the batch.

Recording still runs ``set_lora``'s Python, about 17 intercepted tensor
calls a layer: on a CPU, where each of vLLM's copies is cheap, that cost
more than it saved. So a recording is kept as a *plan* when every copy's
source is one of the tensors the layer was given (no slicing or splitting
happened) and the layer's attributes are the same objects afterwards (no
other side effect): the next write into the same slot with inputs of the
same shapes, dtypes and devices replays the plan, the same views and the
new tensors, without calling ``set_lora`` at all. (A layer that mutates a
container it holds in place would go unseen; vLLM's linear LoRA layers do
nothing but the tensor writes, and ``tests/test_slot_batch.py`` checks
that on the installed vLLM.)

A plan recorded for one slot also serves every other slot, because recording
per slot index was what a server paid for most: on an NVIDIA H200 with a
Llama-3-8B-shaped model (128 LoRA layers, rank 64; 2026-11-28, main ded06ac)
the first write into each fresh slot cost 70-105 ms of GIL-held CPU in the
engine's process, a replayed one about 4 ms, so a 32-slot server paid the
recording 32 times per adapter layout, and each time the other tenants' token
stream stalled (their longest gap 88-98 ms, against about 35-50 ms
otherwise). vLLM's linear layers pick the slot with the first element of
every index they write through (``stacked[index, 0, :rank, :cols]``,
``stacked[index] = 0``), so their write into slot j is their write into slot
i with that element changed. A recording hands the layer its slot as a
:class:`_Slot`, an int the recorder can tell from a literal that happens to
equal it, and a plan is *derived* for another slot only when every view it
writes was taken with that argument, untouched, as the first element of its
index and nowhere else in it, from stacked tensors of one leading size (the
slots); each derived view must then sit exactly ``(j - i) * stride(0)``
further into its tensor with the same shape and strides, or the layer is
recorded for that slot as before. What this cannot see is a layer that
branches on the slot's value or computes another index element from it
(arithmetic on a :class:`_Slot` gives a plain int: first in an index it
keeps the plan to its own slot, further in it goes unseen); vLLM's linear
layers do neither, and the tests hold derived writes to what vLLM's own
calls leave. A derived plan is
counted in :attr:`WriteCounts.derived` by the write that derives it, and as
replayed by later writes into that slot.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import compat
from ..adapters.finite_check import parts

logger = logging.getLogger("vllm.skyrl_lora.slot_batch")

#: ``layer.set_lora(index, a, b)`` or ``layer.reset_lora(index)``, bound.
LayerWrite = Callable[[], None]

#: Where a copy's source sits among a write's inputs: (0 for A or 1 for B,
#: the slice's position in a list, or None for a lone tensor).
_InputPath = tuple[int, int | None]

#: Where a view was taken with the slot first in its index: the stacked
#: tensor, and the rest of the index (the view at any slot follows from it).
_Origin = tuple[torch.Tensor, tuple[Any, ...]]


class _Unbatchable(Exception):
    """A layer's write did something the recorder does not reorder safely."""


class _Slot(int):
    """The slot index as a recorded write is given it: to the layer an int
    like any other, to the recorder the slot argument itself, told apart from
    a literal or a computed int of the same value (arithmetic on it gives a
    plain int), so a plan is moved to another slot only where the layer put
    the slot argument."""

    __slots__ = ()


_INTS = (int, _Slot)


def _index_key(index: Any) -> Any:
    """A hashable form of a basic tensor index (slices hash only from Python 3.12);
    the same for a :class:`_Slot` as for the plain int, as the view is the same."""
    if type(index) in _INTS:
        return int(index)
    if type(index) is not tuple:
        index = (index,)
    key: list[Any] = []
    for part in index:
        kind = type(part)
        if kind is slice:
            key.append((part.start, part.stop, part.step))
        elif kind in _INTS:
            key.append(int(part))
        elif part is None or part is Ellipsis:
            key.append(part)
        else:  # a tensor or list index copies rather than views: not a slot
            raise _Unbatchable(f"index of type {kind.__name__}")
    return tuple(key)


def _tensors_of(layer: Any) -> Iterator[torch.Tensor]:
    """The tensors a LoRA layer holds as attributes, alone or in a tuple/list
    (``lora_a_stacked`` is a tuple of one tensor per slice)."""
    for value in vars(layer).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


@dataclass
class _LayerViews:
    """A layer's own tensors and the views of them its writes asked for.

    Views are cached per index: vLLM allocates the stacked tensors once, so
    ``stacked[slot, 0, :rank, :cols]`` is the same view at every write.
    """

    owned: dict[int, torch.Tensor]
    views: dict[tuple[int, Any], torch.Tensor] = field(default_factory=dict)
    #: ``id`` of every cached view: a copy is recorded only into one of them.
    view_ids: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, layer: Any) -> _LayerViews:
        return cls({id(t): t for t in _tensors_of(layer)})

    def owns(self, tensor: Any) -> bool:
        return self.owned.get(id(tensor)) is tensor

    def view(self, base: torch.Tensor, index: Any) -> torch.Tensor:
        key = (id(base), _index_key(index))
        cached = self.views.get(key)
        if cached is None:
            cached = self.views[key] = base[index]
            self.view_ids.add(id(cached))
        return cached


def _slot_led(base: torch.Tensor, index: Any) -> _Origin | None:
    """Where a view taken as ``base[index]`` sits, if ``index`` has the slot
    argument itself first and nowhere else (not in a slice bound either):
    only then does its view at another slot follow by changing that element."""
    elements = index if type(index) is tuple else (index,)
    if not elements or type(elements[0]) is not _Slot:
        return None
    rest = elements[1:]
    if any(_mentions_slot(part) for part in rest):
        return None
    return base, rest


def _mentions_slot(part: Any) -> bool:
    """Whether an index element is, or bounds a slice with, the slot argument."""
    if type(part) is slice:
        return any(type(bound) is _Slot for bound in (part.start, part.stop, part.step))
    return type(part) is _Slot


_GETITEM = torch.Tensor.__getitem__
_SETITEM = torch.Tensor.__setitem__
_COPY = torch.Tensor.copy_


class _Recorder(TorchFunctionMode):
    """Records the slot writes of one layer at a time; every other tensor call
    runs as usual. One mode for a whole slot write: entering one per layer
    cost as much as the recording itself."""

    def __init__(self) -> None:
        super().__init__()
        self.zeros: list[torch.Tensor] = []
        self.copy_dst: list[torch.Tensor] = []
        self.copy_src: list[torch.Tensor] = []
        self._views: _LayerViews | None = None
        self._copied = False
        #: For the layer being recorded: where each view it asked for sits,
        #: None if it asked for it other than at the slot argument alone.
        self._origins: dict[int, _Origin | None] = {}

    def record(self, views: _LayerViews, layer_write: LayerWrite) -> tuple[int, int]:
        """Run one layer's write, recording it; where its zeroings and copies
        start in the lists. :class:`_Unbatchable` (and nothing recorded of it)
        when it does something that may not be reordered."""
        marks = len(self.zeros), len(self.copy_dst)
        self._views, self._copied, self._origins = views, False, {}
        try:
            layer_write()
        except _Unbatchable:
            del self.zeros[marks[0] :], self.copy_dst[marks[1] :], self.copy_src[marks[1] :]
            raise
        finally:
            self._views = None
        return marks

    def origins(self, views: Iterable[torch.Tensor]) -> tuple[_Origin, ...] | None:
        """Where the last recorded layer took each of ``views``; None unless
        it took every one of them at the slot argument alone."""
        found = []
        for view in views:
            origin = self._origins.get(id(view))
            if origin is None:
                return None
            found.append(origin)
        return tuple(found)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        views = self._views
        if views is not None:
            if func is _GETITEM and views.owns(args[0]):
                return self._view(views, args[0], args[1])
            if func is _SETITEM:
                return self._zero(views, *args)
            if func is _COPY:
                return self._copy(views, *args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if (name.endswith("_") and not name.startswith("__")) or (kwargs and "out" in kwargs):
                raise _Unbatchable(f"in-place {name}")
        return func(*args, **(kwargs or {}))

    def _view(self, views: _LayerViews, base: torch.Tensor, index: Any) -> torch.Tensor:
        """The cached view, noting where it sits; a view asked for once other
        than at the slot argument alone stays so for this layer."""
        view = views.view(base, index)
        origin = _slot_led(base, index)
        if self._origins.get(id(view), origin) is None:
            origin = None
        self._origins[id(view)] = origin
        return view

    def _zero(self, views: _LayerViews, base: Any, index: Any, value: Any) -> None:
        if not views.owns(base) or isinstance(value, torch.Tensor) or value != 0:
            raise _Unbatchable("an assignment other than stacked[index] = 0")
        if self._copied:
            raise _Unbatchable("a zeroing after a copy")
        self.zeros.append(self._view(views, base, index))

    def _copy(self, views: _LayerViews, dst: Any, src: Any, non_blocking: bool = False) -> Any:
        if id(dst) not in views.view_ids or not isinstance(src, torch.Tensor):
            raise _Unbatchable("a copy into something other than a stacked view")
        if dst.shape != src.shape:
            raise _Unbatchable("a broadcasting copy")
        self._copied = True
        self.copy_dst.append(dst)
        self.copy_src.append(src)
        return dst


def _sources(writes: Iterable[LayerWrite]) -> Iterator[Any]:
    """The tensors ``set_lora`` writes take (a reset takes none)."""
    for write in writes:
        if isinstance(write, functools.partial):
            for value in write.args[1:]:
                yield from parts(value)


def _inputs(lora_a: Any, lora_b: Any) -> dict[int, _InputPath]:
    """The place of every tensor a write was given, by ``id`` (the write's
    inputs are alive while it runs, so an ``id`` names one of them)."""
    found: dict[int, _InputPath] = {}
    for position, given in enumerate((lora_a, lora_b)):
        if isinstance(given, torch.Tensor):
            found[id(given)] = (position, None)
        elif isinstance(given, (list, tuple)):
            for i, t in enumerate(given):
                if isinstance(t, torch.Tensor):
                    found[id(t)] = (position, i)
    return found


def _signature(given: Any) -> Any:
    """What a plan depends on in an input: shapes, dtypes, devices, Nones."""
    if isinstance(given, torch.Tensor):
        return (tuple(given.shape), given.dtype, given.device)
    if isinstance(given, (list, tuple)):
        return tuple(_signature(t) for t in given)
    if given is None:
        return None
    raise _Unbatchable(f"an input of type {type(given).__name__}")


def _pick(lora_a: Any, lora_b: Any, path: _InputPath) -> torch.Tensor:
    given = (lora_a, lora_b)[path[0]]
    return given if path[1] is None else given[path[1]]


def _layer_write(layer: Any, index: int, lora_a: Any, lora_b: Any) -> LayerWrite:
    """The layer's own write of slot ``index``: a reset when ``lora_a`` is None."""
    if lora_a is None:
        return functools.partial(layer.reset_lora, index)
    return functools.partial(layer.set_lora, index, lora_a, lora_b)


@dataclass(frozen=True)
class _Plan:
    """A layer's recorded write into one slot: the views it zeroes, and the
    views it copies into with the input each copy reads."""

    zeros: tuple[torch.Tensor, ...]
    copies: tuple[tuple[torch.Tensor, _InputPath], ...]
    #: The slot it writes.
    slot: int
    #: Where each view sits, the zeroed ones then those copied into; None
    #: when the plan may serve its own slot only.
    origins: tuple[_Origin, ...] | None = None

    def views(self) -> tuple[torch.Tensor, ...]:
        return (*self.zeros, *(dst for dst, _ in self.copies))

    def at(self, slot: int, views: _LayerViews) -> _Plan | None:
        """The same writes into ``slot``: every view taken with its slot
        element changed, through ``views`` (so a copy into one is known as
        a copy into the layer's own views). None unless the plan can move
        and every moved view sits where moving the slot puts it."""
        origins = self.origins
        if origins is None or not _slots_cover(origins, slot):
            return None
        moved = []
        for view, origin in zip(self.views(), origins):
            at = _moved_view(views, view, origin, slot, slot - self.slot)
            if at is None:
                return None
            moved.append(at)
        zeros = len(self.zeros)
        copies = tuple((dst, path) for dst, (_, path) in zip(moved[zeros:], self.copies))
        return _Plan(tuple(moved[:zeros]), copies, slot, origins)


def _slots_cover(origins: tuple[_Origin, ...], slot: int) -> bool:
    """Whether the stacked tensors a plan writes share one leading size (the
    slots: vLLM allocates every one with the slot dimension first) that
    holds ``slot``."""
    leading = {base.shape[0] for base, _ in origins}
    return len(leading) == 1 and 0 <= slot < leading.pop()


def _moved_view(
    views: _LayerViews, view: torch.Tensor, origin: _Origin, slot: int, shift: int
) -> torch.Tensor | None:
    """``view`` at ``slot``, ``shift`` slots on, if it is exactly that: the
    same shape and strides, ``shift`` leading strides further into the same
    tensor. A slot-led index always passes; the check guards the derivation."""
    base, rest = origin
    moved = views.view(base, (slot, *rest))
    if moved.shape != view.shape or moved.stride() != view.stride():
        return None
    if moved.storage_offset() != view.storage_offset() + shift * base.stride(0):
        return None
    return moved


@dataclass(frozen=True)
class WriteCounts:
    """How a slot write's layers were written: recorded, replayed from the
    layer's plan for this slot, derived from its plan for another slot (a
    derived plan is kept, so the next write into the slot replays it), or
    written as vLLM writes them."""

    recorded: int = 0
    replayed: int = 0
    derived: int = 0
    eager: int = 0
    #: The slot's views the batched copies wrote, and the source tensors of
    #: the layers written as vLLM writes them: what holds the new weights.
    written: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    eager_sources: tuple[Any, ...] = field(default=(), compare=False, repr=False)


@dataclass
class _Batch:
    """The writes of one slot write, gathered for the two batched calls."""

    recorder: _Recorder = field(default_factory=_Recorder)
    eager: list[LayerWrite] = field(default_factory=list)
    recording: bool = False
    recorded: int = 0
    replayed: int = 0
    derived: int = 0

    def replay(self, plan: _Plan, lora_a: Any, lora_b: Any) -> None:
        self.recorder.zeros.extend(plan.zeros)
        for dst, path in plan.copies:
            self.recorder.copy_dst.append(dst)
            self.recorder.copy_src.append(_pick(lora_a, lora_b, path))


#: A plan's key: the layer's name, the slot, and the inputs' signature.
_PlanKey = tuple[str, int, Any]


class BatchedSlotWriter:
    """Writes adapters into slots of one model's LoRA layers, batched."""

    def __init__(self, layers: dict[str, Any], move_plans: bool = True) -> None:
        """``move_plans`` False records every slot's first write, as before
        plans moved between slots: the baseline of ``benchmarks.slot_write``."""
        self._layers = layers
        self._move_plans = move_plans
        self._views = {name: _LayerViews.of(layer) for name, layer in layers.items()}
        self._plans: dict[_PlanKey, _Plan] = {}
        #: Per layer name and input signature, the first plan recorded that
        #: can move to another slot: what a slot without a plan derives from.
        self._movable: dict[tuple[str, Any], _Plan] = {}
        #: Layers seen doing something the recorder does not batch: written
        #: as vLLM writes them from then on.
        self._unbatched: set[str] = set()
        self._reported = False

    def write(self, index: int, weights: Iterable[tuple[str, Any, Any]]) -> WriteCounts:
        """Write slot ``index`` of every layer named in ``weights``, given as
        ``(name, lora_a, lora_b)``; ``lora_a`` None resets the layer's slot.

        All zeroings run before all copies, then the layers that could not be
        recorded are written as vLLM writes them.
        """
        batch = _Batch()
        with contextlib.ExitStack() as recording:
            for name, lora_a, lora_b in weights:
                self._add(batch, recording, name, index, lora_a, lora_b)
                # A replay never calls the layer's set_lora: say what the slot holds.
                compat.note_lora_slot_written(self._layers[name], index, lora_a is not None)
        recorder = batch.recorder
        if recorder.zeros:
            torch._foreach_zero_(recorder.zeros)
        if recorder.copy_dst:
            torch._foreach_copy_(recorder.copy_dst, recorder.copy_src, non_blocking=True)
        for layer_write in batch.eager:
            layer_write()
        counts = WriteCounts(
            recorded=batch.recorded,
            replayed=batch.replayed,
            derived=batch.derived,
            eager=len(batch.eager),
            written=tuple(recorder.copy_dst),
            eager_sources=tuple(_sources(batch.eager)),
        )
        if not self._reported:  # once: whether a vLLM version's layers batch at all
            self._reported = True
            logger.info("first slot write: %s of %d layers", counts, len(self._layers))
        return counts

    def _add(
        self,
        batch: _Batch,
        recording: contextlib.ExitStack,
        name: str,
        index: int,
        lora_a: Any,
        lora_b: Any,
    ) -> None:
        """Replay the layer's plan for this slot (derived from its plan for
        another slot if it has none), or record its write, or leave it to run
        as vLLM runs it."""
        if name not in self._unbatched:  # not recorded again: it would half-run first
            try:
                key = (name, index, (_signature(lora_a), _signature(lora_b)))
                if not self._replay(batch, key, lora_a, lora_b):
                    self._record(batch, recording, key, lora_a, lora_b)
                return
            except _Unbatchable as why:
                self._unbatched.add(name)
                logger.info("slot writes of layer %s not batched: %s", name, why)
        batch.eager.append(_layer_write(self._layers[name], index, lora_a, lora_b))

    def _replay(self, batch: _Batch, key: _PlanKey, lora_a: Any, lora_b: Any) -> bool:
        """Replay the layer's plan for the slot, or one derived from its plan
        for another slot; False when there is neither."""
        plan = self._plans.get(key)
        if plan is not None:
            batch.replayed += 1
        else:
            plan = self._derive(key)
            if plan is None:
                return False
            batch.derived += 1
        batch.replay(plan, lora_a, lora_b)
        return True

    def _derive(self, key: _PlanKey) -> _Plan | None:
        """The layer's movable plan for these inputs moved to the key's slot,
        kept as that slot's plan; None when there is none or it does not move
        there (the layer is then recorded for the slot)."""
        name, index, signature = key
        movable = self._movable.get((name, signature)) if self._move_plans else None
        if movable is None:
            return None
        plan = movable.at(index, self._views[name])
        if plan is None:
            logger.debug("layer %s: plan for slot %d not moved to %d", name, movable.slot, index)
            return None
        self._plans[key] = plan
        return plan

    def _record(
        self,
        batch: _Batch,
        recording: contextlib.ExitStack,
        key: _PlanKey,
        lora_a: Any,
        lora_b: Any,
    ) -> None:
        """Record the layer's write (entering the recorder's mode at the
        first recording: a write that only replays never pays for it), given
        the slot as a :class:`_Slot`, and keep it as a plan if it is one."""
        name, index, signature = key
        layer = self._layers[name]
        recorder = batch.recorder
        if not batch.recording:
            recording.enter_context(recorder)
            batch.recording = True
        attributes = {k: id(v) for k, v in vars(layer).items()}
        layer_write = _layer_write(layer, _Slot(index), lora_a, lora_b)
        marks = recorder.record(self._views[name], layer_write)
        batch.recorded += 1
        if attributes != {k: id(v) for k, v in vars(layer).items()}:
            return
        plan = self._plan_of(recorder, marks, _inputs(lora_a, lora_b), index)
        if plan is None:
            return
        self._plans[key] = plan
        if plan.origins is not None:
            self._movable.setdefault((name, signature), plan)

    @staticmethod
    def _plan_of(
        recorder: _Recorder,
        marks: tuple[int, int],
        inputs: dict[int, _InputPath],
        slot: int,
    ) -> _Plan | None:
        """The layer's recorded write as a plan, if it wrote tensors at all (a
        write with none works through other means, which a plan would skip)
        and every copy read a given tensor as it was given (not a slice or a
        product of one); one that can move to other slots if the layer took
        every view at the slot argument alone."""
        if len(recorder.zeros) == marks[0] and len(recorder.copy_dst) == marks[1]:
            return None
        copies = []
        for dst, src in zip(recorder.copy_dst[marks[1] :], recorder.copy_src[marks[1] :]):
            path = inputs.get(id(src))
            if path is None:
                return None
            copies.append((dst, path))
        plan = _Plan(tuple(recorder.zeros[marks[0] :]), tuple(copies), slot)
        origins = recorder.origins(plan.views())
        return plan if origins is None else replace(plan, origins=origins)
