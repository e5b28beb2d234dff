"""Batched slot writes (``skyrl_lora.server.loading.slot_batch``) on vLLM's real LoRA layers.

What must hold: a slot written through the recorder holds exactly what
vLLM's own ``set_lora`` / ``reset_lora`` leave there, write after write into
the same slot (a lower rank after a higher one, a reset after weights); every
linear layer kind vLLM uses is batched, so a vLLM change that stops it shows
here rather than as a slower swap; a plan recorded for one slot writes every
other slot without recording it again, as vLLM would have written it, but
only for a layer that picks the slot with the first element of its indexes;
and a layer that does something the recorder does not reorder is written the
usual way, correctly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.lora.layers")

from benchmarks.vllm_layers import (  # noqa: E402
    DecoderShape,
    decoder_lora_layers,
    random_lora_weights,
    single_process_group,
)
from skyrl_lora.server.loading.slot_batch import BatchedSlotWriter, WriteCounts  # noqa: E402

SLOTS = 3
MAX_RANK = 16
#: Two decoder blocks of a small model: every linear LoRA layer kind a
#: decoder has (fused qkv, fused gate_up, row-parallel o and down).
SHAPE = DecoderShape(hidden=64, intermediate=96, heads=4, kv_heads=2, layers=2)


@pytest.fixture(scope="module")
def vllm_layers(tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """Each layer twice: one copy written eagerly, one batched."""
    with single_process_group(tmp_path_factory.mktemp("gloo") / "rendezvous"):
        yield {
            side: decoder_lora_layers(SHAPE, SLOTS, MAX_RANK, torch.float32)
            for side in ("eager", "batched")
        }


def _write_both(pair: dict[str, Any], index: int, rank: int | None, seed: int) -> WriteCounts:
    """One slot write into both copies: vLLM's own calls, and the batch."""
    weights = []
    for name, eager in pair["eager"].items():
        if rank is None:
            eager.reset_lora(index)
            weights.append((name, None, None))
        else:
            a, b = _random_weights(eager, rank, seed)
            eager.set_lora(index, a, b)
            weights.append((name, a, b))
    counts: WriteCounts = pair["writer"].write(index, weights)
    return counts


def _random_weights(layer: Any, rank: int, seed: int) -> tuple[Any, Any]:
    """Shaped as vLLM's loader hands them to vLLM's layers; a test layer says its own shapes."""
    if isinstance(layer, _OddlyIndexedLayer):
        return layer.random_weights(rank, seed)
    return random_lora_weights(layer, rank, seed)


def _assert_same_slots(pair: dict[str, Any]) -> None:
    for name, eager in pair["eager"].items():
        batched = pair["batched"][name]
        for stacked in ("lora_a_stacked", "lora_b_stacked"):
            for want, got in zip(getattr(eager, stacked), getattr(batched, stacked)):
                assert torch.equal(want, got), (name, stacked)


@pytest.fixture
def pair(vllm_layers: dict[str, Any]) -> dict[str, Any]:
    for layer in (*vllm_layers["eager"].values(), *vllm_layers["batched"].values()):
        for index in range(SLOTS):
            layer.reset_lora(index)
    return {**vllm_layers, "writer": BatchedSlotWriter(vllm_layers["batched"])}


def test_batched_writes_leave_what_vllm_leaves_write_after_write(pair: dict[str, Any]) -> None:
    layers = len(pair["batched"])
    # Slot 1 gets rank 16, then rank 8 (the tail of rank 16 must be zeroed),
    # then a reset; slot 0 keeps its adapter throughout. Every layer kind is
    # recorded the first time any slot sees a shape, derived from that the
    # first time another slot sees it, and replayed after.
    assert _write_both(pair, 0, MAX_RANK, seed=1) == WriteCounts(recorded=layers)
    for rank, seed, counts in (
        (MAX_RANK, 2, WriteCounts(derived=layers)),
        (8, 3, WriteCounts(recorded=layers)),
        (MAX_RANK, 6, WriteCounts(replayed=layers)),
        (None, 0, WriteCounts(recorded=layers)),
        (8, 7, WriteCounts(replayed=layers)),
        (None, 0, WriteCounts(replayed=layers)),
        (4, 4, WriteCounts(recorded=layers)),
    ):
        assert _write_both(pair, 1, rank, seed) == counts, rank
        _assert_same_slots(pair)
    assert pair["batched"]["layers.0.o_proj"].lora_a_stacked[0][1, 0, 4:].abs().sum() == 0
    assert pair["batched"]["layers.0.o_proj"].lora_a_stacked[0][0].abs().sum() > 0


def test_a_write_that_is_not_only_tensor_writes_is_never_replayed() -> None:
    # A layer that keeps its slots in a dict: recording sees no tensor write,
    # so a replay would silently skip it; it must run every time.
    class _DictLayer:
        def __init__(self) -> None:
            self.slots: dict[int, Any] = {}

        def set_lora(self, index: int, a: Any, b: Any) -> None:
            self.slots[index] = (a, b)

        def reset_lora(self, index: int) -> None:
            self.slots[index] = None

    layer = _DictLayer()
    writer = BatchedSlotWriter({"d": layer})
    a, b = torch.ones(2, 3), torch.ones(4, 2)
    for want in ((a, b), None, (a, b), None):
        weights = (None, None) if want is None else want
        assert writer.write(0, [("d", *weights)]) == WriteCounts(recorded=1)
        held = layer.slots[0]
        assert held is None if want is None else held[0] is a and held[1] is b


def test_a_layer_the_recorder_cannot_reorder_is_written_as_vllm_writes_it(
    pair: dict[str, Any],
) -> None:
    # A layer whose set_lora scales B in place after copying it: not a
    # zeroing, not a copy, so the recorder must leave the whole layer to run.
    for side in ("eager", "batched"):
        layer = pair[side]["layers.1.down_proj"]
        layer.set_lora = functools.partial(_set_then_scale, layer)
    try:
        counts = _write_both(pair, 2, 8, seed=5)
        assert counts == WriteCounts(recorded=len(pair["batched"]) - 1, eager=1)
        _assert_same_slots(pair)
        counts = _write_both(pair, 2, 8, seed=9)  # the others replay; it stays eager
        assert counts == WriteCounts(replayed=len(pair["batched"]) - 1, eager=1)
        _assert_same_slots(pair)
        assert pair["batched"]["layers.1.down_proj"].lora_b_stacked[0][2].abs().sum() > 0
    finally:
        for side in ("eager", "batched"):
            del pair[side]["layers.1.down_proj"].set_lora


def _set_then_scale(layer: Any, index: int, a: Any, b: Any) -> None:
    type(layer).set_lora(layer, index, a, b)
    layer.lora_b_stacked[0][index].mul_(2.0)


def test_a_plan_recorded_for_one_slot_writes_every_other_slot(pair: dict[str, Any]) -> None:
    # The first write into a fresh slot was a recording per layer (70-105 ms
    # of GIL-held CPU on an 8B model): slot 0's plan must serve slots 1 and 2,
    # leaving there what vLLM's set_lora leaves, and slot 0 untouched.
    layers = len(pair["batched"])
    assert _write_both(pair, 0, MAX_RANK, seed=1) == WriteCounts(recorded=layers)
    for index, seed in ((1, 2), (2, 3)):
        assert _write_both(pair, index, MAX_RANK, seed) == WriteCounts(derived=layers), index
        _assert_same_slots(pair)
    assert _write_both(pair, 1, MAX_RANK, seed=4) == WriteCounts(replayed=layers)
    _assert_same_slots(pair)
    for layer in pair["batched"].values():
        for stacked in (*layer.lora_a_stacked, *layer.lora_b_stacked):
            assert all(stacked[index].abs().sum() > 0 for index in range(SLOTS))


def test_a_writer_told_not_to_move_plans_records_every_fresh_slot(
    pair: dict[str, Any],
) -> None:
    # benchmarks.slot_write's baseline: each fresh slot recorded, as before plans moved.
    layers = len(pair["batched"])
    pair["writer"] = BatchedSlotWriter(pair["batched"], move_plans=False)
    for index, seed in ((0, 1), (1, 2), (2, 3)):
        assert _write_both(pair, index, MAX_RANK, seed) == WriteCounts(recorded=layers), index
    assert _write_both(pair, 1, MAX_RANK, seed=4) == WriteCounts(replayed=layers)
    _assert_same_slots(pair)


def test_a_reset_recorded_for_one_slot_resets_every_other_slot(pair: dict[str, Any]) -> None:
    layers = len(pair["batched"])
    assert _write_both(pair, 0, None, 0) == WriteCounts(recorded=layers)
    assert _write_both(pair, 1, 8, seed=5) == WriteCounts(recorded=layers)
    assert _write_both(pair, 2, 8, seed=6) == WriteCounts(derived=layers)
    assert _write_both(pair, 1, None, 0) == WriteCounts(derived=layers)
    _assert_same_slots(pair)
    o_proj = pair["batched"]["layers.0.o_proj"]
    assert o_proj.lora_b_stacked[0][1].abs().sum() == 0
    assert o_proj.lora_b_stacked[0][2].abs().sum() > 0


#: Where a test layer puts the slot in its stacked tensors' indexes, given the
#: slot and the rows and columns a weight covers (None for all): the slot
#: not first, or first but as a literal that equals the first slot written
#: (0), or first and again later. A plan moved by changing the first element
#: would write the wrong place in each.
_ODD_INDEXINGS: dict[str, Callable[[int, Any, Any], tuple[Any, ...]]] = {
    "slot second": lambda slot, rows, cols: (slice(rows), slot, slice(cols)),
    "a literal first": lambda slot, rows, cols: (0, slot, slice(rows), slice(cols)),
    "slot twice": lambda slot, rows, cols: (slot, slot, slice(rows), slice(cols)),
}


class _OddlyIndexedLayer:
    """A one-slice LoRA layer that writes only its stacked tensors, as vLLM's
    do, through indexes that do not pick the slot with their first element."""

    IN, OUT = 6, 5

    def __init__(self, indexing: str) -> None:
        self.where = _ODD_INDEXINGS[indexing]
        slot_second = indexing == "slot second"

        def stacked(rows: int, cols: int) -> Any:
            shape = (rows, SLOTS, cols) if slot_second else (SLOTS, SLOTS, rows, cols)
            return torch.zeros(shape)

        self.lora_a_stacked = (stacked(MAX_RANK, self.IN),)
        self.lora_b_stacked = (stacked(self.OUT, MAX_RANK),)

    def random_weights(self, rank: int, seed: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(rank, self.IN, generator=gen), torch.randn(self.OUT, rank, generator=gen)

    def reset_lora(self, index: int) -> None:
        for stacked in (*self.lora_a_stacked, *self.lora_b_stacked):
            stacked[self.where(index, None, None)] = 0

    def set_lora(self, index: int, a: Any, b: Any) -> None:
        self.reset_lora(index)
        self.lora_a_stacked[0][self.where(index, *a.shape)].copy_(a)
        self.lora_b_stacked[0][self.where(index, *b.shape)].copy_(b)


@pytest.mark.parametrize("indexing", sorted(_ODD_INDEXINGS))
def test_a_layer_that_does_not_pick_the_slot_first_is_recorded_for_every_slot(
    pair: dict[str, Any], indexing: str
) -> None:
    # Beside one of vLLM's layers, which still derives: only the odd layer's
    # plan stays with its slot, and every slot it writes is where it belongs.
    real = "layers.0.o_proj"
    odd = {
        side: {"odd": _OddlyIndexedLayer(indexing), real: pair[side][real]}
        for side in ("eager", "batched")
    }
    odd["writer"] = BatchedSlotWriter(odd["batched"])
    assert _write_both(odd, 0, 8, seed=1) == WriteCounts(recorded=2)
    for index, seed in ((1, 2), (2, 3)):
        assert _write_both(odd, index, 8, seed) == WriteCounts(recorded=1, derived=1), index
        _assert_same_slots(odd)
    assert _write_both(odd, 1, 8, seed=4) == WriteCounts(replayed=2)
    assert _write_both(odd, 0, None, 0) == WriteCounts(recorded=2)
    assert _write_both(odd, 2, None, 0) == WriteCounts(recorded=1, derived=1)
    _assert_same_slots(odd)
    assert odd["batched"]["odd"].lora_a_stacked[0].abs().sum() > 0
