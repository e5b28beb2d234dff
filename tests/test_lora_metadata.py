"""The LoRA kernels' metadata prepared on the host must equal vLLM's own.

vLLM's ``LoRAKernelMeta.prepare_tensors`` runs here on CPU tensors (the same
code that syncs on a GPU), and :mod:`skyrl_lora.server.lora_metadata` fills a
second metadata object from the host mapping; every buffer the kernels read
must come out the same: the mapping, the tokens sorted by slot, the slots
present, the tokens per slot, their start offsets, the no-adapter flag and
the active count rounded to a captured CUDA-graph size. The GPU run
(``gpu_tests/test_gpu_lora_metadata.py``) checks the tokens sampled.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from skyrl_lora.server import lora_metadata

LoRAKernelMeta = pytest.importorskip("vllm.lora.ops.triton_ops.lora_kernel_metadata").LoRAKernelMeta

MAX_LORAS = 8
MAX_TOKENS = 512
CAPTURED = [1, 2, 4, 8, 9]


def _metas() -> tuple[Any, Any]:
    return (
        LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu", CAPTURED),
        LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, "cpu", CAPTURED),
    )


def _assert_same(vllm_meta: Any, host_meta: Any, n: int) -> None:
    assert bool(host_meta.no_lora_flag_cpu[0]) == bool(vllm_meta.no_lora_flag_cpu[0])
    if bool(vllm_meta.no_lora_flag_cpu[0]):
        return
    for name in ("token_lora_mapping", "token_indices_sorted_by_lora_ids"):
        assert torch.equal(getattr(host_meta, name)[:n], getattr(vllm_meta, name)[:n]), name
    for name in ("active_lora_ids", "num_tokens_per_lora", "lora_token_start_loc"):
        assert torch.equal(getattr(host_meta, name), getattr(vllm_meta, name)), name
    assert int(host_meta.num_active_loras_cpu[0]) == int(vllm_meta.num_active_loras_cpu[0])


# Adapter ids as the engine gives them (0: the base model), and the slots
# they occupy (None: an empty slot).
SLOTS = [None, 17, 3, None, 42, 5, 8, 99]


@pytest.mark.parametrize("seed", range(12))
def test_host_metadata_equals_vllms_for_mixed_batches(seed: int) -> None:
    rng = random.Random(seed)
    loaded = [i for i in SLOTS if i is not None]
    present = rng.sample(loaded, rng.randint(1, len(loaded)))
    base_share = rng.choice([0.0, 0.3])
    n = rng.randint(1, MAX_TOKENS)
    ids = [0 if rng.random() < base_share else rng.choice(present) for _ in range(n)]
    table = lora_metadata.slot_table(SLOTS)
    slots = lora_metadata.slots_of(ids, table)
    assert slots.tolist() == [table[i] if i > 0 else -1 for i in ids]

    vllm_meta, host_meta = _metas()
    vllm_meta.prepare_tensors(slots.to(torch.int64))
    lora_metadata.write(host_meta, lora_metadata.plan(slots, CAPTURED))
    _assert_same(vllm_meta, host_meta, n)


@pytest.mark.parametrize(
    "n", [1, lora_metadata.LIST_PLAN_MAX, lora_metadata.LIST_PLAN_MAX + 1, MAX_TOKENS]
)
def test_both_ways_of_planning_equal_vllms_on_either_side_of_the_switch(n, monkeypatch) -> None:
    """Plans of up to ``LIST_PLAN_MAX`` tokens are made on Python lists, larger
    ones with torch: each equals vLLM's, and the two ways agree on each size."""
    rng = random.Random(n)
    table = lora_metadata.slot_table(SLOTS)
    ids = [rng.choice([0, 17, 3, 42, 99]) for _ in range(n)]
    slots = lora_metadata.slots_of(ids, table)
    assert slots.tolist() == [table[i] if i > 0 else -1 for i in ids]
    vllm_meta, host_meta = _metas()
    vllm_meta.prepare_tensors(slots.to(torch.int64))
    step = lora_metadata.plan(slots, CAPTURED)
    lora_metadata.write(host_meta, step)
    _assert_same(vllm_meta, host_meta, n)

    listed = n <= lora_metadata.LIST_PLAN_MAX  # so the other way is torch's, and back
    monkeypatch.setattr(lora_metadata, "LIST_PLAN_MAX", -1 if listed else MAX_TOKENS)
    assert lora_metadata.slots_of(ids, table).tolist() == slots.tolist()
    other = lora_metadata.plan(slots, CAPTURED)
    for name in ("sorted_by_slot", "active_slots", "tokens_per_slot", "start_loc"):
        assert torch.equal(getattr(other, name), getattr(step, name)), name
    assert (other.no_lora, other.num_active) == (step.no_lora, step.num_active)


def test_a_batch_of_the_base_model_only_sets_the_no_adapter_flag() -> None:
    vllm_meta, host_meta = _metas()
    slots = lora_metadata.slots_of([0] * 40, lora_metadata.slot_table(SLOTS))
    vllm_meta.prepare_tensors(slots.to(torch.int64))
    lora_metadata.write(host_meta, lora_metadata.plan(slots, CAPTURED))
    assert bool(host_meta.no_lora_flag_cpu[0])
    _assert_same(vllm_meta, host_meta, 40)


class _Mapping:
    def __init__(self, index_mapping: list[int], prompt_mapping: list[int]) -> None:
        self.index_mapping = tuple(index_mapping)
        self.prompt_mapping = tuple(prompt_mapping)


class _Punica:
    """The two metadata objects and the ``update_metadata`` call shape of
    vLLM's ``PunicaWrapperGPU``: it prepares each from the device copy."""

    def __init__(self) -> None:
        self.token_mapping_meta, self.prompt_mapping_meta = _metas()
        self.device_lengths: tuple[int, int] | None = None

    def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], *_: Any) -> None:
        table = lora_metadata.slot_table(lora_index_to_id)
        tokens = torch.tensor([table.get(i, -1) for i in mapping.index_mapping])
        rows = torch.tensor([table.get(i, -1) for i in mapping.prompt_mapping])
        if self.device_lengths is not None:  # the engine's tensors disagree with the mapping
            tokens, rows = tokens[: self.device_lengths[0]], rows[: self.device_lengths[1]]
        self.token_mapping_meta.prepare_tensors(tokens)
        self.prompt_mapping_meta.prepare_tensors(rows)


def test_install_fills_both_metadata_objects_from_the_host_mapping() -> None:
    punica = _Punica()
    hooks = lora_metadata.install(punica)
    assert lora_metadata.install(punica) is hooks  # once
    mapping = _Mapping([17, 17, 3, 0, 42, 3], [17, 3, 42])
    punica.update_metadata(mapping, SLOTS, MAX_LORAS, 1000)
    assert hooks.host_steps == 1 and hooks.fallbacks == 0
    expected_tokens, expected_rows = _metas()
    table = lora_metadata.slot_table(SLOTS)
    expected_tokens.prepare_tensors(torch.tensor([table.get(i, -1) for i in mapping.index_mapping]))
    expected_rows.prepare_tensors(torch.tensor([table[i] for i in mapping.prompt_mapping]))
    _assert_same(expected_tokens, punica.token_mapping_meta, 6)
    _assert_same(expected_rows, punica.prompt_mapping_meta, 3)


def test_a_mapping_of_another_length_than_the_device_tensor_falls_back_to_vllm() -> None:
    punica = _Punica()
    hooks = lora_metadata.install(punica)
    punica.device_lengths = (4, 3)
    punica.update_metadata(_Mapping([17, 17, 3, 0, 42, 3], [17, 3, 42]), SLOTS)
    assert hooks.tokens.fallbacks == 1 and hooks.rows.fallbacks == 0
    assert punica.token_mapping_meta.token_lora_mapping[:4].tolist() == [1, 1, 2, -1]
