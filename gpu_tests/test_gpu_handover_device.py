"""A hand-over staged in GPU memory builds what vLLM builds on the host.

From the second hand-over of a layout on, a trainer's GPU buffer is copied
device to device and its model built, folded and written into its slot on
the GPU (:mod:`skyrl_lora.server.loading.staging`); after the swap the
model is pointed at its host copy. Both models must equal vLLM's own build
of the same weights on the host (the installed CUDA vLLM's loader and
packing, the host fold), tensor for tensor. No server; a few seconds.
"""

from __future__ import annotations

import torch

from skyrl_lora.server.transfer.handover_template import HandoverTemplate
from tests.test_handover_template import flat, handed_over, vllm_build


def pinned_handover(seed: int) -> tuple[dict, torch.Tensor]:
    """As the engine copies a hand-over out on a GPU machine: into pinned
    memory (vLLM pins a loaded adapter's tensors there, which copies any
    tensor not pinned already, and a copy is no view of the buffer)."""
    description, host = handed_over(seed)
    return description, host.pin_memory()


def test_a_model_built_on_the_gpu_and_settled_on_the_host_equals_vllms() -> None:
    first, first_host = pinned_handover(0)
    model, folded = vllm_build(first, first_host, lora_id=1)
    template = HandoverTemplate.of(model, first_host, folded)

    second, second_host = pinned_handover(1)
    expected, _ = vllm_build(second, second_host.clone(), lora_id=7)
    on_device = second_host.to("cuda:0")
    built = template.instantiate(on_device, lora_model_id=7, device="cuda:0").model
    torch.cuda.synchronize()

    assert built.loras.keys() == expected.loras.keys()
    for name, weights in expected.loras.items():
        for got, want in zip(flat(built.loras[name]), flat(weights), strict=True):
            assert got.is_cuda, name
            assert torch.equal(got.cpu(), want), name

    settled = on_device.cpu()  # the host copy made after the swap: already folded
    template.repoint(built, settled)
    storage = settled.untyped_storage().data_ptr()
    for name, weights in expected.loras.items():
        for got, want in zip(flat(built.loras[name]), flat(weights), strict=True):
            assert not got.is_cuda and got.untyped_storage().data_ptr() == storage, name
            assert torch.equal(got, want), name
