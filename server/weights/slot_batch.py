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
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .finite_check import parts

logger = logging.getLogger("vllm.skyrl_lora.slot_batch")

#: ``layer.set_lora(index, a, b)`` or ``layer.reset_lora(index)``, bound.
LayerWrite = Callable[[], None]

#: Where a copy's source sits among a write's inputs: (0 for A or 1 for B,
#: the slice's position in a list, or None for a lone tensor).
_InputPath = tuple[int, int | None]


class _Unbatchable(Exception):
    """A layer's write did something the recorder does not reorder safely."""


def _index_key(index: Any) -> Any:
    """A hashable form of a basic tensor index (slices hash only from Python 3.12)."""
    if type(index) is int:
        return index
    if type(index) is not tuple:
        index = (index,)
    key = []
    for part in index:
        kind = type(part)
        if kind is slice:
            key.append((part.start, part.stop, part.step))
        elif kind is int or part is None or part is Ellipsis:
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

    def record(self, views: _LayerViews, layer_write: LayerWrite) -> tuple[int, int]:
        """Run one layer's write, recording it; where its zeroings and copies
        start in the lists. :class:`_Unbatchable` (and nothing recorded of it)
        when it does something that may not be reordered."""
        marks = len(self.zeros), len(self.copy_dst)
        self._views, self._copied = views, False
        try:
            layer_write()
        except _Unbatchable:
            del self.zeros[marks[0] :], self.copy_dst[marks[1] :], self.copy_src[marks[1] :]
            raise
        finally:
            self._views = None
        return marks

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        views = self._views
        if views is not None:
            if func is _GETITEM and views.owns(args[0]):
                return views.view(args[0], args[1])
            if func is _SETITEM:
                return self._zero(views, *args)
            if func is _COPY:
                return self._copy(views, *args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if (name.endswith("_") and not name.startswith("__")) or (kwargs and "out" in kwargs):
                raise _Unbatchable(f"in-place {name}")
        return func(*args, **(kwargs or {}))

    def _zero(self, views: _LayerViews, base: Any, index: Any, value: Any) -> None:
        if not views.owns(base) or isinstance(value, torch.Tensor) or value != 0:
            raise _Unbatchable("an assignment other than stacked[index] = 0")
        if self._copied:
            raise _Unbatchable("a zeroing after a copy")
        self.zeros.append(views.view(base, index))

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


@dataclass(frozen=True)
class _Plan:
    """A layer's recorded write into one slot: the views it zeroes, and the
    views it copies into with the input each copy reads."""

    zeros: tuple[torch.Tensor, ...]
    copies: tuple[tuple[torch.Tensor, _InputPath], ...]


@dataclass(frozen=True)
class WriteCounts:
    """How a slot write's layers were written."""

    recorded: int = 0
    replayed: int = 0
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

    def replay(self, plan: _Plan, lora_a: Any, lora_b: Any) -> None:
        self.recorder.zeros.extend(plan.zeros)
        for dst, path in plan.copies:
            self.recorder.copy_dst.append(dst)
            self.recorder.copy_src.append(_pick(lora_a, lora_b, path))
        self.replayed += 1


class BatchedSlotWriter:
    """Writes adapters into slots of one model's LoRA layers, batched."""

    def __init__(self, layers: dict[str, Any]) -> None:
        self._layers = layers
        self._views = {name: _LayerViews.of(layer) for name, layer in layers.items()}
        self._plans: dict[tuple[str, int, Any], _Plan] = {}
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
        recorder = batch.recorder
        if recorder.zeros:
            torch._foreach_zero_(recorder.zeros)
        if recorder.copy_dst:
            torch._foreach_copy_(recorder.copy_dst, recorder.copy_src, non_blocking=True)
        for layer_write in batch.eager:
            layer_write()
        counts = WriteCounts(
            batch.recorded,
            batch.replayed,
            len(batch.eager),
            tuple(recorder.copy_dst),
            tuple(_sources(batch.eager)),
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
        """Replay the layer's plan, or record its write (entering the
        recorder's mode at the first recording: a write that only replays
        never pays for it), or leave it to run as vLLM runs it."""
        layer = self._layers[name]
        layer_write: LayerWrite
        if lora_a is None:
            layer_write = functools.partial(layer.reset_lora, index)
        else:
            layer_write = functools.partial(layer.set_lora, index, lora_a, lora_b)
        if name in self._unbatched:  # not recorded again: it would half-run first
            batch.eager.append(layer_write)
            return
        try:
            key = (name, index, (_signature(lora_a), _signature(lora_b)))
            plan = self._plans.get(key)
            if plan is not None:
                batch.replay(plan, lora_a, lora_b)
                return
            recorder = batch.recorder
            if not batch.recording:
                recording.enter_context(recorder)
                batch.recording = True
            attributes = {k: id(v) for k, v in vars(layer).items()}
            marks = recorder.record(self._views[name], layer_write)
            batch.recorded += 1
        except _Unbatchable as why:
            self._unbatched.add(name)
            logger.info("slot writes of layer %s not batched: %s", name, why)
            batch.eager.append(layer_write)
            return
        if attributes == {k: id(v) for k, v in vars(layer).items()}:
            plan = self._plan_of(recorder, marks, _inputs(lora_a, lora_b))
            if plan is not None:
                self._plans[key] = plan

    @staticmethod
    def _plan_of(
        recorder: _Recorder,
        marks: tuple[int, int],
        inputs: dict[int, _InputPath],
    ) -> _Plan | None:
        """The layer's recorded write as a plan, if it wrote tensors at all (a
        write with none works through other means, which a plan would skip)
        and every copy read a given tensor as it was given (not a slice or a
        product of one)."""
        if len(recorder.zeros) == marks[0] and len(recorder.copy_dst) == marks[1]:
            return None
        copies = []
        for dst, src in zip(recorder.copy_dst[marks[1] :], recorder.copy_src[marks[1] :]):
            path = inputs.get(id(src))
            if path is None:
                return None
            copies.append((dst, path))
        return _Plan(tuple(recorder.zeros[marks[0] :]), tuple(copies))
