"""A hand-over's model built from its layout's template equals vLLM's own build.

vLLM's ``LoRAModel.from_lora_tensors`` and ``PackedLoRALayerWeights.pack``
(the installed vLLM's) build a packed model from views of one buffer; its
template, pointed at a second buffer of the same layout, must give what
vLLM builds from that second buffer, tensor for tensor and scaling for
scaling. The engine test (``test_handover_engine``) checks the same end to
end, by the tokens served.
"""

from __future__ import annotations

import pytest
import torch
from vllm.lora.lora_model import LoRAModel
from vllm.lora.lora_weights import PackedLoRALayerWeights
from vllm.lora.peft_helper import PEFTHelper

from skyrl_lora.client import AdapterHandover
from skyrl_lora.server import compat
from skyrl_lora.server.adapters.finite_check import nonfinite_count
from skyrl_lora.server.adapters.scale_fold import multiply_in_place
from skyrl_lora.server.transfer import handover
from skyrl_lora.server.transfer.handover_template import (
    HandoverTemplate,
    HandoverTemplates,
    NotTemplatable,
    layout_key,
)
from skyrl_lora.server.transfer.tensor_pickle import host_buffers

pytest.importorskip("vllm")

CONFIG = {
    "r": 4,
    "lora_alpha": 8,  # scaling 2: B is folded
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "peft_type": "LORA",
}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def adapter_tensors(seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, out in (("q_proj", 16), ("k_proj", 8), ("v_proj", 8), ("o_proj", 16)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, 16, generator=gen).bfloat16()
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, 4, generator=gen).bfloat16()
    return tensors


def handed_over(seed: int) -> tuple[dict, torch.Tensor]:
    """A hand-over's description and the server's copy of its buffer."""
    with AdapterHandover(CONFIG) as adapter:
        adapter.update(adapter_tensors(seed))
        request = adapter.request()
        (host,) = handover.copy_out(request, host_buffers(False), handover.cuda_device_index)
    return request, host


def vllm_build(description: dict, host: torch.Tensor, lora_id: int):
    """vLLM's model from views of ``host``, scalings folded and packed as the
    model manager packs (q/k/v into one layer)."""
    model = LoRAModel.from_lora_tensors(
        lora_id,
        handover.tensor_views(host, description),
        PEFTHelper.from_dict(CONFIG),
        device="cpu",
        dtype=torch.bfloat16,
    )
    folded = compat.fold_lora_scalings(model, multiply_in_place)
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn."
        parts = [model.loras.pop(prefix + name) for name in PACKED["qkv_proj"]]
        model.loras[prefix + "qkv_proj"] = PackedLoRALayerWeights.pack(parts)
    return model, folded


def flat(weights) -> list[torch.Tensor]:
    out = []
    for value in (weights.lora_a, weights.lora_b):
        out.extend(value if isinstance(value, list) else [value])
    return out


def test_a_template_builds_what_vllm_builds_from_the_next_buffer() -> None:
    first, first_host = handed_over(0)
    model, folded = vllm_build(first, first_host, lora_id=1)
    template = HandoverTemplate.of(model, first_host, folded)

    second, second_host = handed_over(1)
    built = template.instantiate(second_host.clone(), lora_model_id=7).model
    expected, _ = vllm_build(second, second_host, lora_id=7)

    assert built.id == 7 and built.rank == expected.rank
    assert built.loras.keys() == expected.loras.keys()
    for name, weights in expected.loras.items():
        mine = built.loras[name]
        assert type(mine) is type(weights)
        assert mine.scaling == weights.scaling and mine.rank == weights.rank
        for got, want in zip(flat(mine), flat(weights), strict=True):
            assert torch.equal(got, want), name
    # the first model is untouched by the second (its own buffer)
    again, _ = vllm_build(first, handed_over(0)[1], lora_id=1)
    for name, weights in again.loras.items():
        for got, want in zip(flat(model.loras[name]), flat(weights), strict=True):
            assert torch.equal(got, want)


def test_a_model_with_copies_or_unfolded_scalings_gets_no_template() -> None:
    description, host = handed_over(0)
    model, folded = vllm_build(description, host, lora_id=1)
    with pytest.raises(NotTemplatable, match="optimize"):
        HandoverTemplate.of(model, host, None)
    name = next(iter(model.loras))
    model.loras[name].lora_a = model.loras[name].lora_a.clone()  # not a view any more
    with pytest.raises(NotTemplatable, match="not a view"):
        HandoverTemplate.of(model, host, folded)
    templates = HandoverTemplates(capacity=1)
    assert not templates.learn("k", model, host, folded)
    assert templates.known("k") and templates.get("k") is None


def test_the_layout_key_tells_layouts_and_configs_apart() -> None:
    description, _ = handed_over(0)
    other, _ = handed_over(1)
    assert layout_key(description, "{}") == layout_key(other, "{}")  # numbers do not count
    assert layout_key(description, "{}") != layout_key(description, '{"r": 8}')
    moved = {**description, "tensors": [{**description["tensors"][0], "offset": 64}]}
    assert layout_key(description, "{}") != layout_key(moved, "{}")


def test_repoint_moves_a_built_model_onto_a_copy_of_its_buffer_unscaled() -> None:
    first, first_host = handed_over(0)
    model, folded = vllm_build(first, first_host, lora_id=1)
    template = HandoverTemplate.of(model, first_host, folded)
    second, second_host = handed_over(1)
    buffer = second_host.clone()
    built = template.instantiate(buffer, lora_model_id=7).model
    copy = buffer.clone()  # after the fold: repoint must not fold again
    buffer.zero_()
    template.repoint(built, copy)
    expected, _ = vllm_build(second, second_host, lora_id=7)
    storage = copy.untyped_storage().data_ptr()
    for name, weights in expected.loras.items():
        for got, want in zip(flat(built.loras[name]), flat(weights), strict=True):
            assert got.untyped_storage().data_ptr() == storage, name
            assert torch.equal(got, want), name


def test_a_template_views_a_run_at_once_and_its_cover_holds_every_weight() -> None:
    first, first_host = handed_over(0)
    model, folded = vllm_build(first, first_host, lora_id=1)
    template = HandoverTemplate.of(model, first_host, folded)
    _, second_host = handed_over(1)
    instance = template.instantiate(second_host.clone(), lora_model_id=7)
    weights = [t for w in instance.model.loras.values() for t in flat(w)]
    # one run per place in a layer (q, k, v and o_proj's A and B), across both layers
    assert len(instance.cover) == 8 and len(weights) == 16
    assert sum(t.numel() for t in instance.cover) == sum(t.numel() for t in weights)
    covered = {(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in weights}
    for run in instance.cover:  # each run's rows are weights, and nothing else
        rows = {(r.data_ptr(), r.data_ptr() + r.numel() * r.element_size()) for r in run}
        assert rows <= covered
    assert nonfinite_count(instance.cover) == 0
    weights[-1].view(-1)[0] = float("inf")  # a bad weight anywhere is in the cover
    weights[0].view(-1)[-1] = float("nan")
    assert nonfinite_count(instance.cover) == 2
