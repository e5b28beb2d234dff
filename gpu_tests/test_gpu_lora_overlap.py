"""The LoRA shrink on a second stream beside the base GEMM, on CUDA.

:func:`skyrl_lora.server.compat._overlapped_lora_apply` runs as vLLM's
``_apply_async_impl`` of a linear LoRA layer; here it runs on a stand-in
layer that holds what it reads (vLLM's real GPU Punica wrapper, with our
grouped kernels installed, stacked weights of the 8B q/k/v layer, the
layer's two events and second stream), eagerly and replayed from a CUDA
graph, against plain torch: ``x W^T + (x A_slot^T) B_slot^T`` per token.
Steps without an adapter give the base layer's output alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.lora_kernels import llama_layers, make_slots

if not torch.cuda.is_available():  # pragma: no cover - the CPU suite never collects gpu_tests
    pytest.skip("no CUDA device", allow_module_level=True)


def _layer(slots: int, rank: int, tokens: int) -> tuple[SimpleNamespace, torch.Tensor]:
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    from skyrl_lora.server.kernels import punica_ops

    assert punica_ops.install(), "the grouped kernels did not install"
    gen = torch.Generator(device="cuda").manual_seed(11)
    shape = llama_layers("8b")[0][0]  # q/k/v: three slices
    weights = make_slots(shape, slots, rank, gen)
    weight = (torch.randn(sum(shape[1]), shape[2], device="cuda", generator=gen) * 0.02).to(
        torch.bfloat16
    )
    wrapper = PunicaWrapperGPU(
        512, 64, "cuda", lora_config=SimpleNamespace(max_loras=slots, specialize_active_lora=False)
    )
    layer = SimpleNamespace(
        punica_wrapper=wrapper,
        output_slices=tuple(shape[1]),
        lora_a_stacked=tuple(weights.a),
        lora_b_stacked=tuple(weights.b),
        _events=[torch.cuda.Event(), torch.cuda.Event()],
        _lora_stream=torch.cuda.Stream(),
        base_layer=SimpleNamespace(weight=weight),
        _get_quant_method=lambda: SimpleNamespace(
            apply=lambda base, x, bias: torch.nn.functional.linear(x, base.weight, bias)
        ),
    )
    x = torch.randn(tokens, shape[2], device="cuda", generator=gen).to(torch.bfloat16)
    return layer, x


def _reference(layer: SimpleNamespace, x: torch.Tensor, mapping: torch.Tensor) -> torch.Tensor:
    out = x.float() @ layer.base_layer.weight.float().T
    col = 0
    for a, b, width in zip(layer.lora_a_stacked, layer.lora_b_stacked, layer.output_slices):
        for t, slot in enumerate(mapping.tolist()):
            if slot >= 0:
                term = (x[t].float() @ a[slot, 0].float().T) @ b[slot, 0].float().T
                out[t, col : col + width] += term
        col += width
    return out


@pytest.mark.parametrize("adapters", [0, 1, 5])
def test_overlapped_apply_equals_torch_eager_and_in_a_graph(adapters: int) -> None:
    from skyrl_lora.server import compat

    slots, rank, tokens = 8, 64, 48
    layer, x = _layer(slots, rank, tokens)
    mapping = (
        torch.arange(tokens, dtype=torch.int32) % adapters
        if adapters
        else torch.full((tokens,), -1, dtype=torch.int32)
    )
    if adapters:
        mapping[::7] = -1  # base-model tokens beside the adapters'
    layer.punica_wrapper.token_mapping_meta.prepare_tensors(mapping.cuda())
    want = _reference(layer, x, mapping)
    tol = 4 * 2**-8 * float(want.abs().max())

    got = compat._overlapped_lora_apply(layer, x)
    torch.cuda.synchronize()
    assert float((got.float() - want).abs().max()) <= tol

    holder: dict[str, torch.Tensor] = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compat._overlapped_lora_apply(layer, x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        holder["out"] = compat._overlapped_lora_apply(layer, x)
    x.mul_(-1)  # the replay reads the input in place, as vLLM's graphs do
    graph.replay()
    torch.cuda.synchronize()
    assert float((holder["out"].float() + want).abs().max()) <= tol
