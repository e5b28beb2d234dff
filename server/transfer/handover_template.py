"""Build a handed-over adapter's vLLM model from the last one of its layout.

A trainer hands over the same adapter every step: the same tensor names,
shapes, dtypes and offsets in its flat buffer, the same config; only the
numbers change. vLLM's loader and the model manager's packing nevertheless
rebuild the whole ``LoRAModel`` each time, a few Python calls per tensor,
and while the engine steps the staging thread runs them in short slices
between naps (:mod:`.staging_yield`): on an H100 a rank-16 hand-over of the
0.8B perf model staged in 40 ms idle and 140 ms under load, 73 ms of it naps.

So the first hand-over of a layout goes through vLLM as before, and its
packed model is kept as a :class:`HandoverTemplate`: for every layer, the
weights object and, for each of its tensors, the place in the host buffer
it is a view of. The next hand-over of that layout gets its model by
re-pointing those views at its own buffer and folding the scalings the
first one folded (one multiply per factor). No file is opened, no name
parsed, no yield point passed.

The views are made a run at a time (:class:`_Run`): the same tensor of
every layer (layer 0's q_proj A, layer 1's, ...) lies at one stride in the
buffer, so one ``as_strided`` of all of them and one ``unbind`` give the
run's views: 28 tensor calls for the 8B model's rank-64 adapter, not 448.
Each tensor call lets the GIL go and must win it back from the engine's
step loop; under load on an H100 the 448 views of one hand-over took 2.3 s
of 16 s of sampled staging time, half of it waiting for the GIL (py-spy
``--native``, 3b61c2a). The run's stacked views also cover every byte of
the model's weights, so the finite check reads them (:attr:`Instance.cover`):
one norm per run, not per tensor.

A layout is only templated when every tensor of the packed model is a view
of the buffer (vLLM neither converted nor copied any) and every scaling was
folded by :func:`skyrl_lora.server.compat.fold_lora_scalings`; anything else
keeps going through vLLM, so the template never changes what is built, only
how long it takes. ``tests/test_handover_template.py`` checks that a model
from a template equals vLLM's, tensor for tensor, on the installed vLLM.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from .. import compat
from ..adapters.scale_fold import multiply_in_place

logger = logging.getLogger("vllm.skyrl_lora.handover_template")

#: How many layouts a worker keeps templates of (one per tenant's adapter shape).
MAX_TEMPLATES = 64


@dataclass(frozen=True)
class _Leaf:
    """Where one of the model's tensors lies in the host buffer (in elements of its dtype)."""

    dtype: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


#: A weights attribute: one leaf, a list of leaves (None for an absent slice).
_Field = _Leaf | tuple[_Leaf | None, ...]


@dataclass(frozen=True)
class _Run:
    """Leaves of one dtype, size and stride, ``step`` elements apart from
    ``leaves[0]``'s offset on: one strided view of all, unbound into each."""

    leaves: tuple[_Leaf, ...]
    step: int


def _runs(layers: list[tuple[str, Any, dict[str, _Field]]]) -> tuple[_Run, ...]:
    """Every leaf in one run: each place in a layer (its name with the layer
    number out, the attribute, the slice) across the layers, cut where the
    shape or the spacing changes."""
    by_place: dict[tuple[str, str, int], list[_Leaf]] = {}
    for name, _, fields in layers:
        place = re.sub(r"\.\d+\.", ".#.", name)
        for attribute, field in fields.items():
            for i, leaf in enumerate((field,) if isinstance(field, _Leaf) else field):
                if leaf is not None:
                    by_place.setdefault((place, attribute, i), []).append(leaf)
    runs: list[_Run] = []
    seen: set[_Leaf] = set()  # a leaf two places share is made once
    for leaves in by_place.values():
        current: list[_Leaf] = []
        for leaf in sorted(set(leaves) - seen, key=lambda leaf: leaf.offset):
            if current and not _continues(current, leaf):
                runs.append(_run_of(current))
                current = []
            current.append(leaf)
        if current:
            runs.append(_run_of(current))
        seen.update(leaves)
    return tuple(runs)


def _continues(run: list[_Leaf], leaf: _Leaf) -> bool:
    first = run[0]
    if (leaf.dtype, leaf.size, leaf.stride) != (first.dtype, first.size, first.stride):
        return False
    return len(run) == 1 or leaf.offset - run[-1].offset == run[1].offset - first.offset


def _run_of(leaves: list[_Leaf]) -> _Run:
    return _Run(tuple(leaves), leaves[1].offset - leaves[0].offset if len(leaves) > 1 else 0)


@dataclass(frozen=True)
class Instance:
    """A model made from a template, and views that cover all its weights."""

    model: Any
    #: One tensor per run, together every element of the model's weights
    #: once: what a check of all of them needs to read.
    cover: tuple[Any, ...]


class NotTemplatable(Exception):
    """vLLM built this model in a way a template would not reproduce."""


def layout_key(description: dict[str, Any], config_text: str, extra: Any = None) -> str:
    """What a model's build depends on besides the numbers: the config, the
    tensors' names, dtypes, shapes and offsets, the buffer's size."""
    tensors = [
        (t["name"], t["dtype"], tuple(t["shape"]), t["offset"]) for t in description["tensors"]
    ]
    text = json.dumps([config_text, tensors, description["buffer"]["nbytes"], repr(extra)])
    return hashlib.sha256(text.encode()).hexdigest()


class HandoverTemplate:
    """A packed model's structure, re-pointable at another buffer of the same layout."""

    def __init__(
        self,
        skeleton: Any,
        layers: list[tuple[str, Any, dict[str, _Field]]],
        folds: list[tuple[float, tuple[_Leaf, ...]]],
    ) -> None:
        self._skeleton = skeleton
        self._layers = layers
        self._folds = folds
        self._runs = _runs(layers)

    @classmethod
    def of(cls, model: Any, buffer: Any, folded: dict[float, list[Any]] | None) -> HandoverTemplate:
        """The template of ``model`` (packed, scalings folded as ``folded``
        says), built from views of ``buffer``; :class:`NotTemplatable` if it was not."""
        if folded is None:
            raise NotTemplatable("a layer's scaling was folded by its own optimize()")
        if getattr(model, "modules_to_save", None):
            raise NotTemplatable("the adapter has fully trained modules")
        storage = buffer.untyped_storage().data_ptr()
        leaves: dict[int, _Leaf] = {}

        def leaf(tensor: Any) -> _Leaf:
            if tensor.untyped_storage().data_ptr() != storage:
                raise NotTemplatable("a tensor is not a view of the handed-over buffer")
            spec = _Leaf(
                tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
            )
            leaves[id(tensor)] = spec
            return spec

        layers = []
        for name, weights in compat.lora_model_layers(model).items():
            fields: dict[str, _Field] = {}
            for attribute, value in vars(weights).items():
                if isinstance(value, torch.Tensor):
                    fields[attribute] = leaf(value)
                elif isinstance(value, (list, tuple)) and any(
                    isinstance(v, torch.Tensor) for v in value
                ):
                    if not all(v is None or isinstance(v, torch.Tensor) for v in value):
                        raise NotTemplatable(f"{name}.{attribute} mixes tensors and other values")
                    fields[attribute] = tuple(None if v is None else leaf(v) for v in value)
            blank = copy.copy(weights)
            for attribute in fields:
                setattr(blank, attribute, None)
            layers.append((name, blank, fields))
        folds = []
        for factor, products in folded.items():
            try:
                folds.append((factor, tuple(leaves[id(t)] for t in products)))
            except KeyError:
                raise NotTemplatable("a folded B is not among the packed model's tensors") from None
        return cls(compat.lora_model_skeleton(model), layers, folds)

    def instantiate(self, buffer: Any, lora_model_id: int, device: Any = None) -> Instance:
        """The model for ``buffer`` (the same layout, other numbers), scalings
        folded into it in place (on ``device``'s GPU where there is one, or
        on the buffer's own GPU, see :mod:`.scale_fold`), as vLLM's packing
        would have left it."""
        view = _Viewer(buffer, self._runs)
        layers = {}
        for name, blank, fields in self._layers:
            weights = copy.copy(blank)
            self._point(weights, fields, view)
            layers[name] = weights
        for factor, products in self._folds:
            multiply_in_place([view(s) for s in products], factor, device)
        model = compat.lora_model_from_skeleton(self._skeleton, lora_model_id, layers)
        return Instance(model, view.cover)

    def repoint(self, model: Any, buffer: Any) -> None:
        """Point ``model`` (built by :meth:`instantiate`) at ``buffer``, a copy
        of the buffer it was built on, already folded: nothing is multiplied.

        A hand-over staged on the GPU serves from device memory until the
        swap is done; then its host copy takes over (:mod:`.staging`), which
        is what vLLM's CPU cache should hold. Each tensor attribute is
        replaced whole, so a reader sees the old tensor or the new one, both
        with the same numbers.
        """
        view = _Viewer(buffer, self._runs)
        layers = compat.lora_model_layers(model)
        for name, _, fields in self._layers:
            self._point(layers[name], fields, view)

    @staticmethod
    def _point(weights: Any, fields: dict[str, _Field], view: _Viewer) -> None:
        for attribute, field in fields.items():
            if isinstance(field, _Leaf):
                setattr(weights, attribute, view(field))
            else:
                setattr(weights, attribute, [None if s is None else view(s) for s in field])


class _Viewer:
    """Views of one buffer by leaf, made a run at a time up front (a leaf
    shared by two layers, or by a layer and a fold, is one tensor, as in
    vLLM's build)."""

    def __init__(self, buffer: Any, runs: tuple[_Run, ...]) -> None:
        self._buffer = buffer
        self._views: dict[_Leaf, Any] = {}
        self._typed: dict[Any, Any] = {}
        cover = []
        for run in runs:
            first = run.leaves[0]
            whole = self._whole(first.dtype)
            if len(run.leaves) == 1:
                self._views[first] = whole.as_strided(first.size, first.stride, first.offset)
                cover.append(self._views[first])
                continue
            stacked = whole.as_strided(
                (len(run.leaves), *first.size), (run.step, *first.stride), first.offset
            )
            self._views.update(zip(run.leaves, stacked.unbind(0), strict=True))
            cover.append(stacked)
        self.cover = tuple(cover)

    def _whole(self, dtype: Any) -> Any:
        whole = self._typed.get(dtype)
        if whole is None:
            buffer = self._buffer
            itemsize = torch.empty((), dtype=dtype).element_size()
            usable = buffer.numel() - buffer.numel() % itemsize
            whole = self._typed[dtype] = buffer[:usable].view(dtype)
        return whole

    def __call__(self, spec: _Leaf) -> Any:
        return self._views[spec]


class HandoverTemplates:
    """A worker's templates by layout (:func:`layout_key`), oldest dropped first."""

    def __init__(self, capacity: int = MAX_TEMPLATES) -> None:
        self._capacity = capacity
        self._templates: dict[str, HandoverTemplate | None] = {}

    def get(self, key: str) -> HandoverTemplate | None:
        return self._templates.get(key)

    def known(self, key: str) -> bool:
        """Whether ``key`` was seen (a template, or found not templatable)."""
        return key in self._templates

    def learn(
        self, key: str, model: Any, buffer: Any, folded: dict[float, list[Any]] | None
    ) -> bool:
        """Keep ``model``'s template under ``key``; False (and remembered) when it has none."""
        try:
            template: HandoverTemplate | None = HandoverTemplate.of(model, buffer, folded)
        except NotTemplatable as why:
            logger.info("skyrl-lora builds every hand-over of this layout with vLLM: %s", why)
            template = None
        if len(self._templates) >= self._capacity:
            self._templates.pop(next(iter(self._templates)))
        self._templates[key] = template
        return template is not None
