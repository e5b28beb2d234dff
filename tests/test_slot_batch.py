"""Batched slot writes (``skyrl_lora.server.weights.slot_batch``) on vLLM's real LoRA layers.

What must hold: a slot written through the recorder holds exactly what
vLLM's own ``set_lora`` / ``reset_lora`` leave there, write after write into
the same slot (a lower rank after a higher one, a reset after weights); every
linear layer kind vLLM uses is batched, so a vLLM change that stops it shows
here rather than as a slower swap; and a layer that does something the
recorder does not reorder is written the usual way, correctly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
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
from skyrl_lora.server.weights.slot_batch import BatchedSlotWriter, WriteCounts  # noqa: E402

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
            a, b = random_lora_weights(eager, rank, seed)
            eager.set_lora(index, a, b)
            weights.append((name, a, b))
    counts: WriteCounts = pair["writer"].write(index, weights)
    return counts


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
    # recorded the first time a slot sees a shape, and replayed after.
    assert _write_both(pair, 0, MAX_RANK, seed=1) == WriteCounts(recorded=layers)
    for rank, seed, counts in (
        (MAX_RANK, 2, WriteCounts(recorded=layers)),
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
