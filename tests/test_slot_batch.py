"""Batched slot writes (``skyrl_lora.server.slot_batch``) on vLLM's real LoRA layers.

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

from skyrl_lora.server.slot_batch import BatchedSlotWriter  # noqa: E402

SLOTS = 3
MAX_RANK = 16


@pytest.fixture(scope="module")
def vllm_layers(tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """Builds each layer kind twice (one written eagerly, one batched) in a
    one-process, tensor-parallel-size-1 group, as vLLM's own layer tests do."""
    from vllm import distributed
    from vllm.config import LoRAConfig, VllmConfig, set_current_vllm_config
    from vllm.lora import layers
    from vllm.model_executor.layers import linear

    def build() -> dict[str, Any]:
        built = {
            "qkv_proj": layers.MergedQKVParallelLinearWithLoRA(
                linear.QKVParallelLinear(64, 16, 4, 2, bias=False)
            ),
            "o_proj": layers.RowParallelLinearWithLoRA(linear.RowParallelLinear(64, 64)),
            "gate_up_proj": layers.MergedColumnParallelLinearWithLoRA(
                linear.MergedColumnParallelLinear(64, [96, 96], bias=False)
            ),
            "down_proj": layers.RowParallelLinearWithLoRA(linear.RowParallelLinear(96, 64)),
            "lm_extra": layers.ColumnParallelLinearWithLoRA(linear.ColumnParallelLinear(64, 80)),
        }
        config = LoRAConfig(max_lora_rank=MAX_RANK, max_loras=SLOTS, lora_dtype=torch.float32)
        for layer in built.values():
            layer.create_lora_weights(SLOTS, config, None)
        return built

    rendezvous = tmp_path_factory.mktemp("gloo") / "rendezvous"
    with set_current_vllm_config(VllmConfig()):
        distributed.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{rendezvous}",
            backend="gloo",
        )
        distributed.initialize_model_parallel(1, 1)
        try:
            yield {"eager": build(), "batched": build()}
        finally:
            distributed.destroy_model_parallel()
            distributed.destroy_distributed_environment()


def _weights(layer: Any, rank: int, seed: int) -> tuple[Any, Any]:
    """Random A and B of ``rank`` for every slice, shaped as vLLM's loader hands them."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(rank, t.shape[-1], generator=gen) for t in layer.lora_a_stacked]
    b = [torch.randn(t.shape[-2], rank, generator=gen) for t in layer.lora_b_stacked]
    return (a[0], b[0]) if len(a) == 1 else (a, b)


def _write_both(pair: dict[str, Any], index: int, rank: int | None, seed: int) -> int:
    """One slot write into both copies: vLLM's own calls, and the batch."""
    writes = []
    for name, eager in pair["eager"].items():
        batched = pair["batched"][name]
        if rank is None:
            eager.reset_lora(index)
            writes.append((name, functools.partial(batched.reset_lora, index)))
        else:
            a, b = _weights(eager, rank, seed)
            eager.set_lora(index, a, b)
            writes.append((name, functools.partial(batched.set_lora, index, a, b)))
    return pair["writer"].write(writes)


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
    # then a reset; slot 0 keeps its adapter throughout.
    assert _write_both(pair, 0, MAX_RANK, seed=1) == layers
    for rank, seed in ((MAX_RANK, 2), (8, 3), (None, 0), (4, 4)):
        assert _write_both(pair, 1, rank, seed) == layers
        _assert_same_slots(pair)
    assert pair["batched"]["o_proj"].lora_a_stacked[0][1, 0, 4:].abs().sum() == 0
    assert pair["batched"]["o_proj"].lora_a_stacked[0][0].abs().sum() > 0


def test_a_layer_the_recorder_cannot_reorder_is_written_as_vllm_writes_it(
    pair: dict[str, Any],
) -> None:
    # A layer whose set_lora scales B in place after copying it: not a
    # zeroing, not a copy, so the recorder must leave the whole layer to run.
    for side in ("eager", "batched"):
        layer = pair[side]["down_proj"]
        layer.set_lora = functools.partial(_set_then_scale, layer)
    try:
        assert _write_both(pair, 2, 8, seed=5) == len(pair["batched"]) - 1
        _assert_same_slots(pair)
        assert pair["batched"]["down_proj"].lora_b_stacked[0][2].abs().sum() > 0
    finally:
        for side in ("eager", "batched"):
            del pair[side]["down_proj"].set_lora


def _set_then_scale(layer: Any, index: int, a: Any, b: Any) -> None:
    type(layer).set_lora(layer, index, a, b)
    layer.lora_b_stacked[0][index].mul_(2.0)
