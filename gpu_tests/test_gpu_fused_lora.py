"""The fused LoRA linear layer against vLLM, in bfloat16, on CUDA.

:func:`skyrl_lora.server.kernels.fused_lora.fused_lora_linear` on every
LoRA layer of the 8B shape, ranks 16 and 64, decode-sized steps with base
rows among the adapters' rows, against the base GEMM plus vLLM's own Triton
shrink and expand; then layers of three shapes sharing the workspace,
replayed from CUDA graphs of two row counts with a new mapping and input
before every replay (a pieces' handover that lost a sum, or a workspace
copy left dirty, would show); then the layer as vLLM calls it through
:func:`skyrl_lora.server.compat._overlapped_lora_apply`, with vLLM's real
unquantized linear method and GPU Punica wrapper. No server.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.lora_kernels import kernel_metadata, llama_layers, make_slots

if not torch.cuda.is_available():  # pragma: no cover - the CPU suite never collects gpu_tests
    pytest.skip("no CUDA device", allow_module_level=True)

SLOTS = 32
#: B's factor over the benchmarks' adapters (0.02 a weight), so that the LoRA
#: term is the size of the base output: with theirs it sits under the
#: tolerance at rank 16, and a term lost on some rows would pass.
LOUD_B = 25.0


@pytest.fixture(autouse=True)
def _fresh_vllm_pointer_caches() -> None:
    """vLLM's kernels, the references here, cache weights' strides by address."""
    from skyrl_lora.server import compat

    compat.forget_lora_pointer_caches()


def _mapping(tokens: int, adapters: int, shift: int = 0) -> torch.Tensor:
    mapping = (torch.arange(tokens, dtype=torch.int32) + shift) % adapters
    mapping[shift % 5 :: 5] = -1  # some rows on the base model
    return mapping


def _loud_slots(layer, count: int, rank: int, gen: torch.Generator):
    slots = make_slots(layer, count, rank, gen)
    for b in slots.b:
        b.mul_(LOUD_B)
    return slots


def _assert_lora_visible(want: torch.Tensor, base: torch.Tensor, tol: float) -> None:
    """The check can fail: the LoRA term is far past the tolerance."""
    term = float((want.float() - base.float()).abs().max())
    assert term > 8 * tol, (term, tol)


def _torch_reference(x, weight, slots, mapping, scale: float) -> torch.Tensor:
    out = x.float() @ weight.float().T
    col = 0
    for a, b in zip(slots.a, slots.b):
        width = b.size(2)
        for t, slot in enumerate(mapping.tolist()):
            if slot >= 0:
                shrunk = (scale * (x[t].float() @ a[slot, 0].float().T)).bfloat16().float()
                out[t, col : col + width] += shrunk @ b[slot, 0].float().T
        col += width
    return out


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("tokens,adapters", [(64, 8), (1, 1), (17, 3), (64, 1), (48, 32)])
def test_fused_equals_vllm_on_every_8b_layer(rank: int, tokens: int, adapters: int) -> None:
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    from skyrl_lora.server.kernels.fused_lora import fused_lora_linear

    gen = torch.Generator(device="cuda").manual_seed(rank * 1000 + tokens)
    mapping = _mapping(tokens, adapters)
    meta = kernel_metadata(mapping.cuda(), SLOTS)
    no_lora = torch.tensor([False])
    for layer in llama_layers("8b")[0]:
        name, widths, fan_in = layer
        slots = _loud_slots(layer, SLOTS, rank, gen)
        x = torch.randn(tokens, fan_in, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(sum(widths), fan_in, device="cuda", generator=gen) * 0.02).to(
            torch.bfloat16
        )
        want = torch.nn.functional.linear(x, weight)
        base = want.clone()
        buf = torch.empty(len(widths), tokens, rank, device="cuda")
        lora_shrink(
            x, slots.a, buf, meta["mapping"], meta["sorted"], meta["per"], meta["start"],
            meta["ids"], no_lora, torch.tensor([SLOTS + 1], dtype=torch.int32), 0.5,
        )  # fmt: skip
        lora_expand(
            buf, slots.b, want, meta["mapping"], meta["sorted"], meta["per"], meta["start"],
            meta["ids"], no_lora, torch.tensor([SLOTS + 1], dtype=torch.int32),
            offset_start=0, add_inputs=True,
        )  # fmt: skip
        got = fused_lora_linear(
            x, weight, None, slots.a, slots.b, tuple(widths), meta["mapping"], meta["ids"], 0.5
        )
        assert got is not None, name
        # vLLM rounds the base output to bf16 before adding the LoRA term;
        # we add in fp32 and round once: a few bf16 units of the output apart.
        tol = 4 * 2**-8 * float(want.float().abs().max())
        if bool((mapping >= 0).any()):  # (1, 1): its one row is on the base model
            _assert_lora_visible(want, base, tol)
        diff = float((got.float() - want.float()).abs().max())
        assert diff <= tol, (name, rank, tokens, adapters, diff, tol)


def test_graph_replays_of_layers_sharing_the_workspace() -> None:
    """Three layer shapes one after another in a graph, graphs of 64 and 17
    rows replayed in turn, 40 replays each with a new mapping and input."""
    from skyrl_lora.server.kernels.fused_lora import fused_lora_linear

    gen = torch.Generator(device="cuda").manual_seed(5)
    shapes = [s for s in llama_layers("8b")[0] if s[0] in ("qkv_proj", "o_proj", "down_proj")]
    layers = []
    for shape in shapes:
        slots = _loud_slots(shape, SLOTS, 64, gen)
        weight = (torch.randn(sum(shape[1]), shape[2], device="cuda", generator=gen) * 0.02).to(
            torch.bfloat16
        )
        layers.append((shape, slots, weight))
    graphs = {}
    for tokens in (64, 17):
        xs = [torch.zeros(tokens, s[2], device="cuda", dtype=torch.bfloat16) for s, _, _ in layers]
        meta = kernel_metadata(_mapping(tokens, 8).cuda(), SLOTS)

        def step(xs=xs, meta=meta):
            return [
                fused_lora_linear(
                    x, w, None, sl.a, sl.b, tuple(s[1]), meta["mapping"], meta["ids"], 1.0
                )
                for x, (s, sl, w) in zip(xs, layers)
            ]

        step()  # the workspace is made at an eager call, before any capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        graphs[tokens] = (graph, xs, meta, outs)
    worst = 0.0
    for replay in range(80):
        tokens = (64, 17)[replay % 2]
        graph, xs, meta, outs = graphs[tokens]
        mapping = _mapping(tokens, 1 + replay % 9, shift=replay)
        fresh = kernel_metadata(mapping.cuda(), SLOTS)
        for key in ("mapping", "ids"):
            meta[key].copy_(fresh[key])
        for x in xs:
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        for x, out, (shape, slots, weight) in zip(xs, outs, layers):
            want = _torch_reference(x, weight, slots, mapping, 1.0)
            _assert_lora_visible(want, x.float() @ weight.float().T, 2e-2 * float(want.abs().max()))
            err = float((out.float() - want).abs().max()) / float(want.abs().max())
            worst = max(worst, err)
            assert err <= 2e-2, (replay, shape[0], tokens, err)
    assert worst <= 2e-2


def test_the_layer_as_vllm_calls_it() -> None:
    """Through the second-stream body, with the fused kernel installed and
    vLLM's real unquantized linear method and GPU Punica wrapper: the fused
    launch for a decode step, the second stream for a longer one, both equal
    to torch."""
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from skyrl_lora.server import compat
    from skyrl_lora.server.kernels import punica_ops
    from skyrl_lora.server.kernels.fused_lora import fused_lora_linear

    assert punica_ops.install()
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = llama_layers("8b")[0][0]
    slots = _loud_slots(shape, 8, 64, gen)
    weight = (torch.randn(sum(shape[1]), shape[2], device="cuda", generator=gen) * 0.02).to(
        torch.bfloat16
    )
    bias = (torch.randn(sum(shape[1]), device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    wrapper = PunicaWrapperGPU(
        512, 8, "cuda", lora_config=SimpleNamespace(max_loras=8, specialize_active_lora=False)
    )
    method = UnquantizedLinearMethod()
    layer = SimpleNamespace(
        punica_wrapper=wrapper,
        output_slices=tuple(shape[1]),
        lora_a_stacked=tuple(slots.a),
        lora_b_stacked=tuple(slots.b),
        _events=[torch.cuda.Event(), torch.cuda.Event()],
        _lora_stream=torch.cuda.Stream(),
        base_layer=SimpleNamespace(weight=weight, bias=bias),
        _get_quant_method=lambda: method,
    )
    calls = []

    def counted(*args):
        out = fused_lora_linear(*args)
        calls.append((args[0].size(0), out is not None))
        return out

    original = compat._fused_linear
    compat._fused_linear = counted
    try:
        for tokens in (40, 100):  # 100: more rows than the fused kernel takes
            mapping = _mapping(tokens, 5)
            wrapper.token_mapping_meta.prepare_tensors(mapping.cuda())
            x = torch.randn(tokens, shape[2], device="cuda", generator=gen).to(torch.bfloat16)
            want = _torch_reference(x, weight, slots, mapping, 1.0) + bias.float()
            got = compat._overlapped_lora_apply(layer, x, bias)
            torch.cuda.synchronize()
            tol = 4 * 2**-8 * float(want.abs().max())
            _assert_lora_visible(want, x.float() @ weight.float().T + bias.float(), tol)
            assert float((got.float() - want).abs().max()) <= tol, tokens
    finally:
        compat._fused_linear = original
    assert calls == [(40, True), (100, False)]  # asked both times; it took the first
